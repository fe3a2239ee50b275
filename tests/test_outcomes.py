"""End to end: per-rank outcomes merged into one pytest report, and pytest's options around them."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from conftest import assert_no_processes_left

MERGE_SUITE = """
import sys
import time

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.world_size(2)

def test_pass(rank):
    print(f"out of rank {rank}")
    print(f"err of rank {rank}", file=sys.stderr)

def test_fail_all(rank):
    assert rank == 7

def test_skip_all():
    pytest.skip("skipped everywhere")

def test_xfail_call():
    pytest.xfail("known gap")

@pytest.mark.xfail(reason="marked gap")
def test_xfail_marker(rank):
    assert rank < 0

@pytest.mark.xfail(strict=True, reason="expected to fail")
def test_xpass_strict():
    pass

@pytest.mark.skipif(True, reason="condition holds")
def test_skipif():
    raise AssertionError("a skipped test must not run")

@pytest.mark.timeout(2)
def test_hang(rank):
    if rank == 1:
        time.sleep(60)
    dist.barrier()
"""

TB_SUITE = """
import pytest

pytestmark = pytest.mark.world_size(2)

def check(values):
    assert values == [1, 3]

def test_pass(rank):
    print(f"out of rank {rank}")

def test_fail(rank):
    values = [rank, 2]
    check(values)

def test_after():
    pass
"""


def junit_failures(path) -> dict[str, tuple[str, float]]:
    """testcase name -> (failure message, seconds) for each failed testcase of a junit file."""
    failures = {}
    for case in ET.parse(path).iter("testcase"):
        failure = case.find("failure")
        if failure is not None:
            failures[case.get("name")] = (failure.get("message"), float(case.get("time")))
    return failures


def line_of(pytester: pytest.Pytester, module: str, text: str) -> int:
    """1-based line number of the first line of a generated module that contains `text`."""
    lines = (pytester.path / f"{module}.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_outcomes_merge_across_ranks(pytester, run_pytest):
    """Pass, fail, skip, xfail, skipif and pytest-timeout on gangs: report, junit, durations."""
    pytester.makepyfile(test_merge=MERGE_SUITE)
    junit = pytester.path / "junit.xml"
    result = run_pytest("-rA", "--megatron-timeout", "20", f"--junitxml={junit}", "--durations=5")
    result.assert_outcomes(passed=1, failed=3, skipped=2, xfailed=2)
    result.stdout.fnmatch_lines_random(
        [
            "PASSED test_merge.py::test_pass",
            "FAILED test_merge.py::test_fail_all - rank 0: assert 0 == 7 (ranks 0, 1 failed)",
            "SKIPPED [[]1[]] test_merge.py:*: skipped everywhere",
            "SKIPPED [[]1[]] test_merge.py:*: condition holds",
            "XFAIL test_merge.py::test_xfail_call - known gap",
            "XFAIL test_merge.py::test_xfail_marker - marked gap",
            "FAILED test_merge.py::test_xpass_strict - rank 0: [[]XPASS(strict)[]] expected*",
            "FAILED test_merge.py::test_hang - *timed out after 2 s*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_fail_all _*",
            "*- rank 0 -*",
            ">       assert rank == 7",
            "E       assert 0 == 7",
            "*- rank 1 -*",
            ">       assert rank == 7",
            "E       assert 1 == 7",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_hang _*",
            "Python stack of rank 0 (most recent call last):",
            f'  File "*test_merge.py", line {line_of(pytester, "test_merge", "barrier()")},'
            " in test_hang  <-- the test",
            "Python stack of rank 1 (most recent call last):",
            f'  File "*test_merge.py", line {line_of(pytester, "test_merge", "sleep(60)")},'
            " in test_hang  <-- the test",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_pass _*",
            "*- Captured stdout call (rank 0) -*",
            "out of rank 0",
            "*- Captured stderr call (rank 0) -*",
            "err of rank 0",
            "*- Captured stdout call (rank 1) -*",
            "out of rank 1",
            "*- Captured stderr call (rank 1) -*",
            "err of rank 1",
        ]
    )
    result.stdout.fnmatch_lines(["*slowest 5 durations*", "*s call *test_merge.py::test_hang"])
    failures = junit_failures(junit)
    assert failures["test_fail_all"][0].startswith("rank 0: assert 0 == 7 (ranks 0, 1 failed)")
    message, seconds = failures["test_hang"]
    assert "timed out after 2 s" in message
    assert seconds < 10, "the timeout marker must end the test within seconds"


def test_outcomes_other_than_pass_on_every_rank(pytester, run_pytest):
    """A test skipped or xfailed on every rank still gets the cleanup (its groups are gone in the
    next module); a failure on rank 1 only names rank 1; a skip on one rank only fails as a
    disagreement, not as a hang."""
    pytester.makepyfile(
        test_two="""
