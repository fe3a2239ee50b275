"""Run one real distributed test folder several ways and compare what each way reports.

A suite written for `torchrun --nproc-per-node N -m pytest` (Megatron-LM's unit tests, say) runs:

  torchrun  `python -m torch.distributed.run --standalone --nproc-per-node N` running pytest on
            each rank with this plugin disabled (as `-m pytest` would, through this script, so
            that each rank writes its own junit): the way such suites run today; rank 0 counts;
  serial    `pytest --megatron-world-size N`: the plugin, every unmarked test on an N-rank gang;
  xdist     `pytest -n auto --dist megatron --megatron-world-size N`;
  xdist-kK  the same with `--megatron-gangs-per-device K` (K gangs share each device; -n auto
            starts devices x K workers), for any K: `--modes torchrun,serial,xdist-k2,xdist-k4`;
  faults    serial and torchrun again, with two tests added to the folder: one whose rank 1
            segfaults, one whose rank 1 hangs while rank 0 waits in a barrier. The plugin runs with
            `--megatron-timeout 20`; torchrun and its ranks are killed at `--fault-cap` s.

Every run starts with empty just-in-time caches (Triton's kernels, torch's C++ extensions,
inductor's code: `JIT_CACHES`), as on a fresh CI machine: otherwise the first run of a sitting
builds what every later one reuses. (What a package builds into its own folder is the setup's
to build once: megatron-core's NCCL allocator, see megatron_lm/setup_device.sh.)

With `--rounds R` the runs of the first three modes repeat R times, each round starting with the
next mode (the first run of a sitting meets cold caches), and a table gives each mode's wall time
per round, its median, and the median's ratio to torchrun's.

Per run it prints the wall time, the peak GPU memory in use (every visible GPU, sampled each
second by nvidia-smi, where it exists), the sum of the tests' junit times, the outcome counts and
the tests that got no report (`lost`: collected by `pytest --collect-only`, absent from the run's
junit), then every test whose outcome differs between the runs. A run killed at its cap writes no
junit; the reports it streamed as they happened (torchrun's rank 0, the plugin's driver) are used
instead (source `stream`), and a table says how long each run took to finish the tests that every
run finished: the side-by-side figure when a cap or a lost machine cut some of them short.

Example (Megatron-LM's subset, from bench/out/megatron_lm, see its setup_device.sh):
  python ../../real_suite.py tests/unit_tests --nproc 2 --json ../megatron_lm.json
TESTDIR is relative to the current directory; the runs start in --cwd (default: here). Pass
pytest options with `--pytest-args="-k parallel_state"` (every run, plain pytest's options only)
and the plugin's with `--plugin-args="--megatron-timeout 60"` (serial, xdist, faults-serial).
`--devices` chooses the devices of every mode (the plugin's `--megatron-devices`; torchrun's ranks
see only those GPUs, or none for `cpu:N`); with fewer devices than `--nproc`, every mode runs at
one rank per device, and the faults (they need rank 1) need two: the report says what it left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _memory import PeakMemory
from _util import (
    Devices,
    add_devices_option,
    header_lines,
    left_out_line,
    machine,
    progress,
    resolve_devices,
    table,
    tail,
    write_json,
)

INFO = machine()  # at import, before the runs: the load they start under
PLUGIN = "xdist_megatron.plugin"  # the pytest11 entry point's name (pyproject.toml)
RANK_SCRIPT = Path(__file__).with_name("torchrun_rank.py")  # what torchrun starts on each rank
STREAM_PLUGIN = Path(__file__).with_name("stream_reports.py")
REPORTS_PLUGIN = "xm_bench_reports"  # stream_reports, under a name no suite's folder holds
MODES = ("torchrun", "serial", "xdist", "faults", "collect")  # collect: --collected only
TIMED = MODES[:3]  # the modes --rounds repeats, with every xdist-kK
SHARED_XDIST = re.compile(r"xdist-k([1-9][0-9]*)")  # xdist, K gangs per device
LOST = "lost"
SEVERITY = ("failed", "error", "skipped", "passed")  # worst first
JUNIT_OUTCOMES = {"failure": "failed"}
KILL_GRACE = 10.0  # seconds between SIGTERM and SIGKILL of a run's process group
RUN_TAG = "REAL_SUITE_RUN"  # in each run's environment, to find all of its processes
JIT_CACHES = ("TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR")
LOG_TAIL = 15  # lines of a run's log shown when it went wrong
FAULT_RANKS = 2  # the fault tests crash or hang rank 1

FAULT_HEADER = '''"""Injected by bench/real_suite.py (removed after the run): {what}."""

import os
import signal
import time

import torch
import torch.distributed as dist


def barrier():
    """A barrier on the default group, joined from torchrun's environment if no test has yet."""
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    dist.barrier()

