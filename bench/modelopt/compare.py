"""Run a lane of Model-Optimizer's GPU tests (assembled by assemble.sh) several ways and compare
what each way reports, test by test, from junit; the run machinery is bench/real_suite.py's.

Lanes (`--lane`, default gpu_megatron; TESTDIR is tests/LANE unless `--testdir` names paths):
  gpu_megatron  the whole of tests/gpu_megatron
  gpu           assemble.sh's selection of tests/gpu: its files that use spawn_multiprocess_job,
                DistributedWorkerPool or the dist_workers fixtures (OUT/gpu_lane.txt)

Modes (`--modes own,serial,xdist-k4`, in that order); upstream's conftest files run unchanged in
every mode, nothing replaces their fixtures:
  own       `pytest TESTDIR -p no:xdist_megatron.plugin`: upstream's DistributedWorkerPools
            (spawned, torch + megatron + modelopt imported in every worker: in tests/gpu_megatron
            one per module and world size, in tests/gpu one per session) and
            spawn_multiprocess_job's processes
  serial    `pytest TESTDIR -p xdist_megatron.plugin`: the plugin's Model-Optimizer harness
            replaces DistributedWorkerPool and spawn_multiprocess_job where the suite holds them,
            and their work runs on the plugin's gangs, one test at a time
  xdist     the same with `-n auto --dist megatron`
  xdist-kK  the same with `--megatron-gangs-per-device K` (-n auto: devices x K workers)

The suite's root conftest (ours) logs to STORE/RUN-pools.jsonl each DistributedWorkerPool that
spawns processes (`spawned`), each construction of the plugin's replacement (`served`) and, after
collection, which class each module holds (`holders`): the report counts spawned pools, served
pools, and warns where a plugin run left a module holding upstream's class.

Each mode's junit, log, pool-start log and (plugin modes) run report go to STORE, with the run
as STORE/NAME.run.json, so a later call (the device's 10-minute limit) adds modes to the same
comparison; the report covers every run in STORE. The tests' ids come from one
`pytest --collect-only` per STORE (STORE/expected.json), which also gives the counts per module
and the modules that failed to import. `--part K/N` runs the K-th of N contiguous, equal chunks
of those ids (the same ids in every mode: a mode that does not fit one call is split over calls),
and the report also combines each mode's parts. `--report-only` prints the report of a STORE as
it is (for the files brought back from the device). Every mode passes
`--continue-on-collection-errors`, `-p stream_reports` and `-o cache_dir=STORE/pytest_cache`.

  python3 bench/modelopt/compare.py --suite bench/out/modelopt --store /tmp/modelopt_runs \\
      --modes own,serial,xdist-k4 --cap 300 --deadline $(( $(date +%s) + 570 ))
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: real_suite, _util

import real_suite  # noqa: E402
from _util import progress, table, tail  # noqa: E402
from real_suite import Run, TestResult  # noqa: E402

PLUGIN = real_suite.PLUGIN  # "xdist_megatron.plugin"
MODES = re.compile(r"own|serial|xdist(-k[1-9][0-9]*)?")
LANES = ("gpu_megatron", "gpu")
# A module that cannot import must not end the run; stream_reports (the suite's root) keeps the
# outcomes of a run killed at its cap.
COMMON = ["--continue-on-collection-errors", "-p", "stream_reports"]
MARGIN = 20.0  # seconds kept before --deadline for the report and the tar


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", required=True, help="the assembled folder (runs start there)")
    parser.add_argument("--store", required=True, help="junit, logs and runs of every call")
    parser.add_argument(
        "--lane", default="gpu_megatron", choices=LANES, help="which lane: tests/LANE"
    )
    parser.add_argument(
        "--testdir",
        help="what pytest is given (paths relative to --suite, space-separated; tests/LANE)",
    )
    parser.add_argument("--part", help="K/N: only the K-th of N equal chunks of the collected ids")
    parser.add_argument("--modes", default="", help="comma-separated: own, serial, xdist-kK")
    parser.add_argument("--name", default="", help="suffix of the run names (another round)")
    parser.add_argument("--cap", type=float, default=540, help="wall-clock cap of one mode, s")
    parser.add_argument("--deadline", type=float, default=0, help="epoch s: no mode runs past it")
    parser.add_argument(
        "--min-cap", type=float, default=60, help="a mode with less time left is not started, s"
    )
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, every mode")
    parser.add_argument("--plugin-args", default="", help="extra arguments, plugin modes only")
    parser.add_argument("--collect", action="store_true", help="collect (once per STORE)")
    parser.add_argument("--report-only", action="store_true", help="print STORE's report")
    parser.add_argument("--max-diff", type=int, default=1000, help="rows of the differences table")
    args = parser.parse_args(argv)
    args.testdir = args.testdir or f"tests/{args.lane}"
    args.modes = [mode for mode in args.modes.split(",") if mode]
    bad = [mode for mode in args.modes if not MODES.fullmatch(mode)]
    if bad:
        parser.error(f"unknown modes: {', '.join(bad)}")
    return args


# -- collection -----------------------------------------------------------------------------------


def collect(suite: Path, targets: list[str], pytest_args: list[str]) -> dict:
    """Node ids (as junit keys) of a plain collection, per module counts, collection errors."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-qq", "-p", f"no:{PLUGIN}",
               "--continue-on-collection-errors", *targets, *pytest_args]  # fmt: skip
    started = time.monotonic()
    out, ids = real_suite.collect_ids(command, suite)
    text = out.stdout + out.stderr
    per_module = collections.Counter(nodeid.split("::")[0] for nodeid in ids)
    errors = sorted(set(re.findall(r"^ERROR (\S+)", text, re.M)))
    reasons = {}
    for path in errors:  # the last "E   " line of each module's collection error
        block = text.split(f"ERROR collecting {path}", 1)[-1].split("\n___", 1)[0]
        lines = [line[4:].strip() for line in block.splitlines() if line.startswith("E   ")]
        reasons[path] = lines[-1] if lines else "?"
    skipped = re.findall(r"^SKIPPED \[\d+\] (\S+): (.*)$", text, re.M)
    progress(f"collected {len(ids)} tests in {time.monotonic() - started:.1f} s")
    if not ids:  # a part of nothing would run the whole suite
        raise SystemExit(f"collection found no tests:\n{tail(text, 20)}")
    return {"testdir": " ".join(targets),
            "ids": [real_suite.junit_key(nodeid) for nodeid in ids], "nodeids": ids,
            "per_module": dict(sorted(per_module.items())), "errors": reasons,
            "module_skips": skipped}  # fmt: skip


