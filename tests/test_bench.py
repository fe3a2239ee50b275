"""Every benchmark runs where it has fewer devices than its largest size, and says what it left out.

Each runs in a subprocess in its quickest mode on `cpu:1` (one slot, as on a 1-GPU machine), so a
benchmark that assumes two devices fails here as it would on one GPU.
"""

from __future__ import annotations

import importlib.util
import json
import pstats
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import assert_no_processes_left, start_from_a_plain_shell

BENCH = Path(__file__).resolve().parent.parent / "bench"
TIMEOUT = 300
TINY_SUITE = """
import os

import torch
import torch.distributed as dist


def test_all_reduce():
    # written for torchrun: join the group from the environment where no one has yet
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == int(os.environ["WORLD_SIZE"])
"""


def megatron_core() -> bool:
    """Whether megatron-core is installed, without importing it into this process."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        return False


needs_megatron = pytest.mark.skipif(not megatron_core(), reason="needs megatron-core")


@dataclass(frozen=True)
class Case:
    """A benchmark's command line ({tmp}: the test's folder) and what its stdout must say."""

    argv: list[str]
    says: list[str]
    marks: list[pytest.MarkDecorator] = field(default_factory=list)


CASES = {
    "gang_start": Case(
        ["gang_start.py", "--quick", "--sizes", "1,2", "--repeats", "1", "--tests", "2",
         "--no-megatron", "--with-te"],
        ["left out: ws2: needs 2 devices, 1 available (cpu:1)", "world_size(1), first excluded",
         "megatron.core left out by --no-megatron; transformer_engine.pytorch "],
    ),
    "lane": Case(
        ["lane.py", "--quick", "--only", "b", "--modules", "1", "--tests", "2", "--durations",
         "0.1", "--heavy-import", "", "--png-dir", "{tmp}"],
        ["ws2: needs 2 devices, 1 available", "ws4: needs 4 devices, 1 available", "2/0/0"],
    ),
    "layout_reuse": Case(
        ["layout_reuse.py", "--tests", "3"],
        ["world_size(2) tp=2 pp=1: needs 2 devices, 1 available",
         "measured world_size(1) tp=1 pp=1 instead"],
        [needs_megatron],
    ),
    "session_start": Case(
        ["session_start.py", "--repeats", "1", "--modes", "plain", "--heavy-import",
         "torch.distributed"],
        ["world_size(2) tests: needs 2 devices, 1 available", "one world_size(1) test each"],
    ),
    "startup_phases": Case(
        ["startup_phases.py", "--modules", "2", "--functions", "10", "--tests", "2", "--pairs",
         "1", "-k", "2"],
        ["launch to first test s", "K-run's launch to first test"],
    ),
    "gangs_per_device": Case(
        ["gangs_per_device.py", "--tests", "2", "--modules", "1", "--rounds", "1", "--min-s",
         "0.01", "--max-s", "0.02", "--per-device", "2"],
        ["left out: needs 2 devices, 1 available (cpu:1)", "-n auto, K=2"],
    ),
    "coverage": Case(
        ["coverage.py", "--modes", "torchrun", "--nproc", "2", "--suite", "{tmp}/suite",
         "--source", "{tmp}/suite"],
        ["torchrun --nproc-per-node 2: needs 2 devices, 1 available (cpu:1); ran 1"],
    ),
    "real_suite": Case(
        ["real_suite.py", "suite", "--nproc", "2", "--modes", "serial,faults", "--out",
         "{tmp}/out"],
        ["--nproc 2: needs 2 devices, 1 available (cpu:1); ran 1",
         "faults: needs 2 ranks (rank 1 crashes or hangs), 1 running",
         "where the wall time went", "to first test s"],
    ),
}  # fmt: skip


def command(argv: list[str], tmp: Path) -> list[str]:
    script, *args = (arg.replace("{tmp}", str(tmp)) for arg in argv)
    return [sys.executable, str(BENCH / script), *args, "--devices", "cpu:1"]


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)


def assert_ran_and_said(done: subprocess.CompletedProcess[str], says: list[str]) -> None:
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, output
    for words in says:
        assert words in done.stdout, f"{words!r} not in the report\n{output}"


@pytest.fixture
def plain_shell(monkeypatch: pytest.MonkeyPatch, tag: str, tmp_path: Path) -> Path:
    """A folder to run in, from a shell that sees no GPU and no rank's variables; afterwards no
    process the benchmark started is left."""
    start_from_a_plain_shell(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_tiny.py").write_text(TINY_SUITE)
    yield tmp_path
    assert_no_processes_left(tag)


@pytest.mark.parametrize(
    "case", [pytest.param(case, id=name, marks=case.marks) for name, case in CASES.items()]
)
def test_benchmark_fits_one_device(case: Case, plain_shell: Path) -> None:
    assert_ran_and_said(run(command(case.argv, plain_shell), plain_shell), case.says)


@needs_megatron
def test_nccl_shutdown_fits_one_rank(plain_shell: Path) -> None:
    """A torchrun script: one rank on CPU leaves tp=2 out."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    script = [str(BENCH / "nccl_shutdown.py"), "--device", "cpu", "--rounds", "1"]
    done = run([*torchrun, *script], plain_shell)
    assert_ran_and_said(done, ["left out: tp=2: needs a multiple of 2 ranks, 1 running"])


