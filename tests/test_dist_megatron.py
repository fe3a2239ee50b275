"""End to end: `--dist megatron` under real pytest-xdist runs of generated suites.

Generated tests record where and when they ran (`audit.py` below, into $AUDIT_DIR); the outer
test checks from those records that no device ever served two jobs at once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import assert_no_processes_left

from xdist_megatron.placement import home_device, parse_devices, shared_by, worker_block

DIST = ("--dist", "megatron")

AUDIT = """
import json, os, time
from contextlib import contextmanager

@contextmanager
def interval(job):
    start = time.time()
    yield
    end = time.time()
    worker = int(os.environ["XDIST_MEGATRON_WORKER"])
    devices = os.environ.get("XDIST_MEGATRON_DEVICES")
    record = {
        "job": os.environ.get("AUDIT_SESSION", "") + job,
        "rank": int(os.environ["RANK"]) if devices else None,
        "worker": worker,
        "devices": [int(d) for d in devices.split(",")] if devices else None,
        "start": start,
        "end": end,
    }
    with open(os.path.join(os.environ["AUDIT_DIR"], f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\\n")
"""

AUDIT_CONFTEST = """
import pytest

@pytest.fixture
def job(request):
    return request.node.nodeid
"""

MIXED_MODULE = """
import time
import pytest
from audit import interval

@pytest.mark.world_size(1, 2, 4, 8)
def test_gang(job, rank):
    with interval(job):
        time.sleep(0.2)

def test_plain_one(job):
    with interval(job):
        time.sleep(0.2)

def test_plain_two(job):
    with interval(job):
        time.sleep(0.2)
"""


def read_records(folder: Path) -> list[dict]:
    paths = sorted(folder.glob("*.jsonl"))
    return [json.loads(line) for path in paths for line in path.read_text().splitlines()]


def overlaps(records: list[dict], devices_of) -> list[tuple]:
    """(device, job, job) for each two different jobs that used one device at the same time.
    A job spans, on each of its devices, from its first rank's start to its last rank's end."""
    spans: dict[tuple[int, str], list[float]] = {}
    for record in records:
        for device in devices_of(record):
            span = spans.setdefault((device, record["job"]), [record["start"], record["end"]])
            span[0] = min(span[0], record["start"])
            span[1] = max(span[1], record["end"])
    by_device = defaultdict(list)
    for (device, job), (start, end) in spans.items():
        by_device[device].append((start, end, job))
    found = []
    for device, intervals in by_device.items():
        intervals.sort()
        last_end, last_job = float("-inf"), None
        for start, end, job in intervals:
            if start < last_end:
                found.append((device, last_job, job))
            if end > last_end:
                last_end, last_job = end, job
    return found


@pytest.fixture
def audit_dir(pytester, monkeypatch) -> Path:
    """Where the generated tests record their intervals."""
    folder = pytester.path / "audit"
    folder.mkdir()
    monkeypatch.setenv("AUDIT_DIR", str(folder))
    pytester.makepyfile(audit=AUDIT)
    pytester.makeconftest(AUDIT_CONFTEST)
    return folder


def test_mixed_lane_never_shares_a_device(pytester, run_pytest, audit_dir):
    """Invariants 1 and 2 on a mixed lane (sizes 1-8 and unmarked, three modules, four workers):
    every test passes and reports, each rank ran on its worker's block, and per device the
    intervals of different jobs never overlap."""
    pytester.makepyfile(**{f"test_mod{m}": MIXED_MODULE for m in range(3)})
    result = run_pytest("-n", "4", *DIST, "--megatron-devices", "cpu:8")
    result.assert_outcomes(passed=18)
    devices = shared_by(parse_devices("cpu:8", 0, 8), 4)  # placed for the 4 workers

    def devices_of(record: dict) -> list[int]:
        if record["devices"] is None:
            return [home_device(devices, record["worker"])]
        return record["devices"]

    records = read_records(audit_dir)
    ranks = defaultdict(set)
    for record in records:
        ranks[record["job"]].add(record["rank"])
        if record["devices"] is not None:
            size = len(record["devices"])
            assert tuple(record["devices"]) == worker_block(devices, record["worker"], size)
    expected = {
        f"test_mod{m}.py::test_gang[ws{size}]": set(range(size))
        for m in range(3)
        for size in (1, 2, 4, 8)
    }
    expected |= {
        f"test_mod{m}.py::test_plain_{n}": {None} for m in range(3) for n in ("one", "two")
    }
    assert dict(ranks) == expected
    assert overlaps(records, devices_of) == []


LONG_UNIT = """
import time

import pytest

@pytest.mark.world_size(1)
@pytest.mark.parametrize("n", range(8))
def test_long(n):
    time.sleep(0.3)
"""

SHORT_UNIT = """
import pytest

@pytest.mark.world_size(1)
def test_short():
    pass
"""


def test_an_idle_worker_steals_the_end_of_a_long_unit(pytester, run_pytest):
    """Through xdist's own steal command and its "unscheduled" answer: worker 1's single test
    leaves it idle beside worker 0's unit of eight, so it takes the end of worker 0's queue and
    runs it; every test reports once, from one worker."""
    pytester.makepyfile(test_long=LONG_UNIT, test_short=SHORT_UNIT)
    result = run_pytest("-n", "2", *DIST, "--megatron-devices", "cpu:2", "--junitxml=junit.xml")
    result.assert_outcomes(passed=9)
    worker_of = {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}["worker"]
        for case in ET.parse(pytester.path / "junit.xml").iter("testcase")
    }
    assert len(worker_of) == 9
    assert {worker_of[f"test_long[{n}]"] for n in range(8)} == {"gw0", "gw1"}, worker_of


SMALL_SUITE = """
import pytest

@pytest.mark.world_size(2)
def test_gang(rank, world_size):
    assert world_size == 2

def test_plain():
    pass
"""


def plugin_args(*names: str) -> list[str]:
    """`-p NAME` for each plugin, in load order."""
    return [arg for name in names for arg in ("-p", name)]


@pytest.mark.parametrize(
    "plugins",
    [("xdist_megatron.plugin", "xdist.plugin"), ("xdist.plugin", "xdist_megatron.plugin")],
)
def test_dist_choice_with_p_in_either_order(pytester, monkeypatch, plugins):
    """Loaded by -p alone (no entry points), in either order, `megatron` joins --dist's choices."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = pytester.runpytest_subprocess(*plugin_args(*plugins), "--dist", "bogus")
    result.stderr.fnmatch_lines(["*--dist: invalid choice: 'bogus' (choose from *'megatron')"])


def test_dist_megatron_is_listed_in_help(pytester):
    """A user finds the mode where the other modes are listed: under --dist in `pytest --help`."""
    result = pytester.runpytest_subprocess("--help")
    help_text = result.stdout.str()
    dist_help = help_text[help_text.index("--dist=distmode") : help_text.index("--loadscope")]
    assert "megatron" in dist_help


def test_dist_megatron_with_p_plugin_under_xdist(pytester, run_pytest, monkeypatch):
    """-p loads the plugin in the workers too: marked tests run on gangs there."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_small=SMALL_SUITE)
    result = run_pytest(
        *plugin_args("xdist.plugin", "xdist_megatron.plugin"), "-n", "2", *DIST, "-v"
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines_random(
        ["created: 2/2 workers", "*PASSED test_small.py::test_gang*"]
    )


def test_dist_megatron_without_n_runs_serially(pytester, run_pytest, monkeypatch):
    """Without -n there is no xdist session: tests run here, and the header says so once."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_small=SMALL_SUITE)
    result = run_pytest(*plugin_args("xdist_megatron.plugin", "xdist.plugin"), *DIST)
    result.assert_outcomes(passed=2)
    assert result.stdout.str().count("--dist megatron without -n") == 1
    result.stdout.no_fnmatch_line("*workers*")


ONE_AT_A_TIME_SUITE = """
import os
import pytest

@pytest.mark.world_size(2)
def test_on_all_slots(rank):
    assert os.environ["XDIST_MEGATRON_DEVICES"] == "0,1"

def test_unmarked():
    assert "PYTEST_XDIST_WORKER" not in os.environ
"""


@pytest.mark.parametrize(
    "extra",
    [
        ("--megatron-devices", "cpu:1"),
        ("--megatron-devices", "cpu:2", "--megatron-world-sizes", "2"),
    ],
    ids=["one-slot", "every-test-needs-both-slots"],
)
def test_n_auto_runs_serially_where_one_gang_fits_at_a_time(pytester, run_pytest, extra):
    """Workers would add only their start-up to the same work: -n auto starts none, and the
    header says why."""
    pytester.makepyfile(test_one_at_a_time=ONE_AT_A_TIME_SUITE)
    result = run_pytest("-n", "auto", *DIST, *extra, "-rs")
    result.stdout.fnmatch_lines(["xdist-megatron: -n auto: the * device(s) fit one gang of *"])
    result.stdout.no_fnmatch_line("*created: *worker*")
    if "cpu:1" in extra:
        result.assert_outcomes(passed=1, skipped=1)  # the ws2 test needs 2 devices
    else:
        result.assert_outcomes(passed=1, deselected=1)  # the unmarked test is world size 1


PLAIN_SUITE = """
def test_one():
    pass

def test_two():
    pass
"""


def test_n_auto_counts_cpu_cores_up_to_maxprocesses(pytester, run_pytest):
    """--maxprocesses caps -n auto's count (test_n_auto_is_the_plugins_count: the count)."""
    pytester.makepyfile(test_plain=PLAIN_SUITE)
    result = run_pytest("-n", "auto", "--maxprocesses", "1", *DIST, "--megatron-devices", "cpu:8")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["created: 1/1 worker"])


def test_n_auto_is_the_plugins_count(pytester, tag):
    """-n auto in CPU mode starts one worker per core (at most one per slot). With the CPU
    affinity narrowed to one core (where taskset exists), xdist's default would start 1 worker;
    the contract is the plugin's count (os.cpu_count() in CPU mode, at most one per slot; the
    GPU count on GPUs)."""
    pytester.makepyfile(test_plain=PLAIN_SUITE)
    narrowed = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    result = pytester.run(
        *narrowed,
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-n",
        "auto",
        *DIST,
        "--megatron-devices",
        "cpu:8",
        timeout=120,
    )
    assert_no_processes_left(tag)
    result.assert_outcomes(passed=2)
    workers = min(os.cpu_count() or 1, 8)
    result.stdout.fnmatch_lines([f"created: {workers}/{workers} workers"])


CRASH_SUITES = {
    "test_a_crash": """
import os, signal

def test_crash():
    os.kill(os.getpid(), signal.SIGKILL)
""",
    "test_b_gang": """
import pytest

pytestmark = pytest.mark.world_size(2)

def test_first(rank):
    pass

def test_second(rank):
    pass
""",
    "test_c_after": """
import pytest

@pytest.mark.world_size(1)
def test_queued_behind_the_crash(rank):
    pass
""",
    "test_d_plain": """
def test_one():
    pass

def test_two():
    pass
""",
}


def test_killed_worker_is_replaced_and_nothing_is_lost(pytester, run_pytest):
    """An unmarked test SIGKILLs its worker while that worker's zygote is up. The scheduler
    sends the marked test_c_after to the worker holding the crashing test back, so c is queued
    behind it, and every worker is then told to shut down: c can only run on the replacement.
    The crash is reported, every other test passes, and no zygote or rank is left over."""
    pytester.makepyfile(**CRASH_SUITES)
    result = run_pytest("-n", "2", *DIST, "--megatron-devices", "cpu:2", "-v")
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*FAILED test_a_crash.py::test_crash*",
            "replacing crashed worker gw*",
            "*PASSED test_c_after.py::test_queued_behind_the_crash*",
        ]
    )
    result.stdout.fnmatch_lines(
        ["*worker 'gw*' crashed while running 'test_a_crash.py::test_crash'"]
    )