def collection_report(expected: dict) -> str:
    rows = [[path, str(n), ""] for path, n in expected["per_module"].items()]
    rows += [[path, "0", f"import error: {why}"] for path, why in expected["errors"].items()]
    rows += [[path, "0", f"module skipped: {why}"] for path, why in expected["module_skips"]]
    text = table(["module", "tests", "note"], rows)
    return "\n".join(line.rstrip() for line in text.splitlines()) + (
        f"\n{len(expected['ids'])} tests collected"
    )


# -- running --------------------------------------------------------------------------------------


def part_of(expected: dict, part: str) -> list[str]:
    """Part K of N (`K/N`): the K-th of N contiguous, near-equal chunks of the collected node ids,
    in collection order (a module is cut at most once per boundary)."""
    k, n = (int(x) for x in part.split("/"))
    if not 1 <= k <= n:
        raise SystemExit(f"--part {part}: K must be 1..N")
    ids = expected["nodeids"]
    bounds = [round(i * len(ids) / n) for i in range(n + 1)]
    return ids[bounds[k - 1] : bounds[k]]


def command(
    mode: str, targets: list[str], store: Path, name: str, args: argparse.Namespace
) -> list[str]:
    line = [sys.executable, "-m", "pytest", *targets, f"--junitxml={store / name}.xml", *COMMON]
    # the pytest cache outside the carried folder (a carry replaces it): the plugin's durations
    # and preload list of one call's runs reach the next call's
    line += ["-o", f"cache_dir={store / 'pytest_cache'}"]
    if mode == "own":
        line += ["-p", f"no:{PLUGIN}"]
    else:
        line += ["-p", PLUGIN, f"--megatron-report={store / name}-report.json"]
        if mode.startswith("xdist"):
            line += ["-n", "auto", "--dist", "megatron"]
            if "-k" in mode:
                line += ["--megatron-gangs-per-device", mode.split("-k", 1)[1]]
        line += shlex.split(args.plugin_args)
    return line + shlex.split(args.pytest_args)


def label(mode: str, args_name: str) -> str:
    return mode + (f"-{args_name}" if args_name else "")


