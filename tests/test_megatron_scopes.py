"""Megatron state across the scopes of a shared gang, end to end, serially and under xdist.

A class, module or session fixture (or `setup_class`) that sets up Megatron's parallel state or
process groups on a gang keeps them through the per-test cleanup until its scope ends there; a test
that leaves Megatron state behind and fails does not hand it to the next test of its module; a
replacement gang sets its fixtures up again. The generated tests record facts into $FACTS_DIR; the
outer tests read them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

MODES = pytest.mark.parametrize(
    "mode", [(), ("-n", "2", "--dist", "megatron")], ids=["serial", "xdist"]
)

FACTS = """
import json, os

def record(name, **values):
    values.update(
        pid=os.getpid(),
        rank=int(os.environ.get("RANK", -1)),
        worker=os.environ.get("PYTEST_XDIST_WORKER"),
    )
    with open(os.path.join(os.environ["FACTS_DIR"], name + ".jsonl"), "a") as f:
        f.write(json.dumps(values) + "\\n")
"""


@pytest.fixture
def facts_dir(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the generated tests record facts; their module `facts.record` writes there."""
    folder = pytester.mkdir("facts")
    monkeypatch.setenv("FACTS_DIR", str(folder))
    pytester.makepyfile(facts=FACTS)
    return folder


def read_facts(folder: Path, name: str) -> list[dict]:
    path = folder / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def pids_by_rank(facts: list[dict]) -> dict[int, set[int]]:
    found: dict[int, set[int]] = {}
    for fact in facts:
        found.setdefault(fact["rank"], set()).add(fact["pid"])
    return found


# The generated tests import megatron.core where they use it, not at the top of their modules:
# the driver (each xdist worker) then collects without importing it, and the ranks find it
# imported already, from the zygote's preload. That saves a megatron.core import (about 4 s of
# CPU) per driver per run.
PRELOAD_INI = """
[pytest]
megatron_preload =
    megatron.core.parallel_state
    megatron.core.num_microbatches_calculator
"""

TP_HELPER = """
import torch
import torch.distributed as dist
from facts import record

def use_tensor_parallel(name):
    from megatron.core import parallel_state as ps

    assert ps.model_parallel_is_initialized()
    group = ps.get_tensor_model_parallel_group()
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == 2
    record(name, group=dist.distributed_c10d._world.pg_names[group])
"""

MODULE_FIXTURE_SUITE = """
import pytest
from tp_helper import use_tensor_parallel

@pytest.fixture(scope="module")
def tensor_parallel():
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    yield
    ps.destroy_model_parallel()

@pytest.mark.world_size(2)
def test_first(tensor_parallel):
    use_tensor_parallel("module-a")

@pytest.mark.world_size(2)
def test_second(tensor_parallel):
    use_tensor_parallel("module-a")

@pytest.mark.world_size(2)
def test_third(tensor_parallel):
    use_tensor_parallel("module-a")
"""

SETUP_CLASS_SUITE = """
import pytest
from tp_helper import use_tensor_parallel

@pytest.mark.world_size(2)
class TestTensorParallel:
    @classmethod
    def setup_class(cls):
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=2)

    @classmethod
    def teardown_class(cls):
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()

    def test_one(self):
        use_tensor_parallel("class-b")

    def test_two(self):
        use_tensor_parallel("class-b")
"""

CLEAN_SUITE = """
import pytest
import torch.distributed as dist
from facts import record

@pytest.mark.world_size(2)
def test_starts_without_megatron():
    from megatron.core import parallel_state as ps

    record("clean-c")
    assert not ps.model_parallel_is_initialized()
    assert len(dist.distributed_c10d._world.pg_map) == 1, dist.distributed_c10d._world.pg_names
"""


@MODES
def test_megatron_state_of_a_wider_scope_survives_the_per_test_cleanup(
    pytester, run_pytest, facts_dir, mode
):
    """Megatron's parallel state set up by a module fixture or `setup_class` lives through the
    cleanup after each test until its scope ends, on the same gang, and is gone in the next
    module. Otherwise the per-test cleanup would destroy a layout suites build once per module
    (the second test would find Megatron uninitialised), or the next module would inherit it."""
    pytester.makeini(PRELOAD_INI)
    pytester.makepyfile(
        tp_helper=TP_HELPER,
        test_a_module_fixture=MODULE_FIXTURE_SUITE,
        test_b_setup_class=SETUP_CLASS_SUITE,
        test_c_clean=CLEAN_SUITE,
    )
    run_pytest(*mode, "--megatron-timeout", "60").assert_outcomes(passed=6)
    module_a, class_b = read_facts(facts_dir, "module-a"), read_facts(facts_dir, "class-b")
    clean_c = read_facts(facts_dir, "clean-c")
    assert len(module_a) == 3 * 2 and len(class_b) == 2 * 2 and len(clean_c) == 2
    for name, facts in (("the module fixture", module_a), ("setup_class", class_b)):
        for pid in {fact["pid"] for fact in facts}:  # group names count per process
            groups = {fact["group"] for fact in facts if fact["pid"] == pid}
            assert len(groups) == 1, f"{name} was set up again on rank process {pid}: {groups}"
    # One gang per driver and world size: serially one for the three modules; under xdist one
    # per worker (each worker is a driver; the scheduler chooses which modules each one runs).
    gangs = {}
    for fact in module_a + class_b + clean_c:
        gangs.setdefault((fact["worker"], fact["rank"]), set()).add(fact["pid"])
    assert all(len(pids) == 1 for pids in gangs.values()), f"a driver started two gangs: {gangs}"
    if not mode:
        assert sorted(gangs) == [(None, 0), (None, 1)], gangs