FORKED_WORKER_SUITE = """
import os, sys
import pytest

def parent_command():
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        return f.read().replace(b"\\0", b" ").decode()

def test_the_worker_is_forked_from_the_zygote():
    assert "xdist_megatron.zygote" in parent_command()
    assert sys.argv == ["-c"] and not hasattr(sys.modules["__main__"], "__file__")

def test_environment_is_the_workers(monkeypatch):
    assert os.environ["PYTEST_XDIST_WORKER"] == "gw" + os.environ["XDIST_MEGATRON_WORKER"]
    assert "XDIST_MEGATRON_ZYGOTE" not in os.environ

def test_asserts_are_rewritten():
    with pytest.raises(AssertionError, match="assert 1 == 2"):
        one = 1
        assert one == 2

@pytest.mark.world_size(2)
def test_a_gang_of_the_forked_worker(rank):
    assert rank in (0, 1)
"""


def test_workers_are_forked_from_the_shared_zygote_and_keep_xdist_ids(pytester, run_pytest):
    """Under --dist megatron each xdist worker is forked from the controller's zygote (through
    the launcher execnet runs as its `python`): it starts with torch and the suite's packages
    imported, as `python -u -c` would otherwise start it, pytest plugins imported afresh (no
    rewrite warnings), and its gangs run as before; no worker, zygote or rank is left after.
    Worker j keeps xdist's id gwj (fixtures such as worker_id index per-worker resources by it:
    test_environment_is_the_workers), and the status line counts the workers that exist."""
    pytester.makepyfile(test_forked=FORKED_WORKER_SUITE)
    result = run_pytest("-n", "2", *DIST, "-rA")
    result.assert_outcomes(passed=4)
    assert "cannot be rewritten" not in result.stdout.str()
    result.stdout.no_fnmatch_line("*/4 workers*")