def run_mode(
    mode: str, suite: Path, store: Path, expected: dict, args: argparse.Namespace
) -> Run | None:
    group = label(mode, args.name)
    name = group + (f"-p{args.part.replace('/', 'of')}" if args.part else "")
    cap = args.cap
    if args.deadline:
        cap = min(cap, args.deadline - time.time() - MARGIN)
        if cap < min(args.min_cap, args.cap):
            progress(f"{name}: not run, {cap:.0f} s left before the deadline")
            return None
    if args.part:
        targets = part_of(expected, args.part)
        ids = [real_suite.junit_key(nodeid) for nodeid in targets]
    else:
        targets, ids = shlex.split(args.testdir), expected["ids"]
    pools, stream = store / f"{name}-pools.jsonl", store / f"{name}-stream.jsonl"
    for path in (pools, stream, store / f"{name}.xml", store / f"{name}-report.json"):
        path.unlink(missing_ok=True)
    env = {"MODELOPT_POOL_LOG": str(pools), "STREAM_REPORTS": str(stream)}
    # real_suite starts every run with empty JIT caches, but modelopt's quant extensions are the
    # suite's set-up, which run.sh builds once before anything is timed: with an empty folder
    # upstream's session fixture built them again in every mode (219 s of each on an H100)
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    run = Run(name, command(mode, targets, store, name, args), expected=ids,
              log=str(store / f"{name}.log"), env=env)  # fmt: skip
    real_suite.execute(run, suite, cap)
    real_suite.read_results(run, store / f"{name}.xml", stream)  # the stream if no junit
    run.phases = real_suite.phases(run, real_suite.stream_spans(stream))  # every mode streams
    record = {**asdict(run), "mode": mode, "group": group, "part": args.part, "cap": cap}
    (store / f"{name}.run.json").write_text(json.dumps(record))
    return run


# -- reading back ---------------------------------------------------------------------------------


def load_runs(store: Path) -> list[tuple[Run, str, str | None]]:
    """Every run of STORE, oldest first, with its group (mode and --name) and part."""
    runs = []
    for path in sorted(store.glob("*.run.json"), key=lambda p: p.stat().st_mtime):
        data = json.loads(path.read_text())
        mode, group, part = data.pop("mode"), data.pop("group", None), data.pop("part", None)
        data.pop("cap", None)
        data["tests"] = {key: TestResult(**value) for key, value in data["tests"].items()}
        runs.append((Run(**data), group or mode, part))
    return runs


def combine(runs: list[tuple[Run, str, str | None]]) -> list[tuple[Run, list[Run]]]:
    """One run per group: its latest whole run, else its parts (the latest run of each) merged:
    tests and expected ids joined, wall times added."""
    groups: dict[str, dict[str | None, Run]] = {}
    for run, group, part in runs:
        groups.setdefault(group, {})[part] = run  # later runs of a part replace earlier ones
    combined = []
    for group, parts in groups.items():
        if None in parts:
            combined.append((parts[None], [parts[None]]))
            continue
        members = [
            parts[key] for key in sorted(parts, key=lambda p: [int(x) for x in p.split("/")])
        ]
        run = Run(group, [], returncode=max(m.returncode or 0 for m in members),
                  wall=sum(m.wall for m in members), killed=any(m.killed for m in members),
                  leftovers=any(m.leftovers for m in members),
                  gpu_peak=max((m.gpu_peak for m in members if m.gpu_peak), default=None),
                  source="+".join(sorted({m.source for m in members})),
                  expected=list(dict.fromkeys(key for m in members for key in m.expected)),
                  tests={k: v for m in members for k, v in m.tests.items()},
                  log=members[-1].log)  # fmt: skip
        run.name = f"{group} ({'+'.join(sorted(parts))})"
        combined.append((run, members))
    return combined


def pool_log(store: Path, names: list[str], kind: str) -> list[dict]:
    """The lines of `kind` of runs' pool logs (a line without a kind: `spawned`, older logs)."""
    lines = []
    for name in names:
        path = store / f"{name}-pools.jsonl"
        for text in path.read_text().splitlines() if path.exists() else []:
            line = json.loads(text)
            if line.get("kind", "spawned") == kind:
                lines.append(line)
    return lines


def pool_starts(store: Path, names: list[str]) -> tuple[int, float, dict[int, int]]:
    """Upstream's DistributedWorkerPool starts in runs: count, seconds, count per world size."""
    lines = pool_log(store, names, "spawned")
    per_size = collections.Counter(line["world_size"] for line in lines)
    return len(lines), sum(line["seconds"] for line in lines), dict(sorted(per_size.items()))


def upstream_holders(store: Path, run: Run, mode: str) -> list[str]:
    """In a plugin run: modules that still held upstream's DistributedWorkerPool or
    spawn_multiprocess_job after collection, and teardowns that did not pickle."""
    if mode == "own":
        return []
    found = set()
    for line in pool_log(store, [run.name], "holders"):
        for name, where in line["holders"].items():
            found.update(f"{path} holds upstream's {name}" for path, what in where.items()
                         if what == "upstream")  # fmt: skip
        found.update(f"{path}: megatron_worker_teardown does not pickle ({why})"
                     for path, why in line["teardowns"].items() if why != "pickles")  # fmt: skip
    return sorted(found)