JUNIT_CASE = (
    '<testcase classname="{module}" name="{name}" time="{time}"><properties>{size}'
    '<property name="devices" value="0"/></properties></testcase>'
)


def junit_record(tests: list[tuple[str, str, int | None, float]]) -> str:
    """A junit file as the plugin writes it: a marked test's world size among its properties."""
    cases = "".join(
        JUNIT_CASE.format(
            module=module,
            name=name,
            time=time,
            size="" if size is None else f'<property name="world_size" value="{size}"/>',
        )
        for module, name, size, time in tests
    )
    return f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>'


def test_replay_of_a_junit_file(tmp_path: Path) -> None:
    """bench/replay.py on a generated junit file: a row per device count, the serial sum of what
    fits, the simulated scheduler no slower than the ideal allows, and what did not fit."""
    tests = [("tests.test_a", f"test_one[ws1-{i}]", 1, 1.0) for i in range(8)]
    tests += [("tests.test_b.TestPair", f"test_two[{i}]", 2, 0.5) for i in range(4)]
    tests += [("tests.test_c", "test_eight", 8, 2.0), ("tests.test_c", "test_plain", None, 1.0)]
    record = tmp_path / "junit.xml"
    record.write_text(junit_record(tests))
    replay = [sys.executable, str(BENCH / "replay.py"), str(record), "--json", "out.json"]
    done = run(replay, tmp_path)
    assert_ran_and_said(done, ["left out: D=1: 4 of ws2, 1 of ws8", "D=4: 1 of ws8"])
    rows = {row["devices"]: row for row in json.loads((tmp_path / "out.json").read_text())["rows"]}
    assert sorted(rows) == [1, 2, 4, 8]
    assert rows[1]["serial"] == pytest.approx(9.0) and rows[1]["megatron"] == pytest.approx(9.0)
    assert rows[8]["serial"] == pytest.approx(13.0) and rows[8]["torchrun"] == pytest.approx(13.0)
    for row in rows.values():
        assert row["ideal"] - 1e-9 <= row["megatron"] <= row["serial"] + 1e-9


def test_replay_of_a_durations_file(tmp_path: Path) -> None:
    """The same from a `--megatron-store-durations` file."""
    entries = {f"tests/test_a.py::t{i}": {"world_size": 2, "duration": 1.0} for i in range(4)}
    record = tmp_path / "durations.json"
    record.write_text(json.dumps({"version": 1, "tests": entries}))
    replay = [sys.executable, str(BENCH / "replay.py"), str(record), "--device-counts", "2,4"]
    done = run(replay, tmp_path)
    assert_ran_and_said(done, ["left out: nothing", "4 tests (ws2 x4)"])


