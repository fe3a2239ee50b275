#!/usr/bin/env bash
# A lane of Model-Optimizer's GPU tests (bench/out/modelopt, assembled by assemble.sh) on the GPU
# machine, from the repository root, with the device tool's $OUT (what comes back):
#
#   [LANE=gpu] bash bench/modelopt/run.sh NAME MODES [CAP_S [compare.py options...]]
#
# LANE (default gpu_megatron): tests/gpu_megatron, or `gpu`: assemble.sh's tests/gpu files (those
# that use spawn_multiprocess_job, DistributedWorkerPool or dist_workers). Each lane has its own
# STORE (/tmp/modelopt_runs, /tmp/modelopt_runs_gpu): its collection, runs and report.
# MODES, comma-separated: `setup` and any of compare.py's modes (own, serial, xdist, xdist-kK);
# e.g. `setup,own` in one call and `serial,xdist-k4` in the next (the machine stays warm for
# 30 s after a call: make them back to back). MODES `prebuild` does steps 0, 1 and 3 only, which
# need no Transformer Engine: started detached on a fresh machine
#   setsid bash bench/modelopt/run.sh c0 prebuild >/tmp/prebuild.log 2>&1 </dev/null &
# it builds the extensions while TE is installed (the build step holds a lock that a later setup
# waits on). Setup is done once per machine, before anything is timed, and by any call that finds
# it not done:
#   0. bench/out/modelopt/site (modelopt's source) copied to /tmp/modelopt_src, where it stays;
#   1. the wheels of bench/out/modelopt/wheels into /tmp/modelopt_site (not /tmp/site, where
#      Transformer Engine is: both go on PYTHONPATH, /tmp/site first, so TE keeps its pydantic),
#      and those of wheels/gpu (deepspeed, hjson) into /tmp/modelopt_site_gpu, on PYTHONPATH
#      only for LANE=gpu (accelerate imports deepspeed wherever it can);
#   2. xdist-megatron from this checkout into /tmp/xm (every call: the checkout may have changed);
#   3. modelopt's quant CUDA extensions (modelopt_cuda_ext, _fp8, _mx) JIT-built into
#      TORCH_EXTENSIONS_DIR=/tmp/modelopt_torch_extensions, which every mode then only loads
#      (upstream's autouse _prebuild_quant_cuda_extensions still runs in each mode: a cached load);
#   4. one collection (plugin disabled): tests per module, modules that cannot import.
# Runs and their files stay in STORE, so each call's report covers the modes of the earlier calls
# of that lane on this machine too. Each mode is capped at CAP_S (default 540) and, whatever
# CAP_S says, ends by BUDGET seconds after this script started (default 570: the tool's limit is
# 600) so that the report and the files still come back. To $OUT: report-NAME.txt (the report),
# setup-NAME.log, modelopt-NAME.tar.gz (every junit, log, run report, pool log of the store).
# SUITE, SITE, SITE_GPU, TE_SITE, SRC, XM, STORE and TORCH_EXTENSIONS_DIR can be overridden (a CPU
# rehearsal points them elsewhere).
set -uo pipefail
T0=$(date +%s)
NAME=$1 MODES=$2 CAP=${3:-540}
shift $(( $# < 3 ? $# : 3 ))
REPO=$(pwd)
SUITE=${SUITE:-$REPO/bench/out/modelopt}
SITE=${SITE:-/tmp/modelopt_site} TE_SITE=${TE_SITE:-/tmp/site} SRC=${SRC:-/tmp/modelopt_src}
XM=${XM:-/tmp/xm} LANE=${LANE:-gpu_megatron}
[[ $LANE == gpu_megatron ]] && RUNS=/tmp/modelopt_runs || RUNS=/tmp/modelopt_runs_$LANE
STORE=${STORE:-$RUNS}
DEADLINE=$(( T0 + ${BUDGET:-570} ))
: "${OUT:?OUT must name the folder that comes back}"
[[ -d $SUITE/tests/$LANE ]] || { echo "no $SUITE/tests/$LANE: carry bench/out/modelopt"; exit 2; }

SITE_GPU=${SITE_GPU:-${SITE}_gpu}
[[ $LANE == gpu ]] && LANE_SITE=$SITE_GPU: || LANE_SITE=
export PYTHONPATH=$TE_SITE:$SITE:$LANE_SITE$XM:$SRC:$SUITE PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/modelopt_torch_extensions}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1  # no network: fail at once
SETUP_LOG=$OUT/setup-$NAME.log
mkdir -p "$STORE" "$OUT" "$TORCH_EXTENSIONS_DIR"

tree_sum() {  # a checksum of the files under $1 (not caches)
    (cd "$1" && find . -name __pycache__ -prune -o -type f ! -name .tree -print0 | sort -z |
        xargs -0 md5sum | md5sum)
}

sources_and_wheels() {
    # modelopt's source out of the carried folder, once (again only if it changed): the quant
    # extensions' sources keep their path and mtimes, so ninja does not rebuild them in a mode
    local tree
    tree=$(tree_sum "$SUITE/site")
    if [[ ! -f $SRC/.tree || $(cat "$SRC/.tree") != "$tree" ]]; then
        rm -rf "$SRC" && cp -a "$SUITE/site" "$SRC" && echo "$tree" >"$SRC/.tree" || return 1
        rm -f "$TORCH_EXTENSIONS_DIR/.built"
    fi
    local site wheels
    for site in "$SITE" "$SITE_GPU"; do
        [[ $site == "$SITE" ]] && wheels=$SUITE/wheels || wheels=$SUITE/wheels/gpu
        [[ -f $site/.ready ]] && continue
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --disable-pip-version-check --target "$site" "$wheels"/*.whl || return 1
        touch "$site/.ready"
    done
}

hold_lock() { ! command -v flock >/dev/null || flock 9; }  # on fd 9

build_extensions() {  # under a lock: a detached prebuild may be building them right now
    (
        hold_lock || exit 1
        [[ -f $TORCH_EXTENSIONS_DIR/.built ]] && exit 0
        cd "$SUITE" && timeout $((DEADLINE - $(date +%s) - 60)) python3 - <<'EOF' &&
"""modelopt's quant CUDA extensions, JIT-built once (what upstream's autouse fixture does)."""
import time
started = time.time()
import modelopt.torch.quantization.extensions as ext
print(f"imported modelopt.torch.quantization in {time.time() - started:.1f} s")
for get in (ext.get_cuda_ext, ext.get_cuda_ext_fp8, ext.get_cuda_ext_mx):
    start = time.time()
    module = get()
    print(f"{get.__name__}: {'built' if module is not None else 'FAILED'} in {time.time() - start:.1f} s")
EOF
            touch "$TORCH_EXTENSIONS_DIR/.built"
    ) 9>"$TORCH_EXTENSIONS_DIR/.lock"
}

setup() {
    sources_and_wheels || return 1
    python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --upgrade \
        --disable-pip-version-check --target "$XM" "$REPO" || return 1
    [[ -f $TE_SITE/.te-ready ]] || echo "WARNING: no $TE_SITE/.te-ready: without Transformer" \
        "Engine 14 of tests/gpu_megatron's 21 test modules cannot import (shared/te/README.md)"
    (cd "$SUITE" && python3 - <<'EOF'
"""What the runs import, and from where; the plugin's entry point."""
import importlib, importlib.metadata as md
import torch
for name in ["transformer_engine.pytorch", "megatron.core", "modelopt.torch", "pydantic", "pulp",
             "omegaconf", "datasets", "transformers", "deepspeed", "hydra", "torchvision",
             "modelopt.torch.puzzletron", "xdist", "xdist_megatron.plugin"]:
    try:
        module = importlib.import_module(name)
        print(f"{name:26} {getattr(module, '__file__', None)}")
    except Exception as e:  # report, and let the collection say what it costs
        print(f"{name:26} FAILED: {type(e).__name__}: {e}")
for dist in ["transformer-engine", "megatron-core", "nvidia-modelopt", "transformers", "pytest",
             "pytest-xdist", "pytest-timeout", "pyarrow", "fsspec", "huggingface-hub", "pydantic"]:
    try:
        print(f"{dist:26} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist:26} not installed")
points = [e.value for e in md.entry_points(group="pytest11") if e.value.startswith("xdist_megatron")]
print("pytest11 entry point:", points or "none (the modes pass -p xdist_megatron.plugin anyway)")
print("torch", torch.__version__, "| GPUs", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
    ) || return 1
    build_extensions || return 1
    python3 "$REPO/bench/modelopt/compare.py" --suite "$SUITE" --store "$STORE" --lane "$LANE" \
        --collect "$@" |
        sed -n '1,/tests collected/p'
}

if [[ $MODES == prebuild ]]; then
    { time { sources_and_wheels && build_extensions; }; } 2>&1
    exit
fi
echo "== setup ($(date +%T))" >"$SETUP_LOG"
{ time setup "$@"; } >>"$SETUP_LOG" 2>&1
status=$?
tail -60 "$SETUP_LOG"
if ((status != 0)); then
    echo "setup failed (exit $status): see $SETUP_LOG"
    tar -czf "$OUT/modelopt-$NAME.tar.gz" -C "$STORE" . 2>/dev/null
    exit 1
fi
echo "== setup done after $(( $(date +%s) - T0 )) s"

RUN_MODES=$(echo "$MODES" | tr ',' '\n' | grep -v '^setup$' | paste -sd, -)
python3 "$REPO/bench/modelopt/compare.py" --suite "$SUITE" --store "$STORE" --lane "$LANE" \
    --modes "$RUN_MODES" --cap "$CAP" --deadline "$DEADLINE" "$@" 2>&1 | tee "$OUT/report-$NAME.txt"
cp "$SETUP_LOG" "$STORE/" 2>/dev/null
tar -czf "$OUT/modelopt-$NAME.tar.gz" -C "$STORE" .
echo "== $NAME done after $(( $(date +%s) - T0 )) s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
