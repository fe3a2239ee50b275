#!/usr/bin/env bash
# Megatron-LM's whole unit suite at world size 1, as assembled by `assemble.sh --whole`, on a GPU
# machine (the device tool: $OUT is the folder that comes back):
#   OUT=/some/folder bash bench/out/megatron_full/run_whole.sh NAME MODES [real_suite.py options]
# e.g. `... run_whole.sh k torchrun,serial,xdist,xdist-k2,xdist-k4,xdist-k8`. It sets up once per
# machine (setup_device.sh), deselects test_oom_is_handled (it fills 60% of the GPU, then the host:
# the kernel kills the rank) and keeps going past the modules that cannot import here.
# With TESTS=FILE only the test paths FILE lists run (te_files.txt: the TE set), with EXCEPT=FILE
# every test file but those (EXCEPT=te_files.txt: the rest of the suite, with TE installed); a
# PYTHONPATH already set (Transformer Engine's /tmp/site) stays, after the suite's own.
# The collected ids are kept in /tmp for the machine's later calls (collect-only: ~27 s). MODES
# `collect` sets up and collects only: a first call of ~100 s, so that every later call of the
# sitting has its 600 s for two whole runs (serial and K = 1 took 480-530 s together).
# The logs and junit files come back as one archive, runs-NAME.tgz (8 files come back at most).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
NAME=$1 MODES=$2; shift 2
if [[ ! -f /tmp/megatron_site/.ready ]]; then
  bash "$HERE/setup_device.sh" >"$OUT/setup-$NAME.log" 2>&1 && touch /tmp/megatron_site/.ready
  tail -3 "$OUT/setup-$NAME.log"
fi
# The machine has no network: Hugging Face's hub is told so, in every mode, or each tokenizer test
# that asks it retries for half a minute (test_megatron_tokenizer: 47 s) before failing the same way.
export HF_HUB_OFFLINE=1
export PYTHONPATH=/tmp/megatron_site:$HERE/site:$HERE${PYTHONPATH:+:$PYTHONPATH}
cd "$HERE"
PATHS=(tests/unit_tests) SET=whole
if [[ -n ${TESTS:-} ]]; then mapfile -t PATHS < <(grep -v '^#' "$TESTS"); SET=$(basename "$TESTS" .txt); fi
if [[ -n ${EXCEPT:-} ]]; then  # the whole suite less the files EXCEPT lists (the rest of a set)
  mapfile -t IGNORED < <(grep -v '^#' "$EXCEPT" | sed 's/^/--ignore=/'); SET=except-$(basename "$EXCEPT" .txt)
  PATHS+=("${IGNORED[@]}")
fi
python3 ../../real_suite.py "${PATHS[0]}" --nproc 1 --modes "$MODES" --out "$OUT/runs-$NAME" \
  --json "$OUT/$NAME.json" --cap 560 --collected "/tmp/collected-$SET.txt" \
  --pytest-args="--continue-on-collection-errors -p no:cacheprovider --deselect tests/unit_tests/dist_checkpointing/models/test_mlp_glu.py::TestParallelMLPWithGLU::test_oom_is_handled ${PATHS[*]:1}" "$@"
status=$?
tar czf "$OUT/runs-$NAME.tgz" -C "$OUT" "runs-$NAME" && rm -rf "$OUT/runs-$NAME"
exit $status
