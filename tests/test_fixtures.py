"""End to end: fixtures of tests that run on ranks (resolved there), xunit methods, and the
explicit `gang` style (body and fixtures in the driver)."""

from __future__ import annotations

import os
import re

import pytest

# Fixtures log "name:rank:pid:token" to resolved.log each time pytest resolves them.
CONFTEST = """
import os
import threading
import uuid

import pytest

def resolve(name):
    value = f"{name}:{os.environ.get('RANK')}:{os.getpid()}:{uuid.uuid4().hex}"
    with open(os.path.join(os.path.dirname(__file__), "resolved.log"), "a") as f:
        f.write(value + "\\n")
    return value

@pytest.fixture(scope="session")
def session_value():
    return resolve("session")

@pytest.fixture(scope="module")
def module_value():
    return resolve("module")

@pytest.fixture
def function_value():
    return resolve("function")

@pytest.fixture(params=["p1", "p2"])
def param_value(request):
    return resolve(request.param)

@pytest.fixture
def indirect_value(request):
    return resolve(f"indirect-{request.param}")

@pytest.fixture
def a_lambda():
    return lambda: 1

@pytest.fixture
def a_lock():
    return threading.Lock()
"""

# Ranks log "rank value" to received.log for each fixture value they get.
RANK_SUITE = """
import os

import pytest
import torch
from helper_mod import triple

pytestmark = pytest.mark.world_size(2)
HERE = os.path.dirname(__file__)

def receive(rank, *values):
    with open(os.path.join(HERE, "received.log"), "a") as f:
        for value in values:
            assert value.split(":")[1:3] == [str(rank), str(os.getpid())], "resolved here"
            f.write(f"{rank} {value}\\n")

class Box:
    def __init__(self, n):
        self.n = n

@pytest.fixture
def box():
    return Box(7)

def test_native(rank, world_size, local_rank, device):
    assert rank == int(os.environ["RANK"]) and world_size == 2
    assert local_rank == rank and device == torch.device("cpu")

def test_scopes(rank, session_value, module_value, function_value, tmp_path):
    assert tmp_path.is_dir() and not list(tmp_path.iterdir())
    (tmp_path / "mine").write_text(str(rank))
    receive(rank, session_value, module_value, function_value)

def test_params(rank, session_value, module_value, function_value, param_value):
    receive(rank, session_value, module_value, function_value, param_value)

@pytest.mark.parametrize("indirect_value", ["i1", "i2"], indirect=True)
def test_indirect(rank, indirect_value):
    receive(rank, indirect_value)

def test_module_class_and_sibling_module(box, rank):
    assert type(box) is Box and box.n == 7
    assert triple(rank + 1) == 3 * (rank + 1)

def test_lambda(a_lambda):
    pass

def test_lock(a_lock):
    pass

def log_xunit(event):
    with open(os.path.join(HERE, f"xunit-{os.environ.get('RANK')}.log"), "a") as f:
        f.write(f"{event} {os.getpid()}\\n")

class TestXunit:
    @classmethod
    def setup_class(cls):
        log_xunit("setup_class")
        cls.class_pid = os.getpid()

    @classmethod
    def teardown_class(cls):
        log_xunit("teardown_class")

    def setup_method(self, method):
        log_xunit(f"setup_method {method.__name__}")
        self.method_pid = os.getpid()

    def teardown_method(self, method):
        log_xunit(f"teardown_method {method.__name__}")

    def test_one(self):
        log_xunit("test_one")
        assert self.class_pid == self.method_pid == os.getpid()

    def test_two(self):
        log_xunit("test_two")
        assert self.class_pid == self.method_pid == os.getpid()
"""

