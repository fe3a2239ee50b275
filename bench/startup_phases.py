"""Where a first run's time goes: launch to the first test, the test phase, and the last test to
the process's exit, for the serial run and for K gangs per device under `-n auto --dist
megatron`, on a generated suite whose collection costs seconds of CPU.

The suite: `--modules` test modules, each importing torch and a generated helper of
`--functions` functions (compiling them is the collection's CPU cost: bytecode writing is off
and the cache disabled, so every run pays it, as a first run does), with `--tests` tests a
module, alternately of world size 1 and 2, each busy for `--busy` seconds of CPU. Every test
stamps its start and end (time.time) into a file of its process; the launch time is taken just
before pytest starts, the exit once it has ended. `--pairs` alternating pairs (serial, K-run);
medians. The line above the table gives what collection alone costs: plain pytest's
`--collect-only` wall. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _util import (
    NO_PLUGIN,
    BenchmarkError,
    header_lines,
    machine,
    progress,
    table,
    tail,
    write_ini,
    write_record,
)

INFO = machine()
STAMPS_VAR = "STARTUP_PHASES_STAMPS"
RUN_TIMEOUT_S = 1800.0

HELPER_FUNCTION = """
def f{i}(x):
    total = 0
    for k in range({i} % 7 + 3):
        total += (x * k + {i}) % 11
        if total > {i} % 13:
            total -= k
        else:
            total += {i} % 5
    return total
"""

TEST_MODULE = """
import os
import time

import pytest
import torch  # as the distributed suites' test modules do

import helper_{m}


def _busy(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        helper_{m}.f1(3)


def _stamped(seconds):
    start = time.time()
    _busy(seconds)
    with open(os.path.join(os.environ["{var}"], f"{{os.getpid()}}.txt"), "a") as f:
        f.write(f"{{start}} {{time.time()}}\\n")
"""

TEST_FUNCTION = """

@pytest.mark.world_size({size})
def test_{m}_{t}():
    _stamped({busy})
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=40)
    parser.add_argument("--functions", type=int, default=2000, help="in each module's helper")
    parser.add_argument("--tests", type=int, default=4, help="tests a module")
    parser.add_argument("--busy", type=float, default=0.05, help="CPU seconds a test")
    parser.add_argument("--devices", default="cpu:2", help="--megatron-devices (default cpu:2)")
    parser.add_argument("-k", dest="per_device", type=int, default=2, help="gangs per device")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args()

    folder = tempfile.mkdtemp(prefix="startup-phases-")
    _generate(folder, args.modules, args.functions, args.tests, args.busy)
    environ = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    if args.devices.startswith("cpu"):
        environ["CUDA_VISIBLE_DEVICES"] = ""
    collect = _collection_wall(folder, environ)
    progress(f"collection alone (plain pytest --collect-only): {collect:.1f} s")
    base = ["-p", "no:cacheprovider", "--megatron-devices", args.devices]
    k_run = f"K={args.per_device} -n auto"
    modes = {
        "serial": base,
        k_run: [*base, "-n", "auto", "--dist", "megatron"]
        + ["--megatron-gangs-per-device", str(args.per_device)],
    }
    phases: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in modes}
    for pair in range(args.pairs):
        for mode, options in modes.items():
            phases[mode].append(_timed_run(folder, options, environ))
            first, tests, last = phases[mode][-1]
            progress(f"pair {pair + 1} {mode}: {first:.1f} s to the first test, "
                     f"{tests:.1f} s of tests, {last:.1f} s to the exit")  # fmt: skip
    count = args.modules * args.tests
    print(
        "\n".join(header_lines(f"Start-up phases: {count} tests in {args.modules} modules", INFO))
    )
    print(f"collection alone (plain pytest --collect-only, bytecode off): {collect:.1f} s; "
          f"devices {args.devices}; medians of {args.pairs} alternating pairs")  # fmt: skip
    print()
    rows, medians = [], {}
    for mode, runs in phases.items():
        medians[mode] = [statistics.median(run[i] for run in runs) for i in range(3)]
        first, tests, last = medians[mode]
        rows.append([mode, f"{first:.2f}", f"{tests:.2f}", f"{last:.2f}",
                     f"{first + tests + last:.2f}"])  # fmt: skip
    print(table(["run", "launch to first test s", "test phase s", "last test to exit s",
                 "total s"], rows))  # fmt: skip
    ratio = medians[k_run][0] / medians["serial"][0]
    print(f"\nK-run's launch to first test: {ratio:.2f}x the serial run's")
    write_record(args.json, INFO, collect=collect, phases=phases, medians=medians)
    return 0


def _generate(folder: str, modules: int, functions: int, tests: int, busy: float) -> None:
    write_ini(folder)
    for m in range(modules):
        helper = "".join(HELPER_FUNCTION.format(i=i) for i in range(functions))
        with open(os.path.join(folder, f"helper_{m}.py"), "w") as f:
            f.write(helper)
        body = TEST_MODULE.format(m=m, var=STAMPS_VAR) + "".join(
            TEST_FUNCTION.format(m=m, t=t, size=1 + t % 2, busy=busy) for t in range(tests)
        )
        with open(os.path.join(folder, f"test_mod_{m}.py"), "w") as f:
            f.write(body)


def _collection_wall(folder: str, environ: dict[str, str]) -> float:
    command = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    done = subprocess.run(
        [*command, *NO_PLUGIN], cwd=folder, env=environ, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise BenchmarkError(f"collection failed:\n{tail(done.stdout + done.stderr, 30)}")
    return time.perf_counter() - start


def _timed_run(
    folder: str, options: list[str], environ: dict[str, str]
) -> tuple[float, float, float]:
    """One run: seconds from launch to the first test's start, from there to the last test's
    end, and from there to the process's exit."""
    stamps = tempfile.mkdtemp(prefix="stamps-", dir=folder)
    command = [sys.executable, "-m", "pytest", "-q", *options]
    launch = time.time()
    done = subprocess.run(
        command,
        cwd=folder,
        env={**environ, STAMPS_VAR: stamps},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    exited = time.time()
    if done.returncode != 0:
        raise BenchmarkError(f"{' '.join(options)}:\n{tail(done.stdout + done.stderr, 30)}")
    spans = []
    for path in glob.glob(os.path.join(stamps, "*.txt")):
        with open(path) as f:
            spans += [tuple(map(float, line.split())) for line in f if line.strip()]
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    return first - launch, last - first, exited - last


if __name__ == "__main__":
    sys.exit(main())
