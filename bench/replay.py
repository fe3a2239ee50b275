"""Replay a recorded run: what `-n D --dist megatron` would take on D = 1, 2, 4 and 8 devices.

Reads a run's junit XML (`--junitxml`: the plugin writes each marked test's world size into its
properties), its run report (`--megatron-report PATH.json`: pytest's node ids, each test's span),
a durations file (`--megatron-durations PATH --megatron-store-durations`) or one run of a
`bench/real_suite.py --json` file (`--run NAME`; every test at its `--nproc`), and prints,
for each D, against the same tests:

- serial: the sum of the durations (the plugin without xdist: one test after another);
- torchrun: one `torchrun --nproc-per-node N -m pytest` session per world size N, one after
  another, each running its bucket's tests in turn on N devices (unmarked tests go with N = 1):
  the same sum, plus `--session-start` seconds for each session's processes to start;
- megatron: the makespan of the simulator (bench/_simulator.py: the package's real
  `MegatronScheduling`, D x K fake xdist workers as `-n auto` starts with `--gangs-per-device K`,
  a clock), told the durations (a run after one that stored them), those of `--told PATH` (the
  durations file the recorded run was given) or, with `--first-run`, none; with `--before REV`,
  beside it the scheduler of git revision REV;
- the ideal bound: max(device-seconds / (D x K), longest test).

What the lane would gain on hardware the project cannot borrow yet. A recorded duration is the
test's setup, call and teardown, so it already holds the recorded run's gang starts and module
collections; `--gang-start` and `--module-cost` (default 0) charge each one the simulated schedule
makes on top of that. Tests of more ranks than D are left out, and a `left out:` line says which.
`--exclusive PREFIX` marks the tests whose node ids start with PREFIX `exclusive_devices`, as a
suite's conftest marks them (the record does not say).
Run `python bench/replay.py --help` for the options.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from _util import (
    header_lines,
    left_out_line,
    machine,
    ratio,
    scheduler_at,
    simulator,
    table,
    write_json,
)

WORLD_SIZE_PROPERTY = "world_size"  # what driver/run_facts.py names it in the junit properties
DEVICE_COUNTS = (1, 2, 4, 8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "record",
        help="a junit XML file, a run report, a durations file or a real_suite.py JSON file",
    )
    parser.add_argument("--run", help="the run of a real_suite.py JSON file (default its first)")
    parser.add_argument(
        "--device-counts",
        default=",".join(map(str, DEVICE_COUNTS)),
        help="the numbers of devices D to replay on (default 1,2,4,8)",
    )
    parser.add_argument(
        "--gang-start",
        type=float,
        default=0.0,
        help="seconds charged per simulated gang start (default 0; warm on CPU: 0.1)",
    )
    parser.add_argument(
        "--module-cost",
        type=float,
        default=0.0,
        help="seconds charged per module a simulated gang collects (default 0)",
    )
    parser.add_argument(
        "--session-start",
        type=float,
        default=0.0,
        help="seconds for a torchrun session's ranks to start and import (default 0)",
    )
    parser.add_argument(
        "--gangs-per-device",
        type=int,
        default=1,
        metavar="K",
        help="--megatron-gangs-per-device of the simulated runs (default 1)",
    )
    parser.add_argument(
        "--first-run",
        action="store_true",
        help="the scheduler knows no durations (a first run, or one without the pytest cache)",
    )
    parser.add_argument(
        "--told",
        metavar="PATH",
        help="a durations file the scheduler is told instead (the run's --megatron-durations)",
    )
    parser.add_argument(
        "--exclusive",
        action="append",
        default=[],
        metavar="PREFIX",
        help="mark the tests whose node ids start with PREFIX exclusive_devices (repeatable)",
    )
    parser.add_argument(
        "--before", metavar="REV", help="also replay with the scheduler of git revision REV"
    )
    parser.add_argument("--json", metavar="PATH", help="write the numbers to PATH as JSON")
    args = parser.parse_args(argv)
    if args.told and args.first_run:
        parser.error("--told and --first-run: the scheduler is told one or the other")
    return args


# -- reading a record -----------------------------------------------------------------------------


def read_record(path: Path, run: str | None = None) -> list[Any]:
    """The recorded tests as the simulator's SimTests, in the record's order."""
    text = path.read_text()
    if text.lstrip().startswith("<"):
        return from_junit(ElementTree.fromstring(text))
    data = json.loads(text)
    if isinstance(data, dict) and "runs" in data:
        return from_real_suite(data, run)
    if isinstance(data, dict) and isinstance(data.get("tests"), list):
        return from_report(data)
    return from_durations(data)


def from_junit(root: ElementTree.Element) -> list[Any]:
    """Each <testcase>: node id and module from its file or class name, world size from its
    properties (none: an unmarked test), duration from its time."""
    sim = simulator()
    tests: dict[str, Any] = {}
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        module = case.get("file") or module_of_classname(classname)
        nodeid = f"{classname}::{name}"
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        size = properties.get(WORLD_SIZE_PROPERTY)
        world_size = int(size) if size not in (None, "", "None") else None
        duration = float(case.get("time") or 0.0)
        tests.setdefault(nodeid, sim.SimTest(nodeid, module, world_size, duration))
    return list(tests.values())


def module_of_classname(classname: str) -> str:
    """`pkg.test_mod.TestClass` -> `pkg.test_mod`: junit joins module and class with dots, and
    class names start with a capital letter."""
    parts = classname.split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():
        parts.pop()
    return ".".join(parts)


def from_durations(data: dict) -> list[Any]:
    """A durations file: {"version": 1, "tests": {nodeid: {world_size, duration}}}."""
    sim = simulator()
    tests = data.get("tests") if isinstance(data, dict) else None
    if not isinstance(tests, dict):
        raise SystemExit('a durations file is {"version": 1, "tests": {nodeid: {...}}}')
    return [
        sim.SimTest(nodeid, nodeid.split("::")[0], entry.get("world_size"), entry["duration"])
        for nodeid, entry in tests.items()
    ]


def from_report(data: dict) -> list[Any]:
    """A run report: {"tests": [{nodeid, world_size, start, end, ...}]}, each test's span on its
    worker (its setup, call and teardown), in the order the tests started."""
    sim = simulator()
    entries = sorted(data["tests"], key=lambda entry: entry["start"])
    return [
        sim.SimTest(
            entry["nodeid"],
            entry["nodeid"].split("::")[0],
            entry.get("world_size"),
            entry["end"] - entry["start"],
        )
        for entry in entries
    ]


def from_real_suite(data: dict, run: str | None) -> list[Any]:
    """One run of a real_suite.py JSON file: its tests (junit keys) at the file's --nproc."""
    runs = {entry["name"]: entry for entry in data["runs"]}
    name = run or next(iter(runs), None)
    if name not in runs:
        raise SystemExit(f"no run {name!r} in the file; it has {', '.join(runs) or 'none'}")
    sim = simulator()
    size = data["arguments"]["nproc"]
    return [
        sim.SimTest(key, module_of_classname(key.split("::")[0]), size, result["seconds"])
        for key, result in runs[name]["tests"].items()
    ]


