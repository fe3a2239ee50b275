"""What `-n auto --dist megatron` costs where nothing can run side by side: a generated suite whose
every test needs all the devices (world size = the device count), serially and under xdist, the
two modes alternating, whole-process wall time of each run, medians and their ratio.

On one GPU this is every suite: one gang holds the only device. The target (docs/benchmarks.md,
"xdist start-up"): xdist at most 1.05x the serial wall. Run `python bench/xdist_overhead.py --help`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from _util import (
    add_devices_option,
    header_lines,
    machine,
    progress,
    resolve_devices,
    run_checked,
    table,
    write_ini,
)

DIST = ["--dist", "megatron"]
REMEMBERED = "-n auto, after a run"  # the pytest cache holds the last run's world sizes


def modes(world_size: int, landed_auto: int) -> dict[str, list[str]]:
    """Serial; -n auto without and with the world sizes known before collection (only then can
    it start no workers): given, or remembered from the last run in the pytest cache
    (`REMEMBERED`, the one mode that keeps a cache); and as many workers as -n auto started
    before it could."""
    known = ["--megatron-world-sizes", str(world_size)]
    return {
        "serial": [],
        "-n auto": ["-n", "auto", *DIST],
        "-n auto, world sizes given": ["-n", "auto", *DIST, *known],
        REMEMBERED: ["-n", "auto", *DIST],
        f"-n {landed_auto} (-n auto until now)": ["-n", str(landed_auto), *DIST],
    }


def add_suite_options(parser: argparse.ArgumentParser, tests: int, modules: int) -> None:
    """The generated suite's shape (`write_suite`), the rounds and the devices."""
    parser.add_argument("--tests", type=int, default=tests, help=f"tests (default {tests})")
    parser.add_argument("--modules", type=int, default=modules, help="modules they are dealt to")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the test durations")
    parser.add_argument("--min-s", type=float, default=0.2, help="shortest test body, seconds")
    parser.add_argument("--max-s", type=float, default=1.5, help="longest test body, seconds")
    add_devices_option(parser)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_suite_options(parser, tests=24, modules=4)
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="a folder holding another xdist_megatron (`git archive REV xdist_megatron | tar -x "
        "-C DIR`): its -n auto and -n N runs join the rounds, first on PYTHONPATH",
    )
    return parser.parse_args(argv)


def with_baseline(runs: dict[str, list[str]], baseline: str | None) -> dict[str, list[str]]:
    """The baseline's runs of the modes that start workers, named "... (baseline)"."""
    if baseline is None:
        return runs
    started = [mode for mode in runs if mode.startswith("-n") and mode != REMEMBERED]
    return runs | {f"{mode} (baseline)": runs[mode] for mode in started if "given" not in mode}


def env_of(mode: str, baseline: str | None) -> dict[str, str] | None:
    if baseline is None or not mode.endswith("(baseline)"):
        return None
    path = os.pathsep.join(p for p in (baseline, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def write_suite(folder: Path, args: argparse.Namespace, world_size: int) -> float:
    """The suite's modules; returns the sum of the test bodies' sleeps."""
    rng = random.Random(args.seed)
    total = 0.0
    modules: list[list[str]] = [[] for _ in range(args.modules)]
    for index in range(args.tests):
        seconds = round(rng.uniform(args.min_s, args.max_s), 3)
        total += seconds
        modules[index % args.modules].append(
            f"\n\n@pytest.mark.world_size({world_size})\ndef test_{index:03d}():\n"
            f"    dist.barrier()\n    time.sleep({seconds})\n"
        )
    for number, tests in enumerate(modules):
        header = "import time\n\nimport pytest\nimport torch.distributed as dist\n"
        (folder / f"test_part{number}.py").write_text(header + "".join(tests))
    write_ini(str(folder))
    return total


def run_mode(
    folder: Path,
    options: list[str],
    devices: list[str],
    cache: bool = False,
    env: dict[str, str] | None = None,
) -> float:
    """Whole-process wall of one run; without the pytest cache unless `cache`."""
    no_cache = [] if cache else ["-p", "no:cacheprovider"]
    command = [sys.executable, "-m", "pytest", "-q", *no_cache, *devices, *options]
    wall, _ = run_checked(command, str(folder), timeout=1800, env=env)
    return wall


def alternate(
    folder: Path,
    runs: dict[str, list[str]],
    rounds: int,
    devices: list[str],
    baseline: str | None = None,
) -> dict[str, list[float]]:
    """Each mode's whole-process wall per round; each round starts with the next mode (the
    machine is shared: no mode always runs first, on cold caches, or last)."""
    walls: dict[str, list[float]] = {mode: [] for mode in runs}
    for round_number in range(rounds):
        shift = round_number % len(runs)
        for mode in list(runs)[shift:] + list(runs)[:shift]:
            cache = mode == REMEMBERED
            wall = run_mode(folder, runs[mode], devices, cache, env_of(mode, baseline))
            progress(f"round {round_number + 1}: {mode}: {wall:.2f} s")
            walls[mode].append(wall)
    return walls


def walls_table(
    walls: dict[str, list[float]], column: str, ratio: Callable[[float, float], float]
) -> str:
    """Each mode's runs, median, and `ratio(median, serial's median)` under `column`."""
    serial = statistics.median(walls["serial"])
    rows = []
    for mode, times in walls.items():
        median = statistics.median(times)
        rows.append([mode, *(f"{w:.2f}" for w in times), f"{median:.2f}"])
        rows[-1].append(f"{ratio(median, serial):.3f}x")
    rounds = len(walls["serial"])
    return table(["mode", *(f"run {i + 1}" for i in range(rounds)), "median", column], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices = resolve_devices(args.devices)
    world_size = devices.count
    info = machine()  # the load before the runs
    landed_auto = devices.count if not devices.is_cpu else os.cpu_count() or 1
    runs = with_baseline(modes(world_size, landed_auto), args.baseline)
    with tempfile.TemporaryDirectory(prefix="xdist-overhead-") as folder:
        sleeps = write_suite(Path(folder), args, world_size)
        run_mode(Path(folder), runs[REMEMBERED], devices.plugin_options(), cache=True)  # fills it
        walls = alternate(Path(folder), runs, args.rounds, devices.plugin_options(), args.baseline)
    print("\n".join(header_lines("xdist-megatron benchmark: xdist where one gang fits", info)))
    print(f"suite   : {args.tests} tests of world size {world_size} in {args.modules} modules,")
    print(f"          {sleeps:.1f} s of sleep in all ({args.min_s}-{args.max_s} s each)")
    print(f"devices : {devices.describe()}")
    if args.baseline:
        print(f"baseline: xdist_megatron from {args.baseline}")
    print("\nWhole-process wall [s]; each round starts with the next mode")
    print(walls_table(walls, "vs serial", lambda median, serial: median / serial))
    return 0


if __name__ == "__main__":
    sys.exit(main())
