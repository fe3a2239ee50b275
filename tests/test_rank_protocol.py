"""End to end: what the rank-native protocol promises beyond the torchrun-style suite.

Healthy gangs are kept after ordinary failures; the default group a test destroys or re-creates
is restored for the next test; fixture scopes live on the gang, also when tests of another size
run in between, and end (their finalizers run) when the gang does.
"""

from __future__ import annotations

import json

import pytest

FACTS = """
import json, os

def record(name, **values):
    values.update(pid=os.getpid(), rank=int(os.environ.get("RANK", -1)))
    with open(os.path.join(os.environ["FACTS_DIR"], name + ".jsonl"), "a") as f:
        f.write(json.dumps(values) + "\\n")
"""

KEEP = """
import time
import pytest
import torch
import torch.distributed as dist
from facts import record

pytestmark = pytest.mark.world_size(2)

def test_before(rank):
    record("before")

def test_fails_on_rank_1_only(rank):
    record("failing")
    assert rank == 0

def test_destroys_the_default_group(rank):
    dist.destroy_process_group()

def test_shrinks_the_default_group_to_one_rank(rank):
    # as a test that re-creates the world with another size leaves it
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

@pytest.mark.parametrize("attempt", [1, 2])
def test_reinitialises_from_the_environment(rank, attempt):
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method="env://")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2

def test_after(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2 and dist.get_world_size() == 2
    record("after")
"""