ZYGOTE_DIES_CONFTEST = """
import os, signal, time

def pytest_configure(config):
    # In the worker (not the controller, not a rank): kill the zygote it was forked from.
    if "PYTEST_XDIST_WORKER" in os.environ and "XDIST_MEGATRON_ZYGOTE" not in os.environ:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            assert b"xdist_megatron.zygote" in f.read()
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(0.5)
"""

ZYGOTE_DIES_SUITE = """
import pytest

@pytest.mark.world_size(2)
def test_a_gang_after_it(rank):
    assert rank in (0, 1)

def test_plain_after_it():
    pass
"""


def test_a_zygote_that_dies_takes_no_forked_worker_with_it(pytester, run_pytest):
    """A forked worker outlives the zygote it came from (it is no rank): it goes on, its gangs
    come from a zygote of its own, and nothing is left after the session."""
    pytester.makeconftest(ZYGOTE_DIES_CONFTEST)
    pytester.makepyfile(test_zygote_dies=ZYGOTE_DIES_SUITE)
    result = run_pytest("-n", "1", *DIST, "--megatron-devices", "cpu:2", "-v")
    result.assert_outcomes(passed=2)
    assert "crashed" not in result.stdout.str()


SHARED_ZYGOTE_SUITE = """
import json, os
import pytest

pytestmark = pytest.mark.world_size(2)

def _record():
    worker = os.environ["PYTEST_XDIST_WORKER"]
    with open(os.path.join(os.environ["FACTS_DIR"], worker + ".json"), "w") as f:
        json.dump({"parent": os.getppid(), "devices": os.environ["XDIST_MEGATRON_DEVICES"]}, f)

def test_one(rank):
    if rank == 0:
        _record()

def test_two(rank):
    if rank == 0:
        _record()
"""