# -- the figures ----------------------------------------------------------------------------------


def torchrun_buckets(tests: list[Any], session_start: float) -> float:
    """One torchrun session per world size, in turn: each bucket's tests one after another."""
    buckets = {test.world_size or 1 for test in tests}
    return sum(test.duration for test in tests) + session_start * len(buckets)


def mark_exclusive(tests: list[Any], prefixes: list[str]) -> list[Any]:
    """The tests, those whose node ids start with one of `prefixes` marked exclusive_devices."""
    return [
        replace(t, exclusive=True) if any(t.nodeid.startswith(p) for p in prefixes) else t
        for t in tests
    ]


def replay(
    tests: list[Any],
    count: int,
    costs: Any,
    session_start: float,
    slots: int,
    known: dict[str, float] | None,
    before: Any = None,
) -> dict[str, Any]:
    """The figures on `count` devices, `slots` gangs per device, for the tests that fit them;
    `known`: what the scheduler is told (None: the recorded durations); `before`: a scheduler
    class to replay beside today's."""
    sim = simulator()
    fitting = [t for t in tests if (t.world_size or 1) <= count]
    workers = count * slots
    devices = sim.cpu_devices(count, workers, slots)
    result = sim.simulate(fitting, devices, workers, costs, known) if fitting else None
    serial = sum(t.duration for t in fitting)
    megatron = result.makespan if result else 0.0
    earlier = None
    if before is not None and fitting:
        earlier = sim.simulate(fitting, devices, workers, costs, known, scheduler=before).makespan
    return {
        "devices": count,
        "tests": len(fitting),
        "left_out": Counter(t.world_size for t in tests if (t.world_size or 1) > count),
        "serial": serial,
        "torchrun": torchrun_buckets(fitting, session_start),
        "megatron": megatron,
        "before": earlier,
        "ideal": result.ideal if result else 0.0,
        "gang_starts": result.gang_starts if result else 0,
        "steals": result.steals if result else 0,
    }