'''

SEGFAULT_TEST = """
def test_rank1_segfaults():
    barrier()  # both ranks got here
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGSEGV)
    barrier()
"""

HANG_TEST = """
def test_rank1_hangs():
    barrier()
    while os.environ.get("RANK") == "1":
        time.sleep(3600)
    barrier()
"""

FAULT_FILES = {  # the hang first: under torchrun it costs the cap, the segfault ends the run
    "test_bench_fault_1_hang.py": FAULT_HEADER.format(what="rank 1 hangs, rank 0 waits")
    + HANG_TEST,
    "test_bench_fault_2_segfault.py": FAULT_HEADER.format(what="rank 1 dies of SIGSEGV")
    + SEGFAULT_TEST,
}


@dataclass
class TestResult:
    outcome: str  # passed, failed, skipped, error
    seconds: float


@dataclass
class Run:
    """One way of running the folder, and what came back from it."""

    name: str
    command: list[str]
    returncode: int | None = None
    wall: float = 0.0
    launched: float = 0.0  # time.time() as it started, for the run report's times
    phases: dict[str, float] = field(default_factory=dict)  # see phases_table
    killed: bool = False  # past its cap: the process group was killed ("run lost")
    leftovers: bool = False  # processes of the run were still alive after it exited
    gpu_peak: int | None = None  # bytes in use on the visible GPUs at the most (None: no GPU)
    source: str = "none"  # junit, stream (the reports it streamed) or none
    expected: list[str] = field(default_factory=list)
    tests: dict[str, TestResult] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)  # key: when its last report ended
    log: str = ""
    env: dict[str, str] = field(default_factory=dict)  # added to the run's environment

    def outcome(self, key: str) -> str:
        result = self.tests.get(key)
        return result.outcome if result else LOST

    def lost(self) -> list[str]:
        return [key for key in self.expected if key not in self.tests]


# -- command line ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("testdir", help="the folder (or file) of tests, as given to pytest")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per test (default 2)")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}"
    )
    parser.add_argument(
        "--pytest-args", default="", help='extra pytest arguments for every run: --pytest-args="-x"'
    )
    parser.add_argument("--plugin-args", default="", help="extra arguments for the plugin's runs")
    parser.add_argument("--workers", default="auto", help="-n of the xdist mode (default auto)")
    parser.add_argument(
        "--cwd", default=".", help="where the runs start (a suite's root: its imports, its ini)"
    )
    parser.add_argument("--out", help="junit files and logs (default bench/out/real_suite/TIME)")
    parser.add_argument("--cap", type=float, default=3600, help="wall-clock cap of a run, s")
    parser.add_argument("--fault-cap", type=float, default=120, help="cap of faults' torchrun, s")
    parser.add_argument("--fault-timeout", type=float, default=20, help="--megatron-timeout, s")
    parser.add_argument(
        "--fault-position",
        choices=("first", "last"),
        default="first",
        help="where the injected tests sort in the folder (default first)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat the timed modes, rotating their order"
    )
    parser.add_argument("--max-diff", type=int, default=60, help="rows of a differences table")
    parser.add_argument("--json", metavar="PATH", help="write the results to PATH as JSON")
    parser.add_argument(
        "--profile-collection", metavar="PATH", help="run the first collect-only under cProfile"
    )
    parser.add_argument(
        "--collected",
        metavar="PATH",
        help="the collected ids: read from PATH if it exists, else collected and written there "
        "(later calls of a device sitting skip the collect-only)",
    )
    add_devices_option(parser)
    args = parser.parse_args(argv)
    args.modes = [mode for mode in args.modes.split(",") if mode]
    unknown = {mode for mode in args.modes if mode not in MODES and not is_timed(mode)}
    if unknown:
        parser.error(f"unknown modes: {', '.join(sorted(unknown))}")
    return args


# -- running --------------------------------------------------------------------------------------


def tagged(tag: str) -> list[int]:
    """The processes whose environment holds RUN_TAG=tag: a run's own, also those in sessions of
    their own (torchrun starts every rank in a new session: killing its group misses them)."""
    needle = f"{RUN_TAG}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:  # gone, or not ours to read
                continue
            if needle in environ:
                pids.append(int(entry.name))
    return pids


def describe(pids: list[int]) -> str:
    """pid and command line of each process, as far as /proc still has them."""
    lines = []
    for pid in pids:
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            lines.append(f"{pid} {command.decode(errors='replace').strip()[:160]}")
    return "; ".join(lines) or "none left by now"


def alive(proc: subprocess.Popen, tag: str) -> bool:
    """Whether the run's leader, its process group or a tagged process is still there."""
    if proc.poll() is None:  # polling also reaps the leader: a zombie would keep its group
        return True
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return bool(tagged(tag))
    return True


def stop_run(proc: subprocess.Popen, tag: str, grace: float) -> None:
    """SIGTERM the run's process group and its tagged processes in other groups (one signal
    each: a second one cuts torchrun's own shutdown short), SIGKILL all that is left after
    `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 1.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        for pid in tagged(tag):
            with contextlib.suppress(ProcessLookupError):
                if sig == signal.SIGKILL or os.getpgid(pid) != proc.pid:
                    os.kill(pid, sig)
        wait_gone(proc, tag, wait)


def wait_gone(proc: subprocess.Popen, tag: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(proc, tag):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def execute(run: Run, cwd: Path, cap: float) -> None:
    """Run the command in a process group of its own, output to run.log; kill it at `cap`.
    Processes of the run still alive 3 s after it ended are reported (leftovers) and killed."""
    progress(f"{run.name}: {shlex.join(run.command)}")
    tag = f"{os.getpid()}-{run.name}-{time.time_ns()}"
    caches = tempfile.mkdtemp(prefix=f"jit-caches-{run.name}-")
    jit = {name: os.path.join(caches, name.lower()) for name in JIT_CACHES}
    env = {**os.environ, **jit, **run.env, "PYTHONUNBUFFERED": "1", RUN_TAG: tag}
    try:
        _execute(run, cwd, cap, env, tag)
    finally:
        shutil.rmtree(caches, ignore_errors=True)


def _execute(run: Run, cwd: Path, cap: float, env: dict[str, str], tag: str) -> None:
    with open(run.log, "w") as log:
        started, run.launched = time.monotonic(), time.time()
        proc = subprocess.Popen(
            run.command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        with PeakMemory(proc.pid) as peak:
            try:
                proc.wait(timeout=cap)
            except subprocess.TimeoutExpired:
                run.killed = True
                stop_run(proc, tag, KILL_GRACE)
            proc.wait()
            run.wall = time.monotonic() - started
    run.gpu_peak = peak.gpu_peak
    run.returncode = proc.returncode
    run.leftovers = not wait_gone(proc, tag, 3.0)
    if run.leftovers:
        progress(f"{run.name}: still alive 3 s after the run: {describe(tagged(tag))}")
        stop_run(proc, tag, KILL_GRACE)
    state = f"run lost, killed at the {cap:g} s cap" if run.killed else f"exit {proc.returncode}"
    progress(f"{run.name}: {state} after {run.wall:.1f} s, log {run.log}")


def pytest_command(testdir: str, junit: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", testdir, f"--junitxml={junit}", *extra]


def torchrun_command(nproc: int, folder: Path, pytest_args: list[str]) -> list[str]:
    """torchrun starting torchrun_rank.py on every rank, the plugin disabled."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(RANK_SCRIPT), str(folder), "--",
        "-p", f"no:{PLUGIN}", *pytest_args,
    ]  # fmt: skip


def collect(
    testdir: str, cwd: Path, pytest_args: list[str], profile: str | None = None
) -> list[str]:
    """The node ids a plain pytest collects (plugin disabled), as junit keys; how long that
    took, which is most of every mode's start-up; under cProfile into `profile` if given."""
    profiler = [] if profile is None else ["-m", "cProfile", "-o", os.path.abspath(profile)]
    command = [sys.executable, *profiler, "-m", "pytest", "--collect-only", "-q", "-p",
               f"no:{PLUGIN}", testdir, *pytest_args]  # fmt: skip
    started = time.monotonic()
    out, ids = collect_ids(command, cwd)
    took = f"{time.monotonic() - started:.1f} s"
    if profile is not None:
        took += f", profiled: {profile}"
    progress(f"collected {len(ids)} tests ({took})")
    if not ids:
        progress(f"collection found no tests (exit {out.returncode}):")
        progress(tail(out.stdout + out.stderr, LOG_TAIL))
    return [junit_key(nodeid) for nodeid in ids]


def collect_ids(command: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run a `--collect-only` command; its output, and the node ids it collected as
    `stream_reports` wrote them (the terminal's list changes form with a suite's verbosity)."""
    with tempfile.TemporaryDirectory() as folder:
        ids_file = os.path.join(folder, "ids")
        env = {**os.environ, "PYTHONPATH": reports_plugin_path(Path(folder)),
               "COLLECTED_IDS": ids_file}  # fmt: skip
        out = subprocess.run([*command, "-p", REPORTS_PLUGIN], cwd=cwd, env=env,
                             capture_output=True, text=True, stdin=subprocess.DEVNULL)  # fmt: skip
        ids = Path(ids_file).read_text().splitlines() if os.path.exists(ids_file) else []
    return out, ids


def reports_plugin_path(folder: Path) -> str:
    """PYTHONPATH with `folder` first, holding stream_reports.py as REPORTS_PLUGIN: only that
    module goes on the path (bench/ holds names a suite may import: `coverage`)."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / f"{REPORTS_PLUGIN}.py"
    if not link.exists():
        os.symlink(STREAM_PLUGIN, link)
    return os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))


# -- reading results ------------------------------------------------------------------------------


def junit_key(nodeid: str) -> str:
    """A node id as pytest's junit names it (classname::name), so both sources compare."""
    names = nodeid.split("::")
    path = names[0].replace("/", ".")
    names[0] = path[: -len(".py")] if path.endswith(".py") else path
    return ".".join(names[:-1]) + "::" + names[-1]


def parse_junit(path: Path) -> dict[str, TestResult]:
    """Outcome and time of each test of a pytest junit file. A test that failed and then errored
    in teardown has two testcase elements: the worse outcome counts, the times add up."""
    results: dict[str, TestResult] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = f"{case.get('classname', '')}::{case.get('name', '')}"
        tags = {child.tag for child in case}
        outcome = next((o for o in ("failure", "error", "skipped") if o in tags), "passed")
        result = TestResult(JUNIT_OUTCOMES.get(outcome, outcome), float(case.get("time") or 0))
        if key in results:
            result = worse(results[key], result)
        results[key] = result
    return results


def worse(first: TestResult, second: TestResult) -> TestResult:
    rank = {outcome: i for i, outcome in enumerate(SEVERITY)}
    outcome = min(first.outcome, second.outcome, key=rank.__getitem__)
    return TestResult(outcome, first.seconds + second.seconds)


def stream_reports(path: Path) -> list[dict]:
    """The reports of a StreamReports file; none if it is unreadable, and not the torn last
    line of a run that was killed."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    reports = []
    for line in lines:
        with contextlib.suppress(ValueError):
            reports.append(json.loads(line))
    return reports


def finished_tests(path: Path) -> dict[str, list[dict]]:
    """A stream's reports per test, of the tests that finished (their teardown reported)."""
    phases: dict[str, list[dict]] = {}
    for report in stream_reports(path):
        phases.setdefault(report["nodeid"], []).append(report)
    return {nodeid: reports for nodeid, reports in phases.items()
            if any(report["when"] == "teardown" for report in reports)}  # fmt: skip


def parse_stream(finished: dict[str, list[dict]]) -> dict[str, TestResult]:
    """Per-test outcomes from the streamed reports of the tests that finished."""
    return {
        junit_key(nodeid): TestResult(
            stream_outcome(reports), sum(report["duration"] for report in reports)
        )
        for nodeid, reports in finished.items()
    }


def stream_outcome(reports: list[dict]) -> str:
    """As junit would say: a failed call fails, a failed setup or teardown errors."""
    by_phase = {report["when"]: report for report in reports}
    if by_phase.get("call", {}).get("outcome") == "failed":
        return "failed"
    if any(report["outcome"] == "failed" for report in reports):
        return "error"
    if any(report["outcome"] == "skipped" for report in reports):
        return "skipped"
    return "passed"


def read_results(run: Run, junit: Path, stream: Path) -> None:
    """The run's junit if it wrote one, else the reports it streamed; when each test ended
    (epoch seconds, its reports' latest stop)."""
    finished = finished_tests(stream)
    run.finished = {junit_key(nodeid): max(report.get("stop") or 0.0 for report in reports)
                    for nodeid, reports in finished.items()}  # fmt: skip
    if junit.exists():
        try:
            run.tests, run.source = parse_junit(junit), "junit"
            return
        except ET.ParseError:
            progress(f"{run.name}: unreadable junit {junit}")
    if stream.exists():
        run.tests, run.source = parse_stream(finished), "stream"


# -- the modes ------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What every run shares."""

    testdir: str
    cwd: Path
    out: Path
    nproc: int
    pytest_args: list[str]
    plugin_args: list[str]
    workers: str
    cap: float
    devices: Devices


def run_torchrun(plan: Plan, name: str, testdir: str, cap: float, expected: list[str]) -> Run:
    folder = plan.out / name
    folder.mkdir(parents=True, exist_ok=True)
    command = torchrun_command(plan.nproc, folder, [testdir, *plan.pytest_args])
    log = str(plan.out / f"{name}.log")
    run = Run(name, command, expected=expected, log=log, env=plan.devices.visible_env())
    execute(run, plan.cwd, cap)
    read_results(run, folder / "rank0.xml", folder / "rank0.jsonl")
    run.phases = phases(run, stream_spans(folder / "rank0.jsonl"))
    return run


def run_plugin(plan: Plan, name: str, testdir: str, extra: list[str], expected: list[str]) -> Run:
    junit = plan.out / f"{name}.xml"
    options = ["--megatron-world-size", str(plan.nproc), *plan.devices.plugin_options()]
    options += [*extra, *plan.plugin_args]
    options += plan.pytest_args
    timeline = plan.out / f"{name}-report.json"
    options += [f"--megatron-report={timeline}", "-p", REPORTS_PLUGIN]
    stream = plan.out / f"{name}.jsonl"
    stream.unlink(missing_ok=True)  # StreamReports appends
    env = {"PYTHONPATH": reports_plugin_path(plan.out / "plugins"), "STREAM_REPORTS": str(stream)}
    run = Run(name, pytest_command(testdir, junit, options), expected=expected,
              log=str(plan.out / f"{name}.log"), env=env)  # fmt: skip
    execute(run, plan.cwd, plan.cap)
    read_results(run, junit, stream)
    run.phases = phases(run, report_spans(timeline) or stream_spans(stream))
    return run


def report_spans(timeline: Path) -> list[tuple[float, float]]:
    """Each test's start and end in a plugin run's run report, as the drivers stamped them."""
    try:
        return [(s["start"], s["end"]) for s in json.loads(timeline.read_text())["tests"]]
    except (OSError, ValueError, KeyError):
        return []


def stream_spans(path: Path) -> list[tuple[float, float]]:
    """Each report's start and stop in rank 0's stream of a torchrun run (pytest's stamps)."""
    reports = stream_reports(path)
    return [(r["start"], r["stop"]) for r in reports if r.get("start") and r.get("stop")]


def phases(run: Run, spans: list[tuple[float, float]]) -> dict[str, float]:
    """Where a run's wall time went: before the first test, the tests, after the last."""
    if not spans:
        return {}
    first, last = min(start for start, _ in spans), max(end for _, end in spans)
    return {
        "to first test": first - run.launched,
        "tests": last - first,
        "after last test": run.launched + run.wall - last,
    }


def run_modes(plan: Plan, modes: list[str], args: argparse.Namespace) -> list[Run]:
    runs = []
    timed = [mode for mode in modes if is_timed(mode)]
    if "collect" in modes and not timed:
        collected(plan, args)
    if timed:
        expected = collected(plan, args)
        for index in range(args.rounds):
            first = index % len(timed)
            for mode in timed[first:] + timed[:first]:
                name = mode if args.rounds == 1 else f"{mode}#{index + 1}"
                runs.append(run_timed(plan, mode, name, expected))
    if "faults" in modes:
        runs.extend(run_faults(plan, args))
    return runs


def collected(plan: Plan, args: argparse.Namespace) -> list[str]:
    """The ids every timed run is checked against, from `--collected` where that file exists."""
    store = Path(args.collected) if args.collected else None
    if store is not None and store.is_file():
        ids = store.read_text().splitlines()
        progress(f"collected {len(ids)} tests (read from {store})")
        return ids
    ids = collect(plan.testdir, plan.cwd, plan.pytest_args, args.profile_collection)
    if store is not None and ids:
        store.write_text("\n".join(ids) + "\n")
    return ids


def is_timed(mode: str) -> bool:
    return mode in TIMED or SHARED_XDIST.fullmatch(mode) is not None


def run_timed(plan: Plan, mode: str, name: str, expected: list[str]) -> Run:
    if mode == "torchrun":
        return run_torchrun(plan, name, plan.testdir, plan.cap, expected)
    if mode == "serial":
        return run_plugin(plan, name, plan.testdir, [], expected)
    xdist = ["-n", plan.workers, "--dist", "megatron"]
    shared = SHARED_XDIST.fullmatch(mode)
    if shared is not None:
        xdist += ["--megatron-gangs-per-device", shared.group(1)]
    return run_plugin(plan, name, plan.testdir, xdist, expected)


def run_faults(plan: Plan, args: argparse.Namespace) -> list[Run]:
    """Serial plugin and torchrun on the folder with the fault tests added, then removed again."""
    folder = Path(plan.cwd, plan.testdir)
    if not folder.is_dir():
        progress("faults: skipped, TESTDIR must be a folder to add the fault tests to")
        return []
    faults = add_fault_tests(folder, args.fault_position)
    try:
        expected = collect(plan.testdir, plan.cwd, plan.pytest_args)
        timeout = ["--megatron-timeout", f"{args.fault_timeout:g}"]
        return [
            run_plugin(plan, "faults-serial", plan.testdir, timeout, expected),
            run_torchrun(plan, "faults-torchrun", plan.testdir, args.fault_cap, expected),
        ]
    finally:
        shutil.rmtree(faults, ignore_errors=True)


def add_fault_tests(folder: Path, position: str) -> Path:
    """A temporary sub-folder whose name sorts first (or last) in `folder`, so pytest collects it
    there, under the suite's own ini and conftest files."""
    prefix = "0_bench_faults_" if position == "first" else "zz_bench_faults_"
    faults = Path(tempfile.mkdtemp(prefix=prefix, dir=folder))
    for name, source in FAULT_FILES.items():
        (faults / name).write_text(source)
    return faults


# -- tables ---------------------------------------------------------------------------------------


def counts(run: Run) -> dict[str, int]:
    tally = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for result in run.tests.values():
        tally[result.outcome] = tally.get(result.outcome, 0) + 1
    return tally


def summary_table(runs: list[Run]) -> str:
    headers = ["run", "wall s", "GPU peak MiB", "tests s", "passed", "failed", "skipped", "error",
               "lost", "source", "exit"]  # fmt: skip
    rows = []
    for run in runs:
        tally = counts(run)
        state = "killed" if run.killed else str(run.returncode)
        state += " +leftovers" if run.leftovers else ""
        rows.append([
            run.name, f"{run.wall:.1f}", "-" if run.gpu_peak is None else f"{run.gpu_peak >> 20}",
            f"{sum(r.seconds for r in run.tests.values()):.2f}",
            *(str(tally[key]) for key in ("passed", "failed", "skipped", "error")),
            str(len(run.lost())), run.source, state,
        ])  # fmt: skip
    return table(headers, rows)


def phases_table(runs: list[Run]) -> str:
    """Launch to the first test's start (start-up, collection, workers' collection),
    the first test's start to the last one's end, and from there to the exit."""
    timed = [run for run in runs if run.phases]
    names = list(timed[0].phases) if timed else []
    rows = [[run.name, f"{run.wall:.1f}", *(f"{run.phases[n]:.1f}" for n in names)]
            for run in timed]  # fmt: skip
    return table(["run", "wall s", *(f"{name} s" for name in names)], rows)


def rounds_table(runs: list[Run]) -> str:
    """Each timed mode's wall time per round, its median, and the median against torchrun's."""
    walls: dict[str, list[float]] = {}
    for run in runs:
        mode, _, _ = run.name.partition("#")
        if is_timed(mode):
            walls.setdefault(mode, []).append(run.wall)
    medians = {mode: statistics.median(values) for mode, values in walls.items()}
    rounds = max(len(values) for values in walls.values())
    headers = ["mode", *(f"round {i + 1}" for i in range(rounds)), "median", "x torchrun"]
    rows = []
    for mode, values in walls.items():
        ratio = f"{medians[mode] / medians['torchrun']:.2f}" if "torchrun" in medians else "-"
        rows.append([mode, *(f"{v:.1f}" for v in values), f"{medians[mode]:.1f}", ratio])
    return table(headers, rows)


def shared_progress_table(runs: list[Run]) -> str:
    """How long each run took, from its launch, to finish the tests that every run finished
    (when their last report ended), against the first run's: a fair ratio even when a cap cut
    some runs short. Empty where a run streamed no stamps or no test finished in every run."""
    if not all(run.finished for run in runs):
        return ""
    shared = set.intersection(*(set(run.finished) for run in runs))
    if not shared:
        return ""
    took = [max(run.finished[key] for key in shared) - run.launched for run in runs]
    rows = [[run.name, f"{seconds:.1f}", f"{took[0] / seconds:.2f}"]
            for run, seconds in zip(runs, took, strict=True)]  # fmt: skip
    expected = len(runs[0].expected) or len(shared)
    title = f"to the {len(shared)} tests (of {expected}) that every run finished"
    return f"{title}\n" + table(["run", "s from launch", f"x {runs[0].name}"], rows)


def differences(runs: list[Run]) -> list[str]:
    """Keys whose outcome is not the same in every run (a missing report counts as 'lost')."""
    keys = dict.fromkeys(key for run in runs for key in [*run.expected, *run.tests])
    return [key for key in keys if len({run.outcome(key) for run in runs}) > 1]


def differences_table(runs: list[Run], limit: int) -> str:
    keys = differences(runs)
    if not keys:
        return "every test has the same outcome in every run"
    rows = [[key, *(run.outcome(key) for run in runs)] for key in keys[:limit]]
    text = table(["test", *(run.name for run in runs)], rows)
    more = len(keys) - limit
    return text + (f"\n... and {more} more" if more > 0 else "") + f"\n{len(keys)} differ"


def report(runs: list[Run], limit: int) -> None:
    """The summary, the differences between the ordinary runs, then between the faults runs."""
    print(summary_table(runs))
    if any(run.phases for run in runs):
        print(f"\nwhere the wall time went\n{phases_table(runs)}")
    if any("#" in run.name for run in runs):
        print(f"\nwall time (s) per round\n{rounds_table(runs)}")
    for run in runs:
        if run.source == "none" or run.killed or run.returncode not in (0, 1):
            killed = ", killed at its cap" if run.killed else ""
            print(f"\n{run.name}: exit {run.returncode}{killed}, results from {run.source}; "
                  f"end of {run.log}:")  # fmt: skip
            print(tail(Path(run.log).read_text(errors="replace"), LOG_TAIL))
    groups = {
        "outcomes that differ": [run for run in runs if not run.name.startswith("faults")],
        "faults: outcomes that differ": [run for run in runs if run.name.startswith("faults")],
    }
    for title, group in groups.items():
        if len(group) > 1:
            if shared := shared_progress_table(group):
                print(f"\n{shared}")
            print(f"\n{title} ({', '.join(run.name for run in group)})")
            print(differences_table(group, limit))


def as_json(runs: list[Run], args: argparse.Namespace) -> dict:
    return {
        "machine": INFO,
        "arguments": vars(args),
        "runs": [{**asdict(run), "lost": run.lost(), "counts": counts(run)} for run in runs],
    }


# -- main -----------------------------------------------------------------------------------------


def fit(nproc: int, modes: list[str], devices: Devices) -> tuple[int, list[str], list[str]]:
    """Ranks per test and modes that fit the devices, and what was left out."""
    left_out = []
    if nproc > devices.count:
        left_out.append(f"--nproc {nproc}: {devices.shortfall(nproc)}; ran {devices.count}")
        nproc = devices.count
    if "faults" in modes and nproc < FAULT_RANKS:
        why = f"needs {FAULT_RANKS} ranks (rank 1 crashes or hangs), {nproc} running"
        left_out.append(f"faults: {why}")
        modes = [mode for mode in modes if mode != "faults"]
    return nproc, modes, left_out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    default_out = Path(__file__).parent / "out" / "real_suite" / time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or default_out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    devices = resolve_devices(args.devices)
    nproc, modes, left_out = fit(args.nproc, args.modes, devices)
    plan = Plan(os.path.abspath(args.testdir), Path(args.cwd).resolve(), out, nproc,
                shlex.split(args.pytest_args), shlex.split(args.plugin_args), args.workers,
                args.cap, devices)  # fmt: skip
    print("\n".join(header_lines("real suite: " + args.testdir, INFO)))
    print(f"cwd     : {plan.cwd}\nout     : {out}\ndevices : {devices.describe()}")
    print(f"{left_out_line(left_out)}\n", flush=True)
    runs = run_modes(plan, modes, args)
    report(runs, args.max_diff)
    if args.json:
        write_json(args.json, {**as_json(runs, args), "left_out": left_out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
