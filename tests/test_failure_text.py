"""A failure on a rank reads as it reads without the plugin: the same text as plain pytest for
each --tb style but for the `rank R` headings, and a headline that names what went wrong first."""

from __future__ import annotations

import re

import pytest

CONFTEST = """
import pytest

@pytest.fixture
def broken():
    raise ValueError("the fixture broke")
"""

SUITE = """
import pytest

pytestmark = pytest.mark.world_size(2)

def check(values):
    assert values == [1, 3]

def test_setup_error(broken):
    pass

def test_call_fails():
    check([1, 2])

class TestSetupMethod:
    def setup_method(self):
        raise RuntimeError("setup_method broke")

    def test_never_runs(self):
        pass
"""

HEADER = re.compile(r"^_{3,} (.+?) _{3,}$")  # a failure's or an error's title
RANK = re.compile(r"^-{3,} rank (\d+) -{3,}$")
SUMMARY = re.compile(r"^={3,} .* ={3,}$")
ADDRESS = re.compile(r" at 0x[0-9a-f]+")
TITLES = {
    "ERROR at setup of test_setup_error",
    "test_call_fails",
    "ERROR at setup of TestSetupMethod.test_never_runs",
}


def sections(output: str) -> dict[tuple[str, int | None], list[str]]:
    """The failure sections of a run's output: (title, rank) -> lines, rank None for a test
    that ran in the driver; the merged headline above the first rank is left out."""
    found: dict[tuple[str, int | None], list[str]] = {}
    current: list[str] | None = None
    title = ""
    for line in output.splitlines():
        if match := HEADER.match(line):
            title = match[1]
            current = found.setdefault((title, None), [])
        elif match := RANK.match(line):
            current = found.setdefault((title, int(match[1])), [])
        elif SUMMARY.match(line):
            current = None
        elif current is not None:
            current.append(ADDRESS.sub(" at 0x?", line))
    return found


@pytest.mark.parametrize("style", ["auto", "long", "short", "native"])
def test_a_rank_failure_reads_as_plain_pytest(pytester, run_pytest, style):
    """A setup error in a conftest fixture or a setup_method, and an assertion in a helper, show
    on each rank what plain pytest shows: the plugin's hook wrappers (and pluggy's calls into
    them) are not among the frames, in any style."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_text=SUITE)
    plain = run_pytest(f"--tb={style}", "-p", "no:xdist_megatron.plugin")
    plain.assert_outcomes(failed=1, errors=2, warnings=1)  # the marker is unknown without it
    on_ranks = run_pytest(f"--tb={style}", "--megatron-timeout", "30")
    on_ranks.assert_outcomes(failed=1, errors=2)
    expected = sections(plain.stdout.str())
    got = sections(on_ranks.stdout.str())
    assert {title for title, _ in expected} == TITLES
    for title in TITLES:
        assert expected[title, None], title
        assert got[title, 0] == got[title, 1] == expected[title, None], title
    failures = on_ranks.stdout.str().split("short test summary info")[0]
    assert "xdist_megatron" not in failures


EXIT_SUITE = """
import sys

import pytest
import torch
import torch.distributed as dist

@pytest.mark.world_size(2)
def test_rank_1_exits(rank):
    if rank == 1:
        sys.exit(3)
    dist.all_reduce(torch.ones(1))
"""


def test_the_headline_names_the_rank_that_failed_first(pytester, run_pytest):
    """`sys.exit(3)` on rank 1 while rank 0 waits in all_reduce: the failure leads with rank 1's
    SystemExit, rank 0's stack follows as its effect, and the run report says the gang retired
    because a rank exited (no timeout fired)."""
    pytester.makepyfile(test_exit=EXIT_SUITE)
    result = run_pytest("-rf", "--megatron-timeout", "60")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*_ test_rank_1_exits _*",
            "rank 1: SystemExit: 3 (ranks 0, 1 failed)",
            "*- rank 1 -*",
            ">           sys.exit(3)",
            "E           SystemExit: 3",
            "*- rank 0 -*",
            "rank 0 was still in all_reduce 2 s after rank 1 failed",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "gangs of 2: 1 started (1 first use); 1 retired (1 a rank exited)",
            "FAILED test_exit.py::test_rank_1_exits - rank 1: SystemExit: 3*",
        ]
    )
    result.stdout.no_fnmatch_line("*timeout)*")