def gang_starts(store: Path, names: list[str]) -> tuple[int | None, str]:
    """Gangs the plugin started in runs (their run reports), and why, per world size."""
    starts, found = [], False
    for name in names:
        try:
            events = json.loads((store / f"{name}-report.json").read_text())["gang_events"]
        except (OSError, ValueError, KeyError):
            continue
        found = True
        starts += [event for event in events if event["kind"] == "start"]
    causes = collections.Counter((event["world_size"], event["cause"]) for event in starts)
    why = ", ".join(f"ws{ws} {cause}: {n}" for (ws, cause), n in sorted(causes.items()))
    return (len(starts) if found else None), why or "-"


def starts_table(rows_of: list[tuple[str, list[str]]], store: Path) -> str:
    rows = []
    for title, names in rows_of:
        count, seconds, per_size = pool_starts(store, names)
        served = len(pool_log(store, names, "served"))
        gangs, why = gang_starts(store, names)
        sizes = ", ".join(f"ws{ws}: {n}" for ws, n in per_size.items()) or "-"
        rows.append([title, str(count), f"{seconds:.1f}", sizes, str(served),
                     "-" if gangs is None else str(gangs), why])  # fmt: skip
    return table(
        ["run", "pool starts", "pool start s", "pools per size", "pools on gangs", "gang starts",
         "gangs"],
        rows,
    )  # fmt: skip


def show_log_ends(runs: list[Run], store: Path) -> None:
    for run in runs:
        if run.source == "none" or run.killed or run.returncode not in (0, 1):
            killed = ", killed at its cap" if run.killed else ""
            print(f"\n{run.name}: exit {run.returncode}{killed}, results from {run.source}; "
                  f"end of {run.log}:")  # fmt: skip
            log = Path(run.log)
            if not log.exists():  # read back elsewhere: the log lies beside the run
                log = store / log.name
            print(tail(log.read_text(errors="replace"), 15) if log.exists() else "(no log)")


def report(store: Path, max_diff: int) -> None:
    expected_path = store / "expected.json"
    if expected_path.exists():
        expected = json.loads(expected_path.read_text())
        print(f"collection (plugin disabled)\n{collection_report(expected)}\n")
    loaded = load_runs(store)
    if not loaded:
        print(f"no runs in {store}")
        return
    runs = [run for run, _, _ in loaded]
    print(real_suite.summary_table(runs))
    if any(run.phases for run in runs):
        print(f"\nwhere the plugin's wall time went\n{real_suite.phases_table(runs)}")
    print(f"\npool and gang starts\n{starts_table([(r.name, [r.name]) for r in runs], store)}")
    for run, group, _ in loaded:
        for line in upstream_holders(store, run, group.split("-")[0]):
            print(f"WARNING {run.name}: {line} (the plugin's harness does not serve it)")
    show_log_ends(runs, store)
    combined = combine(loaded)
    merged = [run for run, members in combined if len(members) > 1 or run.name != members[0].name]
    if merged:
        print(
            f"\nper mode, parts combined\n{real_suite.summary_table([run for run, _ in combined])}"
        )
        rows = [(run.name, [m.name for m in members]) for run, members in combined]
        print(f"\npool and gang starts, parts combined\n{starts_table(rows, store)}")
    if len(combined) > 1:
        final = [run for run, _ in combined]
        print(f"\noutcomes that differ ({', '.join(run.name for run in final)})")
        print(real_suite.differences_table(final, max_diff))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    suite, store = Path(args.suite).resolve(), Path(args.store).resolve()
    store.mkdir(parents=True, exist_ok=True)
    if not args.report_only and (args.modes or args.collect):
        expected_path = store / "expected.json"
        if not expected_path.exists():
            found = collect(suite, shlex.split(args.testdir), shlex.split(args.pytest_args))
            expected_path.write_text(json.dumps(found))
        expected = json.loads(expected_path.read_text())
        if expected.get("testdir", args.testdir) != args.testdir:
            raise SystemExit(f"{store} holds the runs of {expected['testdir']!r}, not of "
                             f"{args.testdir!r}: give each lane a store of its own")  # fmt: skip
        for mode in args.modes:
            run_mode(mode, suite, store, expected, args)
    report(store, args.max_diff)
    return 0


if __name__ == "__main__":
    sys.exit(main())