GANG_SUITE = """
import functools
import os

import pytest
import torch
import xdist_megatron
from xdist_megatron import RankInfo

pytestmark = pytest.mark.world_size(2)

def where(offset, *, scale):
    return xdist_megatron.rank_info(), os.getpid(), scale * offset

def fail_on_rank_one():
    if xdist_megatron.rank_info().rank == 1:
        raise ValueError("rank one refuses")

def test_run_returns_rank_order(gang, session_value):
    assert session_value.split(":")[2] == str(os.getpid()), "the body runs in the driver"
    infos, pids, values = zip(*gang.run(where, 5, scale=2))
    cpu = torch.device("cpu")
    assert list(infos) == [RankInfo(0, 2, 0, cpu), RankInfo(1, 2, 1, cpu)]
    assert infos[1].rank == 1 and infos[1].world_size == 2 and infos[1].device == cpu
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert values == (10, 10)
    assert gang.run(functools.partial(where, 1, scale=3))[1][2] == 3

@pytest.mark.world_size(3)
def test_run_on_three(gang):
    assert [info.rank for info in gang.run(xdist_megatron.rank_info)] == [0, 1, 2]

def fail_on_rank_one_while_rank_zero_waits():
    if xdist_megatron.rank_info().rank == 1:
        raise ValueError("rank one leaves rank zero waiting")
    torch.distributed.barrier()

def destroy_the_default_group():
    torch.distributed.destroy_process_group()

def size_after_a_barrier():
    torch.distributed.barrier()
    return torch.distributed.get_world_size()

RANK_PIDS = []

def test_failing_function(gang):
    RANK_PIDS[:] = gang.run(os.getpid)
    gang.run(fail_on_rank_one)

def test_gang_again_after_failure(gang):
    # Every rank finished: an ordinary failure keeps the gang, as under torchrun.
    assert [info.rank for info in gang.run(xdist_megatron.rank_info)] == [0, 1]
    assert gang.run(os.getpid) == RANK_PIDS

def test_failure_that_strands_a_peer(gang):
    gang.run(fail_on_rank_one_while_rank_zero_waits)

def test_a_fresh_gang_after_the_stranded_peer(gang):
    assert not set(gang.run(os.getpid)) & set(RANK_PIDS)

def test_destroys_the_default_group(gang):
    gang.run(destroy_the_default_group)

def test_the_default_group_is_back(gang):
    assert gang.run(size_after_a_barrier) == [2, 2]
"""


def lines(pytester: pytest.Pytester, name: str) -> list[str]:
    return (pytester.path / name).read_text().splitlines()


def assert_resolved_once_per_scope_on_each_rank(pytester: pytest.Pytester) -> None:
    """Each rank made each fixture value once per its scope, in its own process, and its tests
    got those values."""
    resolved = [value.split(":") for value in lines(pytester, "resolved.log")]
    for rank in ("0", "1"):
        mine = [value for value in resolved if value[1] == rank]
        assert sorted(name for name, *_ in mine) == sorted(
            ["session", "module", "function", "function", "function", "p1", "p2"]
            + ["indirect-i1", "indirect-i2"]
        )
        assert len({pid for _, _, pid, _ in mine}) == 1, "one process per rank"
    assert len({pid for _, _, pid, _ in resolved}) == 2
    received = set(lines(pytester, "received.log"))
    assert received == {f"{rank} {':'.join(value)}" for value in resolved for rank in value[1]}


def assert_xunit_ran_on_each_rank(pytester: pytest.Pytester) -> None:
    """setup/teardown_class wrapped the class's tests and setup/teardown_method each test."""
    assert not (pytester.path / "xunit-None.log").exists(), "xunit methods ran in the driver"
    pids = set()
    for rank in (0, 1):
        events = [line.rsplit(" ", 1) for line in lines(pytester, f"xunit-{rank}.log")]
        assert [event for event, _ in events] == [
            "setup_class",
            "setup_method test_one",
            "test_one",
            "teardown_method test_one",
            "setup_method test_two",
            "test_two",
            "teardown_method test_two",
            "teardown_class",
        ]
        assert len({pid for _, pid in events}) == 1, "one rank process ran the whole class"
        pids |= {pid for _, pid in events}
    assert len(pids) == 2