import pytest
import torch.distributed as dist

@pytest.mark.world_size(2)
def test_groups_were_destroyed():
    world = dist.distributed_c10d._world
    assert [pg for pg in world.pg_map if pg is not world.default_pg] == []
""",
        test_one="""
import pytest
import torch.distributed as dist

pytestmark = pytest.mark.world_size(2)

def test_skip_after_new_group():
    dist.new_group([0, 1])
    pytest.skip("every rank skips")

def test_xfail_after_new_group():
    dist.new_group([0, 1])
    pytest.xfail("every rank xfails")

def test_fail_one(rank):
    values = [1, 2]
    if rank == 1:
        assert values == [1, 3]

def test_skip_one(rank):
    if rank == 1:
        pytest.skip("only rank 1 skips")
""",
    )
    junit = pytester.path / "junit.xml"
    result = run_pytest("--megatron-timeout", "5", f"--junitxml={junit}")
    result.assert_outcomes(passed=1, skipped=1, xfailed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*_ test_fail_one _*",
            "*- rank 1 -*",
            "    def test_fail_one(rank):",
            ">           assert values == [[]1, 3[]]",
            "E           assert [[]1, 2[]] == [[]1, 3[]]",
            "test_one.py:*: AssertionError",
        ]
    )
    result.stdout.no_fnmatch_line("*- rank 0 -*")
    result.stdout.fnmatch_lines_random(
        [
            "FAILED test_one.py::test_fail_one - rank 1: assert [[]1, 2[]] == [[]1, 3[]]",
            "ranks disagree: rank 0 passed, rank 1 skipped (only rank 1 skips)",
        ]
    )
    assert junit_failures(junit)["test_fail_one"][0].startswith("rank 1: assert")


def test_assertion_explanation_matches_a_local_failure(pytester, run_pytest):
    """The same failing comparison explains itself on a rank as it does in the driver."""
    pytester.makepyfile(
        test_explain="""
import pytest

def check():
    assert {"a": 1, "b": 2} == {"a": 1, "b": 3}

def test_local():
    check()

@pytest.mark.world_size(1)
def test_on_rank():
    check()
"""
    )
    result = run_pytest("--megatron-timeout", "20")
    result.assert_outcomes(failed=2)
    sections = result.stdout.str().split("short test summary info")[0]
    assert sections.count("Differing items:") == 2
    assert sections.count("{'b': 2} != {'b': 3}") == 2


def test_tb_short_with_k_selection(pytester, run_pytest):
    """--tb=short shows each rank's failing lines without the whole function; -k deselects."""
    pytester.makepyfile(test_tb=TB_SUITE)
    result = run_pytest("--tb=short", "-k", "not after", "--megatron-timeout", "20")
    result.assert_outcomes(passed=1, failed=1, deselected=1)
    result.stdout.fnmatch_lines(
        [
            "*- rank 0 -*",
            "test_tb.py:*: in test_fail",
            "    check(values)",
            "test_tb.py:*: in check",
            "    assert values == [[]1, 3[]]",
            "E   assert [[]0, 2[]] == [[]1, 3[]]",
            "*- rank 1 -*",
            "E   assert [[]1, 2[]] == [[]1, 3[]]",
        ]
    )
    result.stdout.no_fnmatch_line("*def test_fail*")


def test_tb_native_with_capture_off(pytester, run_pytest):
    """--tb=native shows Python tracebacks per rank; -s lets the ranks print to the terminal."""
    pytester.makepyfile(test_tb=TB_SUITE)
    result = run_pytest("--tb=native", "-s", "--megatron-timeout", "20")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*- rank 0 -*",
            "Traceback (most recent call last):",
            '  File "*test_tb.py", line *, in test_fail',
            '  File "*test_tb.py", line *, in check',
            "AssertionError: assert [[]0, 2[]] == [[]1, 3[]]",
            "*- rank 1 -*",
            "Traceback (most recent call last):",
            "AssertionError: assert [[]1, 2[]] == [[]1, 3[]]",
        ]
    )
    result.stdout.fnmatch_lines_random(["*out of rank 0*", "*out of rank 1*"])


def test_tb_line_with_exitfirst(pytester, run_pytest):
    """--tb=line ends with the crash line naming the ranks; -x stops after the failing test."""
    pytester.makepyfile(test_tb=TB_SUITE)
    result = run_pytest("--tb=line", "-x", "--megatron-timeout", "20")
    result.assert_outcomes(passed=1, failed=1)
    check_line = line_of(pytester, "test_tb", "assert values")
    result.stdout.fnmatch_lines(
        [
            f"*test_tb.py:{check_line}: rank 0: assert [[]0, 2[]] == [[]1, 3[]] (ranks 0, 1 *",
            "*stopping after 1 failures*",
        ]
    )
    result.stdout.no_fnmatch_line("*def test_fail*")