def test_workers_share_one_zygote(pytester, run_pytest, monkeypatch, tmp_path):
    """The workers fork their ranks from one zygote (the heavy packages are imported once per
    host, not once per worker), and each rank still sees its own worker's environment."""
    pytester.makepyfile(test_a=SHARED_ZYGOTE_SUITE, test_b=SHARED_ZYGOTE_SUITE)
    monkeypatch.setenv("FACTS_DIR", str(tmp_path))
    result = run_pytest("-n", "2", *DIST, "--megatron-devices", "cpu:4")
    result.assert_outcomes(passed=4)
    facts = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("gw0", "gw1")}
    assert facts["gw0"]["parent"] == facts["gw1"]["parent"], facts
    assert (facts["gw0"]["devices"], facts["gw1"]["devices"]) == ("0,1", "2,3")


STOP_SUITE = {
    "test_a_gang": """
import time
import pytest

pytestmark = pytest.mark.world_size(2)

def test_ok(rank):
    pass

def test_fails_on_rank_one(rank):
    assert rank == 0

def test_later(rank):
    time.sleep(0.5)
""",
    "test_b_plain": "\n".join(f"def test_{i}():\n    pass\n" for i in range(6)),
}


def test_exitfirst_stops_cleanly(pytester, run_pytest):
    """-x: the first failing marked test stops the session; xdist reports the stop as an
    interruption (exit code 2, as with --dist load), fewer tests run than were collected, and
    the gangs of every worker are gone."""
    pytester.makepyfile(**STOP_SUITE)
    result = run_pytest("-n", "2", *DIST, "--megatron-devices", "cpu:2", "-x")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] == 1
    assert outcomes.get("passed", 0) + 1 < 9
    result.stdout.fnmatch_lines(["*stopping after 1 failures*"])
    result.stdout.fnmatch_lines(["FAILED test_a_gang.py::test_fails_on_rank_one*"])


