#!/usr/bin/env bash
# Assembles two GPU lanes of NVIDIA Model-Optimizer (revision a2fbac7ba), unmodified, in OUT, to
# carry to a GPU machine and run there with run.sh:
#
#   bash bench/modelopt/assemble.sh GIT_DIR OUT [WHEEL...]
#
# GIT_DIR: a clone of NVIDIA/Model-Optimizer holding the revision (a bare one will do: files come
# from `git archive`). Extracted, unmodified: pyproject.toml (its [tool.pytest.ini_options]:
# pythonpath tests/, addopts, timeout_func_only, markers), LICENSE, tests/conftest.py
# (per-directory timeouts, need_N_gpus, distributed_setup_size_1...), tests/_test_utils, the whole
# of tests/gpu_megatron, and of tests/gpu only the test files that use spawn_multiprocess_job,
# DistributedWorkerPool or the dist_workers fixtures (grepped at the revision), less SKIPPED below,
# with the conftest files on their paths (tests/gpu/conftest.py: its session-scoped
# `dist_workers` pool); into OUT/site the `modelopt` package source and `modelopt_recipes`
# (modelopt.torch.quantization.config loads its YAML recipes). run.sh copies site/ once per
# machine out of the carried folder, so that the JIT-built extensions' sources keep their paths
# and times from call to call (a carry replaces the folder, and ninja rebuilds what is newer).
# `modelopt/__init__.py` reads its version from the nvidia-modelopt distribution's metadata: a
# dist-info in site/ with only METADATA stands in for the editable install (version as
# `git describe` gives it). Ours, beside upstream's tree (which nothing replaces: the plugin's
# Model-Optimizer harness serves its pools): conftest.py of this folder (the pool log, every
# mode) and bench/stream_reports.py (`-p stream_reports`).
# WHEELs go to OUT/wheels (fetch_wheels.sh; megatron-core's from bench/out/megatron_full/wheels),
# deepspeed's and hjson's to OUT/wheels/gpu: only the tests/gpu lane has them on its path (where
# deepspeed can be imported, accelerate imports it, in every process of the lane).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
GIT_DIR=$1 OUT=$2
shift 2
REV=a2fbac7bad8ab446d3f8783dadb0c3366eb0ad73
VERSION=0.47.0.dev81+ga2fbac7ba  # `git describe --tags`: 0.47.0dev-81-ga2fbac7ba
POOLS='spawn_multiprocess_job|DistributedWorkerPool|dist_workers'
# tests/gpu files of the selection that cannot run there: every job builds its model from the
# Hugging Face Hub's config (AutoConfig.from_pretrained of meta-llama/..., Qwen/..., gated or
# not), and the GPU machine has no network (the Nemotron cases also want mamba_ssm)
SKIPPED=(tests/gpu/torch/puzzletron/test_puzzletron.py
    tests/gpu/torch/puzzletron/test_nas_convert.py tests/gpu/torch/puzzletron/test_nas_search.py)

git --git-dir "$GIT_DIR" cat-file -e "$REV^{commit}"
mkdir -p "$OUT"
rm -rf "$OUT"/{tests,wheels,site,modelopt,modelopt_recipes,nvidia_modelopt-*.dist-info} \
    "$OUT"/{__pycache__,.pytest_cache,gpu_lane.txt}

# the tests/gpu selection, and every conftest.py on the way to its files
mapfile -t gpu < <(git --git-dir "$GIT_DIR" grep -lE "$POOLS" "$REV" -- 'tests/gpu/*test_*.py' |
    sed "s/^$REV://" | grep -vxF -f <(printf '%s\n' "${SKIPPED[@]}"))
mapfile -t conftests < <(git --git-dir "$GIT_DIR" ls-tree -r --name-only "$REV" tests/gpu |
    grep '/conftest\.py$' | while read -r c; do
        for f in "${gpu[@]}"; do [[ $f == "${c%conftest.py}"* ]] && { echo "$c"; break; }; done
    done)
git --git-dir "$GIT_DIR" archive "$REV" pyproject.toml LICENSE tests/conftest.py tests/_test_utils \
    tests/gpu_megatron "${conftests[@]}" "${gpu[@]}" | tar -x -C "$OUT"
printf '%s\n' "${gpu[@]}" >"$OUT/gpu_lane.txt"
mkdir -p "$OUT/site"
git --git-dir "$GIT_DIR" archive "$REV" modelopt modelopt_recipes | tar -x -C "$OUT/site"

# Symbolic links become copies of their targets at the same revision (two at a2fbac7ba:
# tests/gpu_megatron/_extensions/test_torch_extensions.py -> ../../gpu/_extensions/..., and a
# recipe YAML), so that nothing depends on how a link travels to the device.
dereference() {  # ROOT: a folder extracted from the repository's root
    local root=$1 link target
    while IFS= read -r link; do
        target=$(realpath -m --relative-to="$root" "$(dirname "$link")/$(readlink "$link")")
        rm "$link"
        git --git-dir "$GIT_DIR" show "$REV:$target" >"$link"
    done < <(find "$root" -path "$root/site" -prune -o -type l -print)
}
dereference "$OUT"
dereference "$OUT/site"

info="$OUT/site/nvidia_modelopt-$VERSION.dist-info"
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: nvidia-modelopt\nVersion: %s\n' "$VERSION" >"$info/METADATA"
printf 'bench/modelopt/assemble.sh (source tree, not installed)\n' >"$info/INSTALLER"

rm -f "$OUT"/{modelopt_glue.py,gang_pool.py,pool_adapter.py}  # the retired glue of older assemblies
cp "$HERE/conftest.py" "$HERE/../stream_reports.py" "$OUT/"
echo "$REV" >"$OUT/REVISION"
echo "$REV" >"$OUT/site/REVISION"

mkdir -p "$OUT/wheels/gpu"
for wheel in "$@"; do
    case ${wheel##*/} in
        deepspeed-* | hjson-*) cp "$wheel" "$OUT/wheels/gpu/" ;;
        *) cp "$wheel" "$OUT/wheels/" ;;
    esac
done
wheels=$(find "$OUT/wheels" -name '*.whl' | wc -l)
echo "$OUT: $(find "$OUT/tests/gpu_megatron" -name 'test_*.py' | wc -l) test files in" \
    "tests/gpu_megatron, ${#gpu[@]} in tests/gpu (${#SKIPPED[@]} left out), $wheels wheels," \
    "$(du -sh "$OUT" | cut -f1)"