def test_replay_of_a_real_suite_run_with_gangs_sharing_a_device(tmp_path: Path) -> None:
    """One run of a bench/real_suite.py JSON file, replayed on one device with K = 4 gangs on
    it: four tests at once, with the durations known and without them."""
    tests = {f"tests.test_{m}.TestX::t{i}": {"outcome": "passed", "seconds": 1.0}
             for m in "ab" for i in range(4)}  # fmt: skip
    runs = [{"name": "serial", "tests": tests}, {"name": "other", "tests": {}}]
    record = tmp_path / "suite.json"
    record.write_text(json.dumps({"arguments": {"nproc": 1}, "runs": runs}))
    for first_run in ([], ["--first-run"]):
        replay = [sys.executable, str(BENCH / "replay.py"), str(record), "--run", "serial",
                  "--device-counts", "1", "--gangs-per-device", "4", "--json", "out.json",
                  *first_run]  # fmt: skip
        done = run(replay, tmp_path)
        assert_ran_and_said(done, ["8 tests (ws1 x8)", "schedule: 4 gang(s) per device"])
        (row,) = json.loads((tmp_path / "out.json").read_text())["rows"]
        assert row["serial"] == pytest.approx(8.0)
        assert row["ideal"] == pytest.approx(2.0)
        assert row["megatron"] < 8.0 * 0.75, row


def test_replay_of_a_run_report_told_other_durations(tmp_path: Path) -> None:
    """A `--megatron-report` file replayed as its run was scheduled: told a durations file that
    has one test far shorter than it ran, two tests marked exclusive, and beside today's
    scheduler the one of HEAD."""
    spans = [("m0", [0.5, 3.0, 0.5, 0.5])] + [(f"m{m}", [0.5, 0.5, 0.5, 2.0]) for m in (1, 2, 3)]
    spans.append(("x", [0.1, 0.1]))
    entries, told, clock = [], {}, 0.0
    for module, durations in spans:
        for i, duration in enumerate(durations):
            nodeid = f"tests/{module}.py::t{i}"
            entries.append({"nodeid": nodeid, "world_size": 1, "start": clock,
                            "end": clock + duration})  # fmt: skip
            told[nodeid] = {"world_size": 1, "duration": 0.5 if module == "m0" else duration}
            clock += duration
    record, durations_file = tmp_path / "report.json", tmp_path / "told.json"
    record.write_text(json.dumps({"version": 1, "devices": [0], "tests": entries}))
    durations_file.write_text(json.dumps({"version": 1, "tests": told}))
    replay = [sys.executable, str(BENCH / "replay.py"), str(record), "--device-counts", "1",
              "--gangs-per-device", "4", "--gang-start", "0.1", "--module-cost", "0.05",
              "--told", str(durations_file), "--exclusive", "tests/x.py::", "--before", "HEAD",
              "--json", "out.json"]  # fmt: skip
    done = run(replay, tmp_path)
    assert_ran_and_said(
        done,
        [
            "18 tests (ws1 x18)",
            f"durations known: those of {durations_file}",
            "2 test(s) exclusive_devices",
            "HEAD, simulated (s)",
        ],
    )
    (row,) = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert row["megatron"] == pytest.approx(5.0)  # as tests/test_simulator.py's same lane
    assert row["before"] is not None


def test_sim_lanes_prints_today_against_before(tmp_path: Path) -> None:
    """bench/sim_lanes.py on two lanes: today's scheduler with and without known durations (the
    one at --before too, where git has it)."""
    done = run([sys.executable, str(BENCH / "sim_lanes.py"), "--lanes", "2"], tmp_path)
    assert_ran_and_said(done, ["today                 known", "today               unknown"])


SPAWNS_SUITE = """
import multiprocessing


def square(n):
    return n * n


def test_a_spawned_child_starts():
    # as Megatron-LM's checkpointing does: the child runs the rank's main script again
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(square, (3,)) == 9
"""


def test_real_suite_torchrun_ranks_can_spawn_children(plain_shell: Path) -> None:
    """A `spawn` child of a torchrun rank starts, as under `torchrun -m pytest`: when real_suite
    itself was the ranks' script, the child's import of it failed, and Megatron-LM's
    checkpointing tests failed under torchrun only. Both modes say where their wall went, and
    the collect-only run that lists the expected tests can be profiled, whatever verbosity the
    suite's addopts add (with `-vv` the terminal lists no node ids)."""
    (plain_shell / "suite" / "test_spawns.py").write_text(SPAWNS_SUITE)
    (plain_shell / "pytest.ini").write_text("[pytest]\naddopts = -vv\n")
    argv = ["real_suite.py", "suite", "--nproc", "1", "--modes", "torchrun,serial", "--out",
            "{tmp}/out", "--json", "{tmp}/runs.json",
            "--profile-collection", "{tmp}/collect.prof"]  # fmt: skip
    assert_ran_and_said(run(command(argv, plain_shell), plain_shell), ["every test has the same"])
    runs = json.loads((plain_shell / "runs.json").read_text())["runs"]
    passed = {"passed": 2, "failed": 0, "skipped": 0, "error": 0}
    assert [run["counts"] for run in runs] == [passed, passed]
    assert all(sorted(run["expected"]) == sorted(run["tests"]) for run in runs), runs
    assert all(set(run["phases"]) == {"to first test", "tests", "after last test"} for run in runs)
    assert pstats.Stats(str(plain_shell / "collect.prof")).total_calls > 0  # the collect-only's


