#!/usr/bin/env bash
# Assembles NVIDIA Model-Optimizer's tests/gpu_megatron lane (revision a2fbac7ba), unmodified,
# with this folder's glue in OUT, to carry to a GPU machine and run there with run.sh:
#
#   bash bench/modelopt/assemble.sh GIT_DIR OUT [WHEEL...]
#
# GIT_DIR: a clone of NVIDIA/Model-Optimizer holding the revision (a bare one will do: files come
# from `git archive`). Extracted, unmodified: pyproject.toml (its [tool.pytest.ini_options]:
# pythonpath tests/, addopts, timeout_func_only, markers), LICENSE, tests/conftest.py
# (per-directory timeouts, need_N_gpus, distributed_setup_size_1...), tests/_test_utils and
# tests/gpu_megatron; into OUT/site the `modelopt` package source and `modelopt_recipes`
# (modelopt.torch.quantization.config loads its YAML recipes). run.sh copies site/ once per
# machine out of the carried folder, so that the JIT-built extensions' sources keep their paths
# and times from call to call (a carry replaces the folder, and ninja rebuilds what is newer).
# `modelopt/__init__.py` reads its version from the nvidia-modelopt distribution's metadata: a
# dist-info in site/ with only METADATA stands in for the editable install (version as
# `git describe` gives it). The glue: conftest.py and modelopt_glue.py of this folder,
# bench/stream_reports.py, gang_pool.py and conftest.py (as pool_adapter.py) of
# examples/pool_adapter, unchanged.
# WHEELs go to OUT/wheels (fetch_wheels.sh; megatron-core's from bench/out/megatron_full/wheels).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
GIT_DIR=$1 OUT=$2
shift 2
REV=a2fbac7bad8ab446d3f8783dadb0c3366eb0ad73
VERSION=0.47.0.dev81+ga2fbac7ba  # `git describe --tags`: 0.47.0dev-81-ga2fbac7ba

git --git-dir "$GIT_DIR" cat-file -e "$REV^{commit}"
mkdir -p "$OUT"
rm -rf "$OUT"/{tests,wheels,site,modelopt,modelopt_recipes,nvidia_modelopt-*.dist-info} \
    "$OUT"/{__pycache__,.pytest_cache}
git --git-dir "$GIT_DIR" archive "$REV" pyproject.toml LICENSE tests/conftest.py tests/_test_utils \
    tests/gpu_megatron | tar -x -C "$OUT"
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

cp "$HERE"/{conftest.py,modelopt_glue.py} "$HERE/../stream_reports.py" "$OUT/"
cp "$REPO/examples/pool_adapter/gang_pool.py" "$OUT/"
cp "$REPO/examples/pool_adapter/conftest.py" "$OUT/pool_adapter.py"  # its table and marking hook
echo "$REV" >"$OUT/REVISION"
echo "$REV" >"$OUT/site/REVISION"

mkdir -p "$OUT/wheels"
for wheel in "$@"; do cp "$wheel" "$OUT/wheels/"; done
echo "$OUT: $(find "$OUT/tests/gpu_megatron" -name 'test_*.py' | wc -l) test files," \
    "$(ls "$OUT/wheels" | wc -l) wheels, $(du -sh "$OUT" | cut -f1)"
