#!/usr/bin/env bash
# Megatron-LM's whole unit suite at world size 1, as assembled by `assemble.sh --whole`, on a GPU
# machine (the device tool: $OUT is the folder that comes back):
#   OUT=/some/folder bash bench/out/megatron_full/run_whole.sh NAME MODES [real_suite.py options]
# e.g. `... run_whole.sh k torchrun,serial,xdist,xdist-k2,xdist-k4,xdist-k8`. It sets up once per
# machine (setup_device.sh), deselects test_oom_is_handled (it fills 60% of the GPU, then the host:
# the kernel kills the rank) and keeps going past the modules that cannot import here.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
NAME=$1 MODES=$2; shift 2
if [[ ! -f /tmp/megatron_site/.ready ]]; then
  bash "$HERE/setup_device.sh" >"$OUT/setup-$NAME.log" 2>&1 && touch /tmp/megatron_site/.ready
  tail -3 "$OUT/setup-$NAME.log"
fi
export PYTHONPATH=/tmp/megatron_site:$HERE/site:$HERE  # env.sh: a carry replaces this folder
cd "$HERE"
python3 ../../real_suite.py tests/unit_tests --nproc 1 --modes "$MODES" --out "$OUT/runs-$NAME" \
  --json "$OUT/$NAME.json" --cap 560 \
  --pytest-args="--continue-on-collection-errors -p no:cacheprovider --deselect tests/unit_tests/dist_checkpointing/models/test_mlp_glu.py::TestParallelMLPWithGLU::test_oom_is_handled" "$@"