@pytest.fixture
def facts_dir(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    folder = pytester.mkdir("facts")
    monkeypatch.setenv("FACTS_DIR", str(folder))
    pytester.makepyfile(facts=FACTS)

    def read(name: str) -> list[dict]:
        path = folder / f"{name}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    return read


def test_ordinary_failures_keep_the_gang_and_the_default_group_is_restored(
    pytester, run_pytest, facts_dir
):
    """A failure on one rank while the other finished is reported at once and keeps the gang;
    a test that destroys the default group, or initialises it again from the environment (in two
    tests: torchrun's agent-store contract, and its rendezvous keys dropped in between), or
    re-creates it with another size, leaves the next test a working group on the same ranks."""
    pytester.makepyfile(test_keep=KEEP)
    result = run_pytest("-rA", "--megatron-timeout", "60", "--durations=0", "-vv")
    result.assert_outcomes(passed=6, failed=1)
    result.stdout.fnmatch_lines_random(
        [
            "FAILED test_keep.py::test_fails_on_rank_1_only - rank 1: assert 1 == 0",
            "*GangWarning: rank 0: the test left the default process group destroyed; the gang "
            "restored it*",
            "*GangWarning: rank 0: the test left the default process group re-created with 1 "
            "ranks; the gang restored it*",
        ]
    )
    pids = {name: {f["pid"] for f in facts_dir(name)} for name in ("before", "failing", "after")}
    assert pids["before"] == pids["failing"] == pids["after"], "a failure retired the gang"
    call = next(line for line in result.outlines if "call" in line and "test_fails_on" in line)
    assert float(call.split("s ")[0]) < 1.0, call


SCOPES_CONFTEST = """
import pytest
import torch.distributed as dist
from facts import record

@pytest.fixture(scope="session")
def session_resource():
    record("session-setup")
    yield "session"
    record("session-teardown")

@pytest.fixture(scope="module")
def module_group():
    record("module-setup")
    group = dist.new_group([0, 1])
    yield group
    record("module-teardown")
"""

SCOPES_A = """
import pytest
import torch
import torch.distributed as dist
from facts import record

@pytest.mark.world_size(2)
def test_one(module_group, session_resource):
    t = torch.ones(1)
    dist.all_reduce(t, group=module_group)
    record("use", group=id(module_group))

@pytest.mark.world_size(1)
def test_in_between():
    pass

def test_unmarked_in_between():
    pass

@pytest.mark.world_size(2)
def test_two(module_group, session_resource):
    t = torch.ones(1)
    dist.all_reduce(t, group=module_group)
    record("use", group=id(module_group))
"""

SCOPES_B = """
import pytest
from facts import record

@pytest.mark.world_size(2)
def test_three(session_resource):
    record("use-b")
"""


@pytest.mark.parametrize("mode", [(), ("-n", "2", "--dist", "megatron")], ids=["serial", "xdist"])
def test_fixture_scopes_live_on_the_gang(pytester, run_pytest, facts_dir, mode):
    """A module fixture's group is set up once per rank and kept across tests of other sizes
    (serially, where the driver knows what that gang runs next); it ends at the module boundary,
    the session fixture when the gang ends, each with its finalizer run on every rank."""
    pytester.makeconftest(SCOPES_CONFTEST)
    pytester.makepyfile(test_a=SCOPES_A, test_b=SCOPES_B)
    run_pytest(*mode, "--megatron-timeout", "60").assert_outcomes(passed=5)
    uses = facts_dir("use")
    for rank in (0, 1):
        mine = [f for f in uses if f["rank"] == rank]
        assert len(mine) == 2 and len({f["pid"] for f in mine}) == 1
        if not mode:  # serially the driver knows test_two follows on that gang
            assert len({f["group"] for f in mine}) == 1, "the module fixture was set up twice"
    for scope in ("session", "module"):  # once per rank process, and ended there
        setups = [f["pid"] for f in facts_dir(f"{scope}-setup")]
        teardowns = [f["pid"] for f in facts_dir(f"{scope}-teardown")]
        assert sorted(setups) == sorted(teardowns), scope
        if not mode:
            assert len(setups) == len(set(setups)) == 2, scope


EDGES_PACKAGE_CONFTEST = """
import pytest
from facts import record

@pytest.fixture(scope="package")
def package_resource():
    record("package-setup")
    yield

@pytest.fixture(scope="module")
def driver_resource():
    yield
    raise RuntimeError("the driver's module fixture fails in teardown")
"""

EDGES_A = """
import time
import pytest
import torch.distributed as dist
from facts import record

@pytest.fixture
def slow_teardown():
    yield
    time.sleep(3)

@pytest.mark.world_size(4)
def test_group_of_two_ranks(rank, package_resource):
    dist.new_group([0, 1])  # registered on ranks 0 and 1 only

@pytest.mark.world_size(2)
def test_fails_then_tears_down_slowly(rank, slow_teardown, package_resource):
    record("slow", rank=rank)
    assert rank == 99

@pytest.mark.world_size(2)
def test_after_the_slow_teardown(rank, package_resource):
    record("after-slow", rank=rank)

def test_in_the_driver(driver_resource):
    pass

@pytest.mark.world_size(2)
def test_last_of_the_module_on_a_gang(rank):
    pass
"""

EDGES_B = """
import pytest
import torch
import torch.distributed as dist

@pytest.mark.world_size(4)
def test_next_module(rank, package_resource):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4
"""


def test_review_edges(pytester, run_pytest, facts_dir):
    """A group only some ranks hold does not stall the module boundary; a failing rank's slow
    teardown is not mistaken for a hang (the gang is kept); a package fixture lives across the
    package's modules; a driver fixture's teardown error fails the test that ends it."""
    pkg = pytester.mkpydir("pkg")
    (pkg / "conftest.py").write_text(EDGES_PACKAGE_CONFTEST)
    (pkg / "test_a.py").write_text(EDGES_A)
    (pkg / "test_b.py").write_text(EDGES_B)
    result = run_pytest("--megatron-timeout", "30", "-rA")
    result.assert_outcomes(passed=5, failed=1, errors=1)
    result.stdout.fnmatch_lines_random(
        [
            "FAILED pkg/test_a.py::test_fails_then_tears_down_slowly - rank 0: assert 0 ==*",
            "ERROR pkg/test_a.py::test_last_of_the_module_on_a_gang*",
        ]
    )
    assert "still running" not in result.stdout.str()
    slow = {f["pid"] for f in facts_dir("slow")}
    assert slow == {f["pid"] for f in facts_dir("after-slow")}, "a slow teardown retired the gang"
    setups = [f["pid"] for f in facts_dir("package-setup")]
    assert len(setups) == len(set(setups)) == 2 + 4, "a package fixture was set up twice on a rank"


MANY_GROUPS = """
import pytest
import torch.distributed as dist

pytestmark = pytest.mark.world_size(2)

@pytest.mark.parametrize("batch", range(4))
def test_leaves_fifty_groups(batch):
    for _ in range(50):
        dist.new_group([0, 1])

def test_groups_stay_bounded():
    registered = len(dist.distributed_c10d._world.pg_map) - 1
    assert 0 < registered <= 128 + 50, registered
"""


def test_groups_tests_leave_are_bounded_within_a_module(pytester, run_pytest):
    """The groups tests leave are destroyed at the module boundary, and within a module once
    more than 128 were made, on every rank alike (the destruction is collective)."""
    pytester.makepyfile(test_many=MANY_GROUPS)
    run_pytest("--megatron-timeout", "60").assert_outcomes(passed=5)


REBASE_CONFTEST = """
import os
import pytest

@pytest.fixture(scope="session")
def session_env():
    os.environ["XM_FROM_SESSION"] = "set by the session fixture"
    yield
"""

REBASE_A = """
import os
import pytest

pytestmark = pytest.mark.world_size(2)

def test_leaks():
    os.environ["XM_LEAKED"] = "left by a test"

def test_asks_for_the_session_fixture(session_env):
    pass
"""

REBASE_B = """
import os
import pytest

@pytest.mark.world_size(2)
def test_next_module_starts_from_the_session_fixtures_state():
    assert os.environ.get("XM_FROM_SESSION") == "set by the session fixture"
    assert "XM_LEAKED" not in os.environ
"""


def test_module_boundary_keeps_what_session_fixtures_set(pytester, run_pytest):
    """A session fixture's environment survives the module-boundary reset; what an earlier test
    of that module leaked does not, though the fixture was set up after it."""
    pytester.makeconftest(REBASE_CONFTEST)
    pytester.makepyfile(test_a=REBASE_A, test_b=REBASE_B)
    run_pytest("--megatron-timeout", "60").assert_outcomes(passed=3)


SELECTED_SUITE = """
import pytest

@pytest.mark.world_size(2)
def test_alpha(rank):
    pass

@pytest.mark.world_size(2)
@pytest.mark.slow
def test_beta(rank):
    pass

@pytest.mark.world_size(2)
def test_gamma(rank):
    pass
"""


@pytest.mark.parametrize(
    ("selection", "selected"),
    [
        (("-k", "test_alpha"), 1),
        (("-k", "alpha or gamma"), 2),
        (("-m", "slow"), 1),
        (("--deselect", "test_selected.py::test_beta"), 2),
    ],
    ids=["k-name", "k-expression", "m", "deselect"],
)
def test_the_drivers_selection_is_not_made_again_on_ranks(
    pytester, run_pytest, selection, selected
):
    """-k, -m and --deselect choose tests in the driver; a rank runs what it is sent (a rank
    that applied `-k test_alpha` to its own collection did not find test_alpha)."""
    pytester.makepyfile(test_selected=SELECTED_SUITE)
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    result = run_pytest("--megatron-timeout", "60", *selection)
    result.assert_outcomes(passed=selected, deselected=3 - selected)
