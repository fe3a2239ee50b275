#!/usr/bin/env bash
# Issue 23's GPU runs (docs/real-suites.md, "Transformer Engine on one GPU") as one detached job
# on the lent machine, so that a sitting's device time goes to runs, not to the gaps between calls
# (the machine is given back 30 s after a call returns). From the repository root, on the device:
#
#   bash bench/te_sitting.sh prepare       call 1, carry ["bench/out/modelopt",
#                                          "bench/out/megatron_full"]: Model-Optimizer's prebuild
#                                          and Megatron-LM's set-up, detached (no TE needed)
#   (TE's calls, ../shared/te/README.md, the last one ending in:)
#   bash bench/te_sitting.sh start [STEPS] the job, detached; STEPS comma-separated, by default
#                                          what is still to measure (ALL below). Steps: gpu-tests;
#                                          mega-rest (Megatron-LM's suite less its TE files) in
#                                          every mode, mega-rest-M1+M2 in modes M1 and M2 only
#                                          (serial-steps: serially with step_times.py's timers);
#                                          mo-pK (Model-Optimizer's part K of 4) in every mode,
#                                          mo-pK-M1+M2 likewise; gang-start (warm starts with and
#                                          without megatron.core, alternating)
#   bash bench/te_sitting.sh poll SECONDS  every later call: waits until the job ends or SECONDS
#                                          pass, prints its step log, packs /tmp/sit into $OUT
#
# Each step writes into /tmp/sit/out/STEP (a poll brings back all of it as sitting.tgz), so a
# machine taken back mid-job still leaves what the finished steps measured. SIT (/tmp/sit) and
# PYTHON (python3, the tests' interpreter) can be overridden for a CPU rehearsal of the mechanics.
set -uo pipefail
SIT=${SIT:-/tmp/sit}
ALL=mega-rest,gang-start,mega-rest-serial-steps  # ~1,150 s after TE's ~300 s; most wanted first

note() { echo "== $(date +%T) $*" >>"$SIT/steps.log"; }

megatron_rest() {  # MODES: the suite less te_files.txt, each mode its own run_whole.sh (junit)
    local mode cap extra
    for mode in ${1//,/ }; do
        case $mode in torchrun) cap=480 ;; serial*) cap=420 ;; *) cap=300 ;; esac
        extra=(); [[ $mode == serial-steps ]] && extra=(--plugin-args="-p step_times")
        note "mega-rest $mode"
        mkdir -p "$SIT/out/mega-rest-$mode"
        # serial-steps: serially, with the per-step timers of step_times.py (gc.collect included)
        STEP_TIMES_DIR=$SIT/out/mega-rest-$mode/steps PYTHONPATH=/tmp/site \
            OUT=$SIT/out/mega-rest-$mode EXCEPT=te_files.txt timeout $((cap + 150)) \
            bash bench/out/megatron_full/run_whole.sh "rest-$mode" "${mode%-steps}" --cap "$cap" \
            "${extra[@]}" >"$SIT/out/mega-rest-$mode.log" 2>&1
        note "mega-rest $mode: exit $?"
        if [[ -d $SIT/out/mega-rest-$mode/steps ]]; then
            ${PYTHON:-python3} bench/megatron_lm/step_times.py "$SIT/out/mega-rest-$mode/steps" \
                >"$SIT/out/mega-rest-$mode/steps.txt"
        fi
    done
}

modelopt() {  # NAME MODES CAP PART
    mkdir -p "$SIT/out/$1"
    OUT=$SIT/out/$1 BUDGET=1200 bash bench/modelopt/run.sh "$1" "$2" "$3" --part "$4" \
        >"$SIT/out/$1.log" 2>&1
}

run_step() {
    case $1 in
        gpu-tests)
            PYTEST_PLUGINS=xdist_megatron.plugin PYTHONPATH=/tmp/site:$PWD timeout 300 \
                ${PYTHON:-python3} -m pytest tests/test_gpu.py -k gang_function_faults -rA -p no:cacheprovider \
                >"$SIT/out/gpu-tests.log" 2>&1 ;;
        mo-p[1-4]) modelopt "$1" own,serial,xdist-k4 280 "${1#mo-p}/4" ;;
        mo-p[1-4]-*)  # some modes of a part, `+`-separated: mo-p3-serial, mo-p3-own+xdist-k4
            local part=${1#mo-p}; modelopt "$1" "$(tr + , <<<"${part#*-}")" 280 "${part%%-*}/4" ;;
        gang-start)  # warm starts with and without megatron.core preloaded, side by side
            for flag in "" --no-megatron "" --no-megatron; do
                PYTHONPATH=/tmp/site:$PWD:$PWD/bench timeout 150 ${PYTHON:-python3} bench/gang_start.py \
                    --quick --sizes 1 --repeats 10 --tests 20 $flag >>"$SIT/out/gang-start$flag.log" 2>&1
            done ;;
        mega-rest) megatron_rest torchrun,serial,xdist-k4 ;;
        mega-rest-*) megatron_rest "$(tr + , <<<"${1#mega-rest-}")" ;;  # mega-rest-serial+xdist-k4
        *) echo "unknown step $1"; return 2 ;;
    esac
}

job() {
    note "job started: $1"
    for _ in $(seq 600); do [[ -f $SIT/prepared ]] && break; sleep 1; done
    note "prepared: $(cat "$SIT/prepared" 2>/dev/null || echo 'not after 600 s')"
    for step in ${1//,/ }; do
        note "$step"
        run_step "$step"
        note "$step: exit $?"
    done
    note "job done"
    touch "$SIT/done"
}

case ${1:-} in
    prepare)
        mkdir -p "$SIT/out"
        setsid bash -c "OUT=$SIT/out bash bench/modelopt/run.sh prebuild prebuild \
            >$SIT/out/prebuild.log 2>&1; bash bench/out/megatron_full/setup_device.sh \
            >$SIT/out/megatron-setup.log 2>&1 && touch /tmp/megatron_site/.ready; \
            echo \"prebuild and megatron set-up ended \$(date +%T)\" >$SIT/prepared" \
            </dev/null >/dev/null 2>&1 &
        echo "preparing (pid $!)" ;;
    start)
        mkdir -p "$SIT/out"
        setsid bash "$0" job "${2:-$ALL}" </dev/null >>"$SIT/job.log" 2>&1 &
        echo "job $! started: ${2:-$ALL}" ;;
    job) job "$2" ;;
    poll)
        : "${OUT:?OUT must name the folder that comes back}"
        deadline=$(($(date +%s) + ${2:-500}))
        while [[ ! -f $SIT/done ]] && (($(date +%s) < deadline)); do sleep 5; done
        cat "$SIT/steps.log" 2>/dev/null
        tar czf "$OUT/sitting.tgz" -C "$SIT" . ;;
    *) sed -n '2,23p' "$0"; exit 2 ;;
esac