LF_SUITE = """
import pytest

pytestmark = pytest.mark.world_size(2)

def test_passes(rank):
    pass

def test_fails(rank):
    assert rank == 0

def test_also_passes(rank):
    pass
"""


def test_last_failed_reruns_only_the_failed_marked_test(pytester, tag):
    """--lf keeps working under --dist megatron: the second run schedules the one failure."""
    pytester.makepyfile(test_lf=LF_SUITE, test_plain=PLAIN_SUITE)
    args = ("-n", "2", *DIST, "--megatron-devices", "cpu:2", "-v")
    first = pytester.runpytest_subprocess(*args, timeout=300)
    assert_no_processes_left(tag)
    first.assert_outcomes(passed=4, failed=1)
    second = pytester.runpytest_subprocess("--lf", *args, timeout=300)
    assert_no_processes_left(tag)
    second.assert_outcomes(failed=1)
    second.stdout.fnmatch_lines(["*FAILED test_lf.py::test_fails*"])
    second.stdout.no_fnmatch_line("*PASSED*")


SHARED_SUITE = """
import time
import pytest
from audit import interval

pytestmark = pytest.mark.world_size(2)

@pytest.mark.parametrize("n", range(4))
def test_gang(job, rank, n):
    with interval(job):
        time.sleep(0.7)  # a session's 8 tests outlast the skew of the two sessions' gang starts
"""