CUT_SHORT_SUITE = """
import time

import pytest


@pytest.mark.parametrize("index", range(3))
def test_quick(index):
    assert index != 1


def test_past_the_cap():
    time.sleep(120)
"""


def test_real_suite_runs_cut_at_their_cap_still_compare(plain_shell: Path) -> None:
    """Runs killed at their cap write no junit: each mode's streamed reports give the outcomes
    it reached (torchrun's rank 0, the plugin's driver), and a table the time each run took to
    finish the tests that every run finished, side by side."""
    (plain_shell / "suite" / "test_cut.py").write_text(CUT_SHORT_SUITE)
    argv = ["real_suite.py", "suite/test_cut.py", "--nproc", "1", "--modes", "torchrun,serial",
            "--cap", "8", "--out", "{tmp}/out", "--json", "{tmp}/runs.json"]  # fmt: skip
    says = ["to the 3 tests (of 4) that every run finished", "every test has the same outcome"]
    assert_ran_and_said(run(command(argv, plain_shell), plain_shell), says)
    runs = json.loads((plain_shell / "runs.json").read_text())["runs"]
    assert [(run["killed"], run["source"]) for run in runs] == [(True, "stream")] * 2
    reached = {"passed": 2, "failed": 1, "skipped": 0, "error": 0}
    assert [run["counts"] for run in runs] == [reached, reached]
    assert all(len(run["finished"]) == 3 for run in runs), runs


MODELOPT_STYLE_TEST = """
import os


def test_finds_the_prebuilt_extensions():
    # modelopt's session fixture JIT-builds its quant extensions into this folder
    assert os.environ["TORCH_EXTENSIONS_DIR"] == os.environ["PREBUILT_EXTENSIONS"]
"""


def test_modelopt_compare_runs_its_modes_on_the_suites_prebuilt_extensions(
    plain_shell: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/modelopt/compare.py, upstream's pools and the plugin, on a stand-in suite: each
    mode's tests see the extensions folder that run.sh built (not real_suite's empty one), and
    each run says where its wall went. Both had broken unseen until a GPU sitting."""
    suite = plain_shell / "modelopt"
    (suite / "tests" / "gpu_megatron").mkdir(parents=True)
    (suite / "tests" / "gpu_megatron" / "test_ext.py").write_text(MODELOPT_STYLE_TEST)
    # an older copy, as an assembled suite may hold: one that writes no collected ids
    older = (BENCH / "stream_reports.py").read_text().replace("COLLECTED_IDS", "NOT_YET")
    (suite / "stream_reports.py").write_text(older)
    # upstream's addopts say -v; with -vv the terminal's collect-only lists no node ids
    (suite / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-vv"\n')
    prebuilt = str(plain_shell / "extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", prebuilt)
    monkeypatch.setenv("PREBUILT_EXTENSIONS", prebuilt)
    store = plain_shell / "store"
    argv = [sys.executable, str(BENCH / "modelopt" / "compare.py"), "--suite", str(suite),
            "--store", str(store), "--modes", "own,serial", "--cap", "240"]  # fmt: skip
    assert_ran_and_said(run(argv, plain_shell), ["own", "serial"])
    for mode in ("own", "serial"):
        record = json.loads((store / f"{mode}.run.json").read_text())
        assert [test["outcome"] for test in record["tests"].values()] == ["passed"], record
        assert record["expected"] == list(record["tests"]), record  # what collection found
        assert set(record["phases"]) == {"to first test", "tests", "after last test"}, record
