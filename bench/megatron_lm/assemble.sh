#!/usr/bin/env bash
# Assembles Megatron-LM's unit tests (tag core_v0.16.1) with this folder's glue in OUT, to carry to
# a GPU machine and run there with setup_device.sh and bench/real_suite.py.
#
#   bash bench/megatron_lm/assemble.sh GIT_DIR OUT [--whole] [WHEEL...]
#
# GIT_DIR: a clone of NVIDIA/Megatron-LM with the tag (a bare one will do: files come from
# `git archive`, unmodified). Without --whole, the 280-test subset of docs/real-suites.md; with
# it, the whole `tests/unit_tests` and the rest of the repository it imports (`tools/`, the root's
# builders and entry points, `megatron/{training,rl,legacy,post_training}` into site/). WHEELs go
# to OUT/wheels.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
GIT_DIR=$1 OUT=$2
shift 2
WHOLE=0
if [[ ${1:-} == --whole ]]; then WHOLE=1; shift; fi
TAG=core_v0.16.1

extract() {  # extract PATH... into OUT from the tag
    git --git-dir "$GIT_DIR" archive "$TAG" "$@" | tar -x -C "$OUT"
}

mkdir -p "$OUT/site/megatron" "$OUT/wheels"
if ((WHOLE)); then
    extract tests/__init__.py tests/unit_tests tests/test_utils tools \
        model_provider.py gpt_builders.py mamba_builders.py
else
    UT=tests/unit_tests
    extract tests/__init__.py $UT/__init__.py $UT/conftest.py $UT/test_utilities.py \
        $UT/test_parallel_state.py $UT/tensor_parallel $UT/distributed $UT/transformer/__init__.py \
        $UT/transformer/test_mlp.py $UT/dist_checkpointing/__init__.py \
        $UT/dist_checkpointing/utils.py tests/test_utils/python_scripts \
        model_provider.py gpt_builders.py
    rm -f "$OUT/$UT/distributed/megatron_fsdp/test_mfsdp_fully_shard.py"  # imports TE
fi
for part in training rl legacy post_training; do
    git --git-dir "$GIT_DIR" archive "$TAG" "megatron/$part" | tar -x -C "$OUT/site"
done
cp "$HERE"/{conftest.py,pytest.ini,setup_device.sh,step_times.py,run_whole.sh,te_files.txt} "$OUT/"
for wheel in "$@"; do cp "$wheel" "$OUT/wheels/"; done
echo "$OUT: $(find "$OUT/tests" -name 'test_*.py' | wc -l) test files, $(du -sh "$OUT" | cut -f1)"