BARRIER_CONFTEST = """
import os, time
from pathlib import Path

import pytest

@pytest.fixture
def job(request):
    return request.node.nodeid

def pytest_sessionstart(session):
    # Before any test holds a device (a session fixture would wait inside the first test's job,
    # holding its locks): every process of each session waits until the other session is here.
    folder = Path(os.environ["AUDIT_DIR"])
    (folder / f"started-{os.environ['AUDIT_SESSION']}").touch()
    deadline = time.monotonic() + 120
    while len(list(folder.glob("started-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def test_two_sessions_share_devices_through_the_lock_dir(pytester, tag, audit_dir):
    """Two pytest sessions on one host, pointed at one --megatron-lock-dir, both place ws2
    gangs on devices 0-1: the locks make them take turns, never overlapping on a device."""
    pytester.makepyfile(test_shared_a=SHARED_SUITE, test_shared_b=SHARED_SUITE)
    pytester.makeconftest(BARRIER_CONFTEST)
    locks = pytester.path / "locks"
    sessions = []
    for name in ("a", "b"):
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", *DIST]
        command += ["--megatron-devices", "cpu:2", "--megatron-lock-dir", str(locks)]
        command += [f"--basetemp={pytester.path / f'tmp-{name}'}"]
        env = {**os.environ, "AUDIT_SESSION": f"{name}:"}
        sessions.append(
            subprocess.Popen(
                command,
                cwd=pytester.path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [session.communicate(timeout=300)[0] for session in sessions]
    assert_no_processes_left(tag)
    for session, output in zip(sessions, outputs, strict=True):
        assert session.returncode == 0, output
        assert "8 passed" in output, output
    records = read_records(audit_dir)
    assert len({r["job"] for r in records}) == 16
    assert overlaps(records, lambda record: record["devices"]) == []
    by_session = [[r for r in records if r["job"].startswith(n)] for n in ("a:", "b:")]
    last_start = max(min(r["start"] for r in rs) for rs in by_session)
    first_end = min(max(r["end"] for r in rs) for rs in by_session)
    assert last_start < first_end, "the sessions never competed for the devices"


CONTRACT_SUITE = """
import pytest

def test_unmarked():
    pass

@pytest.mark.world_size(2)
def test_passes(rank):
    pass

@pytest.mark.world_size(2)
def test_fails_on_one_rank(rank):
    assert rank == 0

@pytest.mark.world_size(2)
def test_skips(rank):
    pytest.skip("not today")

@pytest.mark.world_size(2)
@pytest.mark.xfail(reason="known gap")
def test_xfails(rank):
    assert rank < 0

@pytest.mark.world_size(8)
def test_too_big(rank):
    pass

@pytest.mark.world_size(1, 2, 4)
def test_sizes(rank, world_size):
    assert 0 <= rank < world_size

@pytest.mark.world_size(2)
class TestWithSetup:
    def setup_method(self, method):
        self.prepared = method.__name__

    def test_setup_ran_on_the_rank(self, rank):
        assert self.prepared == "test_setup_ran_on_the_rank"
"""


def junit_outcomes(path: Path) -> dict[tuple[str, str], tuple[str, str | None]]:
    """(classname, name) -> (outcome, message of a skip or xfail) of each junit testcase."""
    outcomes = {}
    for case in ET.parse(path).iter("testcase"):
        found = [child for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = found[0].tag if found else "passed"
        message = found[0].get("message") if found and outcome == "skipped" else None
        outcomes[(case.get("classname"), case.get("name"))] = (outcome, message)
    return outcomes


def test_same_outcomes_as_plain_pytest(pytester, run_pytest):
    """The contract's outcomes do not depend on the scheduling: -n 2 --dist megatron reports
    every test as a serial run does (pass, fail on one rank, skip, xfail, too big, sizes,
    setup_method on the ranks)."""
    pytester.makepyfile(test_contract=CONTRACT_SUITE)
    reports = {}
    for name, args in (("serial", ()), ("xdist", ("-n", "2", *DIST))):
        junit = pytester.path / f"{name}.xml"
        result = run_pytest(*args, "--megatron-devices", "cpu:4", f"--junitxml={junit}")
        result.assert_outcomes(passed=6, failed=1, skipped=2, xfailed=1)
        reports[name] = junit_outcomes(junit)
    assert reports["xdist"] == reports["serial"]
    assert reports["serial"][("test_contract", "test_too_big")] == (
        "skipped",
        "needs 8 devices, 4 available",
    )


ORDER_BY_WORKER_SUITE = """
import os
import pytest

NAMES = sorted("abcdef", reverse=os.environ.get("PYTEST_XDIST_WORKER") == "gw1")


@pytest.mark.world_size(1)
@pytest.mark.parametrize("name", NAMES)
def test_named(name, rank):
    pass


@pytest.mark.parametrize("name", NAMES)
def test_unmarked(name):
    pass
