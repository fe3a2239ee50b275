"""End-to-end lifecycle of gangs: reuse, replacement after a death, a failure or a timeout.

Each test runs pytest in a subprocess on a generated suite; the generated tests record facts
(pids, ranks) into $FACTS_DIR, which the outer test reads back. `run_pytest` then proves that no
rank or zygote is left.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

FACTS_MODULE = """
import json, os

def record(name, **values):
    values.update(pid=os.getpid(), ppid=os.getppid())
    with open(os.path.join(os.environ["FACTS_DIR"], name + ".jsonl"), "a") as f:
        f.write(json.dumps(values) + "\\n")
"""


class Facts:
    """Reads back what the generated tests recorded: one JSON object per line, per name."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, name: str) -> list[dict]:
        path = self.folder / f"{name}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    def pids(self, name: str) -> set[int]:
        return {fact["pid"] for fact in self(name)}


@pytest.fixture
def facts(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Facts:
    """A folder the generated tests write to, and their `facts.record` helper."""
    folder = pytester.mkdir("facts")
    monkeypatch.setenv("FACTS_DIR", str(folder))
    pytester.makepyfile(facts=FACTS_MODULE)
    return Facts(folder)


def call_durations(result: pytest.RunResult) -> dict[str, float]:
    """Seconds of the call phase per test name, from `--durations=0 --durations-min=0`."""
    found = {}
    for line in result.outlines:
        match = re.match(r"\s*([\d.]+)s call\s+\S+::(\S+)$", line)
        if match:
            found[match.group(2)] = float(match.group(1))
    return found


def line_of(path: Path, marker: str) -> int:
    """1-based line number of the line holding `marker` in a generated module."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if marker in line)


DURATIONS = ("--durations=0", "--durations-min=0")

DEATHS = """
import os, signal, time
import pytest
import torch.distributed as dist
from facts import record

@pytest.mark.world_size(2)
def test_warm(rank):
    record("warm", rank=rank)

@pytest.mark.world_size(2)
def test_exit(rank):
    if rank == 1:
        os._exit(3)
    dist.barrier()

@pytest.mark.world_size(2)
def test_after_exit(rank):
    record("after_exit", rank=rank)

@pytest.mark.world_size(2)
def test_exit_while_peer_sleeps(rank):
    if rank == 1:
        os._exit(3)
    time.sleep(60)

@pytest.mark.world_size(2)
def test_sigkill(rank):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()

@pytest.mark.world_size(2)
def test_after_sigkill(rank):
    record("after_sigkill", rank=rank)
"""


@pytest.mark.alone
def test_dead_rank_is_reported_fast_and_replaced(pytester, run_pytest, facts):
    """A rank that exits or is killed fails its test within ~2 s with its exit code or signal,
    also when its peer is not in a collective that would notice; the next test of that size
    runs on a fresh gang."""
    pytester.makepyfile(test_deaths=DEATHS)
    result = run_pytest("--megatron-timeout", "20", "-vv", *DURATIONS)
    result.assert_outcomes(passed=3, failed=3)
    result.stdout.fnmatch_lines(
        [
            "*_ test_exit _*",
            "rank 1 exited with code 3 (ranks 0, 1 failed)",
            "*- rank 1 -*",
            "rank 1 exited with code 3",
            "*- rank 0 -*",
            "*_ test_exit_while_peer_sleeps _*",
            "*- rank 1 -*",
            "rank 1 exited with code 3",
            "*- rank 0 -*",
            "rank 0 was still in test_exit_while_peer_sleeps 2 s after rank 1 failed",
            "Python stack of rank 0 (most recent call last):",
            "*_ test_sigkill _*",
            "*- rank 1 -*",
            "rank 1 was killed by signal SIGKILL (9)",
            "*::test_exit - rank 1 exited with code 3 (ranks 0, 1 failed)",
            "*::test_exit_while_peer_sleeps - rank 1 exited with code 3 (ranks 0, 1 failed)",
        ]
    )
    durations = call_durations(result)
    assert durations["test_exit"] < 3.0, durations
    assert durations["test_sigkill"] < 3.0, durations
    # Noticing the death (<= 2 s) + the grace its peer gets (2 s) + collecting its stack.
    assert durations["test_exit_while_peer_sleeps"] < 6.0, durations
    gangs = [facts.pids(name) for name in ("warm", "after_exit", "after_sigkill")]
    assert [len(pids) for pids in gangs] == [2, 2, 2]
    assert len(set.union(*gangs)) == 6, f"a gang was reused after a death: {gangs}"


HANGS = """
import time
import pytest
import torch.distributed as dist
from facts import record

@pytest.mark.world_size(2)
def test_warm(rank):
    pass

@pytest.mark.world_size(2)
def test_hang(rank):
    record("hang", rank=rank)
    if rank == 1:
        time.sleep(600)  # rank 1 hangs here
    dist.barrier()  # rank 0 waits here

@pytest.mark.world_size(2)
@pytest.mark.timeout(60)
def test_after_hang(rank):
    record("after_hang", rank=rank)

@pytest.mark.world_size(2)
@pytest.mark.timeout(60)
def test_raise_on_rank0(rank):
    if rank == 0:
        raise ValueError("boom on rank 0")
    dist.barrier()

@pytest.mark.world_size(2)
@pytest.mark.timeout(60)
def test_after_raise(rank):
    record("after_raise", rank=rank)
"""


@pytest.mark.alone
def test_hang_times_out_with_every_stack_and_raise_fails_fast(pytester, run_pytest, facts):
    """--megatron-timeout dumps each rank's stack at the hanging line, then kills the gang; an
    error on one rank while the other waits in a collective fails well before the timeout.
    Either way the next test passes on a fresh gang."""
    path = pytester.makepyfile(test_hangs=HANGS)
    result = run_pytest("--megatron-timeout", "3", "-vv", *DURATIONS)
    result.assert_outcomes(passed=3, failed=2)
    sleeping, waiting = line_of(path, "rank 1 hangs here"), line_of(path, "rank 0 waits here")
    result.stdout.fnmatch_lines(
        [
            "*_ test_hang _*",
            "rank 0 timed out after 3 s in barrier (ranks 0, 1 failed)",
            "*- rank 0 -*",
            "rank 0 timed out after 3 s in barrier",
            "Python stack of rank 0 (most recent call last):",
            "  ... * frame(s) of pytest, pluggy and xdist-megatron ...",
            f'  File "{path}", line {waiting}, in test_hang  <-- the test',
            "    dist.barrier()  # rank 0 waits here",
            '  File "*distributed_c10d.py", line *, in barrier',
            "*- rank 1 -*",
            "rank 1 timed out after 3 s in test_hang",
            "Python stack of rank 1 (most recent call last):",
            f'  File "{path}", line {sleeping}, in test_hang  <-- the test',
            "    time.sleep(600)  # rank 1 hangs here",
            "*_ test_raise_on_rank0 _*",
            "*- rank 0 -*",
            "E * ValueError: boom on rank 0",
            "*- rank 1 -*",
            "Python stack of rank 1 (most recent call last):",
            "*FAILED test_hangs.py::test_hang - rank 0 timed out after 3 s in barrier (ranks 0, 1*",
            "*FAILED test_hangs.py::test_raise_on_rank0 - rank 0: ValueError: boom on rank 0*",
        ]
    )
    durations = call_durations(result)
    assert 3.0 <= durations["test_hang"] < 8.0, durations
    assert durations["test_raise_on_rank0"] < 6.0, durations
    gangs = [facts.pids(name) for name in ("hang", "after_hang", "after_raise")]
    assert [len(pids) for pids in gangs] == [2, 2, 2]
    assert len(set.union(*gangs)) == 6, f"a gang was reused after a failure: {gangs}"


REUSE = """
import os
import pytest
from facts import record

def zygote_parent(zygote):
    with open(f"/proc/{zygote}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])

def test_driver():
    record("driver")

@pytest.mark.world_size(1, 2, 4)
def test_first(rank, world_size):
    record("ranks", rank=rank, size=world_size, zygote_parent=zygote_parent(os.getppid()))

@pytest.mark.world_size(4, 2, 1)
def test_second(rank, world_size):
    record("ranks", rank=rank, size=world_size, zygote_parent=zygote_parent(os.getppid()))
"""


def test_one_gang_per_world_size_for_the_session(pytester, run_pytest, facts):
    """Every test of a size, in every module, runs on the same ranks; sizes never share ranks;
    all ranks are children of one zygote, which is the driver's child and not the driver."""
    pytester.makepyfile(test_m1=REUSE, test_m2=REUSE)
    run_pytest().assert_outcomes(passed=14)
    [driver] = facts.pids("driver")
    ranks = facts("ranks")
    assert len(ranks) == 4 * (1 + 2 + 4)
    for size in (1, 2, 4):
        members = {(f["rank"], f["pid"]) for f in ranks if f["size"] == size}
        assert sorted(rank for rank, _ in members) == list(range(size)), f"ws{size}: {members}"
    assert len({f["pid"] for f in ranks}) == 7, "gangs of different sizes share a process"
    [zygote] = {f["ppid"] for f in ranks}
    assert zygote != driver
    assert {f["zygote_parent"] for f in ranks} == {driver}


SCOPED = """
import pytest
from facts import record

@pytest.mark.world_size(2)
def test_first(rank):
    record(__name__, rank=rank)

@pytest.mark.world_size(2)
def test_second(rank):
    record(__name__, rank=rank)
"""


def test_module_scope_gives_each_module_a_fresh_gang(pytester, run_pytest, facts):
    """megatron_gang_scope = module: one gang per module, shared by that module's tests."""
    pytester.makeini("[pytest]\nmegatron_gang_scope = module\n")
    pytester.makepyfile(test_s1=SCOPED, test_s2=SCOPED)
    run_pytest().assert_outcomes(passed=4)
    assert len(facts("test_s1")) == len(facts("test_s2")) == 4
    first_pids, second_pids = facts.pids("test_s1"), facts.pids("test_s2")
    assert len(first_pids) == len(second_pids) == 2, "tests of one module used different gangs"
    assert not first_pids & second_pids, "the second module reused the first module's gang"
