"""End to end: `pytest --cov` (and `coverage run -m pytest`) reports exactly the lines that ran,
on every rank, in the zygote's preloads and in the driver: serially, under
`-n 2 --dist megatron` and under the torchrun passthrough.

The measured package has rank-only branches: rank 0 takes one, rank 1 another, a line only a
world-size-4 gang reaches, a line no test reaches, a module whose top-level lines run only in
the zygote (a preload the driver never imports), a `no_cover` test and a test that hangs on
rank 1 until its timeout kills the gang (its peer's lines still count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import assert_no_processes_left, start_from_a_plain_shell

pytest.importorskip("pytest_cov")

BRANCHES = """
def which(rank):
    if rank == 0:
        return "zero"
    return "other"


def wide(world_size):
    if world_size == 4:
        return "wide"
    return "narrow"


def never():
    return "never"


def only_before_a_hang():
    return "kept"
"""

PRELOADED = """
LOADED = "in the zygote"


def used_on_ranks():
    return LOADED
"""

TESTS = """
import time

import pytest

from pkg import branches


@pytest.mark.world_size(2)
def test_ranks(rank):
    assert branches.which(rank)


@pytest.mark.world_size(4)
def test_wide(world_size):
    assert branches.wide(world_size) == "wide"


@pytest.mark.world_size(2)
def test_preloaded():
    from pkg import preloaded

    assert preloaded.used_on_ranks()


@pytest.mark.world_size(2)
@pytest.mark.no_cover
def test_not_measured():
    branches.never()
"""

HANG = """
import time

import pytest

from pkg import branches


@pytest.mark.world_size(2)
@pytest.mark.timeout(8)  # past a loaded box's first setup on a new gang under coverage
def test_hangs_on_rank_1(rank):
    if rank == 0:
        branches.only_before_a_hang()
    else:
        time.sleep(60)
"""

# Lines that never run: `narrow` (only ws4 calls wide), never() (a no_cover test's only), and
# only_before_a_hang() without the hanging test (with it, rank 0 ran it before its peer hung).
MISSED = {"pkg/branches.py": [10, 14, 18], "pkg/preloaded.py": [], "pkg/__init__.py": []}
MISSED_WITH_HANG = {**MISSED, "pkg/branches.py": [10, 14]}


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    start_from_a_plain_shell(monkeypatch)
    monkeypatch.delenv("COVERAGE_PROCESS_START", raising=False)  # when this suite is measured
    monkeypatch.delenv("COVERAGE_PROCESS_CONFIG", raising=False)
    pkg = pytester.mkpydir("pkg")
    (pkg / "branches.py").write_text(BRANCHES.lstrip())
    (pkg / "preloaded.py").write_text(PRELOADED.lstrip())
    pytester.makepyfile(test_ranks=TESTS)
    pytester.makeini("[pytest]\nmegatron_preload = pkg.preloaded\n")
    return pytester


def missed_lines(path: str) -> dict[str, list[int]]:
    with open(path) as f:
        files = json.load(f)["files"]
    return {name: info["missing_lines"] for name, info in files.items()}


def test_rank_lines_are_measured_under_xdist(suite: pytest.Pytester, run_pytest) -> None:
    suite.makepyfile(test_hang=HANG)
    xdist = ("-n", "2", "--dist", "megatron")
    result = run_pytest(*xdist, "--cov=pkg", "--cov-report=json:cov.json", "--cov-report=term")
    result.assert_outcomes(passed=4, failed=1)
    assert missed_lines(str(suite.path / "cov.json")) == MISSED_WITH_HANG
    assert "Couldn't use data file" not in result.stdout.str() + result.stderr.str()
    assert not list(suite.path.glob(".coverage.*")), "pytest-cov combined every data file"


def test_rank_lines_are_measured_serially_with_the_test_context(
    suite: pytest.Pytester, run_pytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One serial run measures the lines (as under xdist) and their dynamic contexts: each
    rank's line is tagged with the test that ran it."""
    monkeypatch.delenv("COVERAGE_CORE", raising=False)  # sys.monitoring has no dynamic contexts
    suite.makepyfile(test_hang=HANG)
    result = run_pytest(
        "--cov=pkg", "--cov-context=test", "--cov-report=json:cov.json", "--cov-report=term"
    )
    result.assert_outcomes(passed=4, failed=1)
    assert missed_lines(str(suite.path / "cov.json")) == MISSED_WITH_HANG
    assert "Couldn't use data file" not in result.stdout.str() + result.stderr.str()
    assert not list(suite.path.glob(".coverage.*")), "pytest-cov combined every data file"
    from coverage import CoverageData

    data = CoverageData(str(suite.path / ".coverage"))
    data.read()
    branches = next(f for f in data.measured_files() if f.endswith("branches.py"))
    contexts = data.contexts_by_lineno(branches)
    assert contexts[3] == ["test_ranks.py::test_ranks|run"]  # rank 0's branch
    assert contexts[4] == ["test_ranks.py::test_ranks|run"]  # rank 1's
    assert contexts[9] == ["test_ranks.py::test_wide|run"]
    assert contexts[18] == ["test_hang.py::test_hangs_on_rank_1|run"]  # before its peer hung


def test_coverage_run_with_its_own_configuration(suite: pytest.Pytester, tag: str) -> None:
    """`coverage run -m pytest` with parallel, concurrency and patch = subprocess (the xdist
    workers are measured by coverage's own hook, the ranks by the plugin)."""
    suite.path.joinpath(".coveragerc").write_text(
        "[run]\nsource = pkg\nparallel = true\nconcurrency = thread\npatch = subprocess\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    coverage = [sys.executable, "-m", "coverage"]
    pytest_args = ["-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "megatron"]
    run = subprocess.run(
        [*coverage, "run", *pytest_args], cwd=suite.path, env=env, capture_output=True, text=True
    )
    assert_no_processes_left(tag)
    assert run.returncode == 0, run.stdout + run.stderr
    subprocess.run([*coverage, "combine", "-q"], cwd=suite.path, check=True)
    subprocess.run([*coverage, "json", "-q", "-o", "cov.json"], cwd=suite.path, check=True)
    assert missed_lines(str(suite.path / "cov.json")) == MISSED


def test_torchrun_passthrough_reports_once(suite: pytest.Pytester, tag: str) -> None:
    """Rank 0 reports every rank's lines once; there is no zygote (the preload runs nowhere)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["-m", "pytest", "-p", "no:cacheprovider", "-k", "not wide and not preloaded"]
    command += ["--cov=pkg", "--cov-report=json:cov.json", "--cov-report=term"]
    run = subprocess.run(
        command, cwd=suite.path, env=env, capture_output=True, text=True, timeout=300
    )
    assert_no_processes_left(tag)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert output.count("coverage: platform") == 1, output
    assert "Couldn't use data file" not in output
    missed = missed_lines(str(suite.path / "cov.json"))
    assert missed["pkg/branches.py"] == [8, 9, 10, 14, 18]  # both ranks' branches ran
    assert not list(suite.path.glob(".xdist-megatron-torchrun-*"))


def test_no_coverage_import_when_not_measuring(suite: pytest.Pytester, run_pytest) -> None:
    """coverage is no dependency of the plugin: unmeasured, neither the driver nor a rank
    imports it."""
    suite.makepyfile(
        test_ranks="""
        import sys

        import pytest


        @pytest.mark.world_size(2)
        def test_rank():
            assert "coverage" not in sys.modules


        def test_driver():
            assert "coverage" not in sys.modules
        """
    )
    run_pytest("-p", "no:pytest_cov").assert_outcomes(passed=2)