"""


def test_workers_that_collect_in_another_order_run_the_same_tests(pytester, run_pytest):
    """Parametrize over a set orders the tests by each process's hash seed: the workers'
    collections differ in order only, and each test still runs once, by its own index."""
    pytester.makepyfile(test_order=ORDER_BY_WORKER_SUITE)
    result = run_pytest("-n", "2", *DIST, "--megatron-devices", "cpu:2", "-v")
    result.assert_outcomes(passed=12)
    for name in "abcdef":
        ran = [line for line in result.stdout.lines if "PASSED" in line]
        assert sum(f"test_named[{name}]" in line for line in ran) == 1, ran


JOINS_AT_IMPORT_SUITE = """
import os
import pytest
import torch.distributed as dist

# As Megatron-LM's modules do: join a group of one at import, in whichever process collects it.
if not dist.is_initialized():  # a rank's is, by the plugin
    PORT = os.environ.get("MASTER_PORT", "29517")
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{PORT}", rank=0, world_size=1)


@pytest.mark.world_size(1)
@pytest.mark.parametrize("n", range(4))
def test_marked(n, rank):
    pass


def test_the_port_is_one_the_kernel_never_hands_out():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        low, high = map(int, ports.read().split())
    assert not low <= int(os.environ["MASTER_PORT"]) <= high
"""


def test_workers_that_join_a_group_at_import_do_not_collide(pytester, run_pytest):
    """Each worker gets a MASTER_PORT of its own, as each torchrun run has: a module that joins
    a process group at import collects on every worker, not on one. The port lies outside the
    kernel's ephemeral range, so that no bind(0) or outgoing connection takes it before the
    worker's collection binds it (seen on the H200: one worker of four lost its collection)."""
    pytester.makepyfile(test_joins=JOINS_AT_IMPORT_SUITE)
    result = run_pytest("-n", "2", *DIST, "--megatron-devices", "cpu:2")
    result.assert_outcomes(passed=5)


PAIRS_SUITE = """
import pytest


@pytest.mark.world_size(2)
@pytest.mark.parametrize("n", range(2))
def test_pair(n, rank):
    pass
"""


def test_n_auto_remembers_the_last_runs_world_sizes(pytester, run_pytest):
    """On cpu:2 a first run cannot know that every test needs both slots: -n auto starts
    workers. The pytest cache then holds the sizes, and the next -n auto runs serially and says
    where it knows them from."""
    pytester.makepyfile(test_pairs=PAIRS_SUITE)
    options = ("-n", "auto", *DIST, "--megatron-devices", "cpu:2")
    first = run_pytest(*options, cache=True)
    first.assert_outcomes(passed=2)
    first.stdout.no_fnmatch_line("*-n auto: the 2 device(s) fit one gang*")
    second = run_pytest(*options, cache=True)
    second.assert_outcomes(passed=2)
    header = "*-n auto: the 2 device(s) fit one gang of 2 at a time*"
    second.stdout.fnmatch_lines([header + "the last run's, in the pytest cache*"])
    cleared = run_pytest(*options, "--cache-clear", cache=True)
    cleared.stdout.no_fnmatch_line("*-n auto: the 2 device(s) fit one gang*")


OTHER_TESTS_ON_GW1_SUITE = """
import os
import pytest

COUNT = 3 if os.environ.get("PYTEST_XDIST_WORKER") == "gw1" else 4


@pytest.mark.world_size(1)
@pytest.mark.parametrize("n", range(COUNT))
def test_counted(n, rank):
    pass
"""


def test_a_worker_that_collects_other_tests_is_named_and_idle(pytester, run_pytest):
    """A worker that collected fewer tests than another (a module failed to import there, say)
    gets no work, and the terminal says so; the fuller collection's tests all run."""
    pytester.makepyfile(test_other=OTHER_TESTS_ON_GW1_SUITE)
    result = run_pytest("-n", "2", *DIST, "--megatron-devices", "cpu:2")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*gw1 collected other tests than gw0 (3 against 4)*"])
