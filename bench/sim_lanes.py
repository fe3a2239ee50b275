"""The scheduler on simulated lanes: makespan against the ideal bound, today and before a change.

`python bench/sim_lanes.py --lanes 100` draws that many random lanes of issue 21's shape (60
tests in 10 modules, world sizes 1/2/4/8 drawn 4:3:2:1, 0.2-1.5 s each; 8 devices, 8 workers),
runs each through the simulator (bench/_simulator.py: the package's real
`MegatronScheduling` driven through fake xdist workers on a clock, with gang starts, module
collection, held-back tests and device locks) and prints median, p90 and max of makespan / ideal
bound, for today's scheduler and placement and for the scheduler at `--before` (default 7d30ff1,
before issue 21) with the placement of then (worker j's block: j modulo the blocks). Each runs
twice: with the durations known (a run after one that recorded them) and unknown (a first run,
or `-p no:cacheprovider`, as bench/lane.py runs).

No processes and no sleeps: 100 lanes take a few seconds. Progress goes to stderr, the table to
stdout. Run `python bench/sim_lanes.py --help` for the options.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from _util import (
    BenchmarkError,
    header_lines,
    left_out_line,
    machine,
    percentile,
    progress,
    scheduler_at,
    simulator,
    table,
    write_json,
)

BEFORE = "7d30ff1"  # the last commit before issue 21's scheduler
TARGET_MEDIAN = 1.1
TARGET_MAX = 1.3


@dataclass(frozen=True)
class Variant:
    """A scheduler and a placement to simulate, and what the scheduler is told of durations."""

    label: str
    scheduler: Any  # a MegatronScheduling class
    placed: bool  # True: today's placement (for the worker count); False: j modulo the blocks
    known: bool  # the durations are the scheduler's to order work by


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", type=int, default=100, help="lanes to simulate (default 100)")
    parser.add_argument("--first-seed", type=int, default=0, help="seed of the first lane")
    parser.add_argument("--modules", type=int, default=10)
    parser.add_argument("--tests", type=int, default=60)
    parser.add_argument("--device-count", type=int, default=8, help="devices, default 8")
    parser.add_argument("--workers", type=int, default=8, help="xdist workers, default 8")
    parser.add_argument(
        "--gangs-per-device",
        type=int,
        default=1,
        help="K slots per device (default 1); give --workers devices x K, as -n auto does",
    )
    parser.add_argument("--gang-start", type=float, default=0.1, help="seconds (default 0.1)")
    parser.add_argument("--module-cost", type=float, default=0.05, help="seconds (default 0.05)")
    parser.add_argument("--before", default=BEFORE, help=f"git revision (default {BEFORE})")
    parser.add_argument("--json", metavar="PATH", help="write the numbers to PATH as JSON")
    return parser.parse_args(argv)


def variants(before: str) -> tuple[list[Variant], list[str]]:
    """Today's scheduler and, where git can show it, the one at `before`."""
    today = simulator().MegatronScheduling
    found = [Variant("today", today, True, known) for known in (True, False)]
    try:
        landed = scheduler_at(before)
    except BenchmarkError as exc:
        return found, [f"before ({before}): {exc}"]
    return [Variant(f"before ({before})", landed, False, k) for k in (True, False)] + found, []


def simulate_lanes(args: argparse.Namespace, variant: Variant, folder: str) -> dict[str, Any]:
    """Every lane under `variant`: the ratios to the ideal and what the runs did."""
    sim = simulator()
    costs = sim.Costs(gang_start=args.gang_start, module=args.module_cost)
    placed_for = args.workers if variant.placed else 0
    devices = sim.cpu_devices(args.device_count, placed_for, args.gangs_per_device)
    ratios, starts, steals = [], [], []
    for seed in range(args.first_seed, args.first_seed + args.lanes):
        lane = sim.random_lane(seed, modules=args.modules, tests=args.tests)
        known = None if variant.known else {}
        result = sim.simulate(
            lane, devices, args.workers, costs, known, variant.scheduler, session_dir=folder
        )
        ratios.append(result.ratio)
        starts.append(result.gang_starts)
        steals.append(result.steals)
    return {"ratios": ratios, "gang_starts": starts, "steals": steals}


def row(variant: Variant, numbers: dict[str, Any]) -> list[str]:
    ratios = numbers["ratios"]
    return [
        variant.label,
        "known" if variant.known else "unknown",
        f"{statistics.median(ratios):.3f}",
        f"{percentile(ratios, 90):.3f}",
        f"{max(ratios):.3f}",
        str(sum(r > TARGET_MAX for r in ratios)),
        f"{statistics.fmean(numbers['gang_starts']):.1f}",
        f"{statistics.fmean(numbers['steals']):.1f}",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    found, notes = variants(args.before)
    headers = ["scheduler", "durations", "median", "p90", "max", f"> {TARGET_MAX}x"]
    headers += ["gang starts (mean)", "steals (mean)"]
    rows, record = [], []
    with tempfile.TemporaryDirectory() as folder:  # the landed scheduler writes its plan file
        for variant in found:
            progress(f"{variant.label}, durations {'known' if variant.known else 'unknown'}")
            numbers = simulate_lanes(args, variant, folder)
            rows.append(row(variant, numbers))
            record.append({"label": variant.label, "known": variant.known, **numbers})
    for line in header_lines("Simulated lanes: makespan / ideal bound", machine()):
        print(line)
    print(
        f"lanes   : {args.lanes} (seeds {args.first_seed}-{args.first_seed + args.lanes - 1}), "
        f"{args.tests} tests in {args.modules} modules, ws1/2/4/8 drawn 4:3:2:1, 0.2-1.5 s; "
        f"{args.device_count} devices x {args.gangs_per_device} gangs, {args.workers} workers; "
        f"gang start {args.gang_start} s, "
        f"module {args.module_cost} s"
    )
    print(
        "ideal   : one gang start and module, then max(device-seconds / (devices x gangs), "
        "longest test)"
    )
    print(left_out_line(notes))
    print()
    print(table(headers, rows))
    print(f"target: median <= {TARGET_MEDIAN}x, none over {TARGET_MAX}x")
    if args.json:
        write_json(args.json, {"args": vars(args), "variants": record})
    return 0


if __name__ == "__main__":
    sys.exit(main())