def seconds(value: float) -> str:
    """Two decimals, sums that differ only in the float rounding of their order shown alike."""
    return f"{value + 1e-9:.2f}"


def report(rows: list[dict[str, Any]], before: str | None = None) -> str:
    headers = [
        "devices (-n D)",
        "tests",
        "serial (s)",
        "torchrun per size (s)",
        "--dist megatron, simulated (s)",
        "ideal (s)",
        "serial / megatron",
        "torchrun / megatron",
        "megatron / ideal",
        "gang starts",
    ]
    cells = [
        [
            str(row["devices"]),
            str(row["tests"]),
            seconds(row["serial"]),
            seconds(row["torchrun"]),
            seconds(row["megatron"]),
            seconds(row["ideal"]),
            ratio(row["serial"], row["megatron"]),
            ratio(row["torchrun"], row["megatron"]),
            ratio(row["megatron"], row["ideal"]),
            str(row["gang_starts"]),
        ]
        for row in rows
    ]
    if before is not None:  # the scheduler at `before`, beside today's
        headers[5:5] = [f"{before}, simulated (s)", f"{before} / megatron"]
        for row, line in zip(rows, cells, strict=True):
            earlier = row["before"] or 0.0
            line[5:5] = [seconds(earlier), ratio(earlier, row["megatron"])]
    return table(headers, cells)


def left_out(rows: list[dict[str, Any]]) -> str:
    notes = []
    for row in rows:
        counts = sorted(row["left_out"].items())
        if counts:
            sizes = ", ".join(f"{n} of ws{size}" for size, n in counts)
            notes.append(f"D={row['devices']}: {sizes} (more ranks than devices)")
    return left_out_line(notes)


def durations_told(args: argparse.Namespace) -> tuple[dict[str, float] | None, str]:
    """What the simulated scheduler is told (None: the recorded durations), and how to say so."""
    if args.told:
        told = {t.nodeid: t.duration for t in read_record(Path(args.told))}
        return told, f"those of {args.told}"
    if args.first_run:
        return {}, "none (a first run)"
    return None, "the recorded ones (a later run)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sim = simulator()
    tests = mark_exclusive(read_record(Path(args.record), args.run), args.exclusive)
    if not tests:
        raise SystemExit(f"{args.record}: no tests recorded")
    known, told = durations_told(args)
    before = scheduler_at(args.before) if args.before else None
    counts = [int(part) for part in args.device_counts.split(",")]
    costs = sim.Costs(gang_start=args.gang_start, module=args.module_cost)
    rows = [
        replay(tests, count, costs, args.session_start, args.gangs_per_device, known, before)
        for count in counts
    ]
    sizes = Counter(t.world_size or 0 for t in tests)
    mix = ", ".join(f"ws{s} x{n}" if s else f"unmarked x{n}" for s, n in sorted(sizes.items()))
    for line in header_lines("Replay of a recorded run under --dist megatron", machine()):
        print(line)
    print(f"record  : {args.record}: {len(tests)} tests ({mix})")
    print(
        f"costs   : gang start {args.gang_start} s, module {args.module_cost} s (simulated); "
        f"torchrun session start {args.session_start} s"
    )
    exclusive = sum(t.exclusive for t in tests)
    print(
        f"schedule: {args.gangs_per_device} gang(s) per device; durations known: {told}; "
        f"{exclusive} test(s) exclusive_devices"
    )
    print(left_out(rows))
    print()
    print(report(rows, args.before))
    if args.json:
        data = [{**r, "left_out": {str(k): v for k, v in r["left_out"].items()}} for r in rows]
        write_json(args.json, {"record": args.record, "rows": data})
    return 0


if __name__ == "__main__":
    sys.exit(main())