def test_fixtures_and_xunit_methods_on_ranks(pytester, run_pytest):
    """Every fixture is resolved on each rank, once per scope, whatever its value (a lambda, a
    lock); rank-native fixtures, module classes, sibling modules and xunit methods work there."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_ranks=RANK_SUITE, helper_mod="def triple(x):\n    return 3 * x\n")
    result = run_pytest("-rA", "--megatron-timeout", "20")
    result.assert_outcomes(passed=11)
    assert_resolved_once_per_scope_on_each_rank(pytester)
    assert_xunit_ran_on_each_rank(pytester)


def test_gang_fixture(pytester, run_pytest):
    """gang.run calls a function on every rank from a driver-side body; failures name the rank.
    A function that raises where every rank finished keeps the gang; one that leaves a peer
    waiting retires it; a default group it destroyed is back for the next test."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_gang=GANG_SUITE,
        test_unmarked="def test_gang_without_marker(gang):\n    pass\n",
    )
    result = run_pytest("--megatron-timeout", "20")
    result.assert_outcomes(passed=6, failed=2, errors=1)
    result.stdout.fnmatch_lines_random(
        [
            "E *GangError: fail_on_rank_one failed on rank(s) 1: ValueError: rank one refuses",
            "E *GangError: fail_on_rank_one_while_rank_zero_waits failed on rank(s) 0, 1: "
            "ValueError: rank one leaves rank zero waiting",
            "*rank 0 was still in barrier 2 s after rank 1 failed*",
            "the gang fixture needs @pytest.mark.world_size(N) on the test",
        ]
    )


SLOW_START_SUITE = """
import pytest
import xdist_megatron


@pytest.mark.world_size(2)
@pytest.mark.timeout(3)
def test_runs_after_a_slow_start(gang):
    assert [info.rank for info in gang.run(xdist_megatron.rank_info)] == [0, 1]
"""


def test_the_gang_starts_in_the_fixtures_setup(pytester, run_pytest, tmp_path_factory, monkeypatch):
    """The `gang` fixture waits for the zygote's imports and starts the gang in its setup, as a
    worker pool is spawned in the fixture that makes it: a start-up (here a preload that takes
    10 s) does not count against a timeout of the call alone (pytest-timeout's
    `timeout_func_only`, as Model-Optimizer sets it). It did while the first `gang.run` started
    the gang: Model-Optimizer's first pool test failed on its 120 s timeout that way."""
    libraries = tmp_path_factory.mktemp("libraries")
    (libraries / "slow_lib.py").write_text("import time\ntime.sleep(10)\n")
    monkeypatch.setenv("PYTHONPATH", str(libraries), prepend=os.pathsep)
    pytester.makeini("[pytest]\nmegatron_preload = slow_lib\ntimeout_func_only = true\n")
    pytester.makepyfile(test_slow_start=SLOW_START_SUITE)
    result = run_pytest("-p", "timeout", "--durations", "0", "-vv")
    result.assert_outcomes(passed=1)
    seconds = {
        phase: float(value)
        for value, phase in re.findall(r"([\d.]+)s (setup|call) +test_slow", result.stdout.str())
    }
    assert seconds["setup"] > 4, seconds


def test_a_gang_that_cannot_start_fails_the_fixtures_setup(pytester, run_pytest):
    """No gang (NCCL asked of a torch without it): the `gang` test errors in its setup, saying
    why without the plugin's frames, as a rank-style test fails in its call."""
    import torch.distributed

    if torch.distributed.is_nccl_available():
        pytest.skip("this torch has NCCL: the gang would start")
    pytester.makepyfile(
        test_no_gang="""
import pytest
import xdist_megatron

@pytest.mark.world_size(2)
def test_explicit(gang):
    gang.run(xdist_megatron.rank_info)

@pytest.mark.world_size(2)
def test_native(rank):
    pass
"""
    )
    result = run_pytest("--megatron-backend", "nccl", "--megatron-timeout", "60")
    result.assert_outcomes(errors=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at setup of test_explicit*", "gang of 2 failed to start: rank * exited with *"]
    )


SPAWNING_FUNCTION = """
import multiprocessing
import pytest

def queue_through_a_spawned_manager():
    with multiprocessing.get_context("spawn").Manager() as manager:
        queue = manager.Queue()
        queue.put(7)
        return queue.get()

@pytest.mark.world_size(2)
def test_a_function_starts_a_spawned_manager(gang):
    assert gang.run(queue_through_a_spawned_manager) == [7, 7]
"""


def test_a_gang_function_can_spawn_children(pytester, run_pytest):
    """Megatron's checkpoint save starts a `spawn` Manager on each rank (its results queue). In a
    `gang.run` function its process died at start (EOFError): the rank had the driver's main
    module under the name `__mp_main__`, which the child could not import. Seen on an H100 in
    Model-Optimizer's suite: 19 checkpoint tests failed serially only."""
    pytester.makepyfile(test_spawning=SPAWNING_FUNCTION)
    run_pytest("--megatron-timeout", "60").assert_outcomes(passed=1)