def test_tb_no_and_last_failed_rerun(pytester, tag):
    """--tb=no prints no rank sections; --lf (pytest's cache) reruns only the failed marked test."""
    pytester.makepyfile(test_tb=TB_SUITE)
    first = pytester.runpytest_subprocess("--tb=no", "--megatron-timeout", "20")
    assert_no_processes_left(tag)
    first.assert_outcomes(passed=2, failed=1)
    first.stdout.fnmatch_lines(["FAILED test_tb.py::test_fail - rank 0: *"])
    first.stdout.no_fnmatch_line("*- rank 0 -*")
    first.stdout.no_fnmatch_line("E  *")
    again = pytester.runpytest_subprocess("--lf", "--tb=no", "--megatron-timeout", "20")
    assert_no_processes_left(tag)
    again.assert_outcomes(failed=1)
    again.stdout.fnmatch_lines(["run-last-failure: rerun previous 1 failure*"])


def test_timeout_zero_means_none_and_a_negative_one_is_a_usage_error(pytester, run_pytest):
    """As in pytest-timeout: `--megatron-timeout 0` lets a test run as long as it takes; a
    negative value stops the run before any test, naming the option."""
    pytester.makepyfile(
        test_slow="""
import time
import pytest

@pytest.mark.world_size(2)
def test_slower_than_nothing():
    time.sleep(0.5)
"""
    )
    run_pytest("--megatron-timeout", "0").assert_outcomes(passed=1)
    refused = run_pytest("--megatron-timeout", "-5")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*--megatron-timeout / megatron_timeout must be seconds >= 0*"])


def test_ini_settings_work_as_their_options(pytester, run_pytest):
    """`megatron_world_size` and `megatron_timeout` in the ini, in a plain run: an unmarked test
    runs on two ranks, and a rank that hangs is cut at the ini's timeout."""
    pytester.makeini("[pytest]\nmegatron_world_size = 2\nmegatron_timeout = 3\n")
    pytester.makepyfile(
        test_ini="""
import os
import time

def test_on_two_ranks():
    assert os.environ["WORLD_SIZE"] == "2"

def test_hangs_on_rank_1():
    if os.environ["RANK"] == "1":
        time.sleep(600)
"""
    )
    result = run_pytest("-rA")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 1 timed out after 3 s*"])


STAMPS_CONFTEST = """
import json
import os
import time

def pytest_sessionstart(session):
    session.config.stamps_from = time.time()

def pytest_runtest_logreport(report):
    if "RANK" not in os.environ:  # the driver's reports, not the ranks' own
        with open("stamps.jsonl", "a") as file:
            stamps = [report.nodeid, report.when, report.start, report.stop, report.outcome]
            file.write(json.dumps(stamps) + "\\n")

def pytest_sessionfinish(session):
    if "RANK" not in os.environ:
        with open("session.json", "w") as file:
            json.dump([session.config.stamps_from, time.time()], file)
"""

STAMPS_SUITE = """
import os
import time

import pytest

def test_local():
    time.sleep(0.1)

@pytest.mark.world_size(2)
def test_sleeps():
    time.sleep(0.3)

@pytest.mark.world_size(2)
def test_rank_1_exits(rank):
    if rank == 1:
        os._exit(3)
"""


def test_reports_say_when_each_phase_ran_as_local_ones_do(pytester, run_pytest):
    """A gang's reports carry `start` and `stop` as pytest's runner stamps a local test's (report
    logs and timelines read them; they were 0): the ranks' earliest start and latest stop, and
    for what the driver reports itself (a rank that died) when it saw it."""
    pytester.makeconftest(STAMPS_CONFTEST)
    pytester.makepyfile(test_stamps=STAMPS_SUITE)
    run_pytest().assert_outcomes(passed=2, failed=1)
    began, ended = json.loads((pytester.path / "session.json").read_text())
    phases: dict[str, dict[str, tuple[float, float]]] = {}
    for line in (pytester.path / "stamps.jsonl").read_text().splitlines():
        nodeid, when, start, stop, _ = json.loads(line)
        assert began <= start <= stop <= ended, (nodeid, when, start, stop, began, ended)
        phases.setdefault(nodeid.split("::")[-1], {})[when] = (start, stop)
    assert set(phases) == {"test_local", "test_sleeps", "test_rank_1_exits"}
    for name, by_phase in phases.items():
        setup, call, teardown = by_phase["setup"], by_phase["call"], by_phase["teardown"]
        assert setup[0] <= call[0] <= call[1] <= teardown[1], (name, by_phase)
    start, stop = phases["test_sleeps"]["call"]
    assert stop - start >= 0.3