MICROBATCH_SUITE = """
import pytest
import torch.distributed as dist
from facts import record

@pytest.mark.world_size(2)
def test_leaves_megatron_state_and_fails(rank):
    from megatron.core import num_microbatches_calculator as microbatches
    from megatron.core import parallel_state as ps

    record("leaves")
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    ps.set_tensor_model_parallel_rank(5)
    microbatches.init_num_microbatches_calculator(
        rank=rank,
        rampup_batch_size=None,
        global_batch_size=8,
        micro_batch_size=2,
        data_parallel_size=1,
    )
    assert microbatches.get_num_microbatches() == 4
    assert ps.get_tensor_model_parallel_rank() == 5
    assert False, "fails on purpose, Megatron state left behind"

@pytest.mark.world_size(2)
def test_next_test_finds_megatron_reset():
    from megatron.core import num_microbatches_calculator as microbatches
    from megatron.core import parallel_state as ps

    record("next")
    assert not ps.model_parallel_is_initialized()
    assert microbatches._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    assert ps.get_tensor_model_parallel_rank() == dist.get_rank()
    ps.destroy_model_parallel()
"""


def test_megatron_state_a_failed_test_left_is_reset_within_the_module(
    pytester, run_pytest, facts_dir
):
    """Megatron state a test sets up in its body (parallel state, a rank override, the
    microbatch calculator) is gone for the next test of the same module, on the same gang, even
    though the test failed. Otherwise every later test of the module would fail on the spoilt
    state (initialize_model_parallel or init_num_microbatches_calculator refusing to run twice,
    a wrong tensor-parallel rank), turning one failure into many. Serially only: the reset runs
    on the ranks after each test, whatever the next item is (no scope end, which xdist's
    held-back item decides, is involved), so an xdist worker's driver takes the same path."""
    pytester.makeini(PRELOAD_INI)
    pytester.makepyfile(test_microbatches=MICROBATCH_SUITE)
    result = run_pytest("--megatron-timeout", "60")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["rank 0: AssertionError: fails on purpose*(ranks 0, 1 failed)"])
    leaves, after = read_facts(facts_dir, "leaves"), read_facts(facts_dir, "next")
    assert pids_by_rank(leaves) == pids_by_rank(after), "an ordinary failure replaced the gang"
    assert sorted(pids_by_rank(after)) == [0, 1]


REPLACED_CONFTEST = """
import os
import pytest
import torch.distributed as dist

def note_setup(scope):
    with open(os.path.join(os.environ["FACTS_DIR"], scope + ".txt"), "a") as f:
        f.write(f"setup {os.getpid()}\\n")

@pytest.fixture(scope="session")
def session_group():
    note_setup("session")
    yield dist.new_group([0, 1])

@pytest.fixture(scope="module")
def module_group():
    note_setup("module")
    yield dist.new_group([0, 1])
"""

REPLACED_SUITE = """
import os
import pytest
import torch
import torch.distributed as dist
from facts import record

def all_reduce_on(group):
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == 2

@pytest.mark.world_size(2)
def test_uses_the_fixtures(session_group, module_group):
    all_reduce_on(module_group)
    record("first")

@pytest.mark.world_size(2)
def test_rank_1_exits(rank):
    if rank == 1:
        os._exit(3)

@pytest.mark.world_size(2)
def test_uses_the_fixtures_on_a_new_gang(session_group, module_group):
    all_reduce_on(module_group)
    all_reduce_on(session_group)
    record("third")
"""


def setup_pids(folder: Path, scope: str) -> list[int]:
    lines = (folder / f"{scope}.txt").read_text().splitlines()
    assert all(line.startswith("setup ") for line in lines), lines
    return [int(line.split()[1]) for line in lines]


@MODES
def test_fixtures_are_set_up_again_on_a_replacement_gang(pytester, run_pytest, facts_dir, mode):
    """A session or module fixture set up on a gang that died is set up again on its
    replacement, on every new rank. Otherwise the next test would get the old gang's process
    group handles (or none), and hang or crash in its first collective."""
    pytester.makeconftest(REPLACED_CONFTEST)
    pytester.makepyfile(test_replaced=REPLACED_SUITE)
    result = run_pytest(*mode, "--megatron-timeout", "60", "-rA")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines_random(
        [
            "FAILED test_replaced.py::test_rank_1_exits*rank 1 exited with code 3*",
            "PASSED test_replaced.py::test_uses_the_fixtures_on_a_new_gang*",
        ]
    )
    for scope in ("session", "module"):
        pids = setup_pids(facts_dir, scope)
        assert len(pids) == len(set(pids)) == 4, f"{scope}: {pids}"
    first, third = read_facts(facts_dir, "first"), read_facts(facts_dir, "third")
    assert len(first) == len(third) == 2
    assert not {f["pid"] for f in first} & {f["pid"] for f in third}, "test 3 ran on test 1's gang"
