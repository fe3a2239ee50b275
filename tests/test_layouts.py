"""@pytest.mark.megatron layouts kept between tests, and the torchrun passthrough."""

from __future__ import annotations

import json

import pytest
from conftest import assert_no_processes_left, torchrun_pytest

pytest.importorskip("megatron.core")

LAYOUT_SUITE = """
import json, os
import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps

def record(name):
    group = ps.get_tensor_model_parallel_group()
    facts = {"test": name, "rank": dist.get_rank(), "pid": os.getpid(),
             "tp_group": dist.distributed_c10d._world.pg_names[group],
             "tp": ps.get_tensor_model_parallel_world_size(),
             "pp": ps.get_pipeline_model_parallel_world_size()}
    with open(os.path.join(os.environ["FACTS"], f"{name}-{dist.get_rank()}.json"), "w") as f:
        json.dump(facts, f)

@pytest.mark.world_size(2)
@pytest.mark.megatron(tp=2)
@pytest.mark.parametrize("i", range(3))
def test_tp2(i):
    record(f"tp2-{i}")

@pytest.mark.world_size(2)
def test_without_layout():
    assert not ps.model_parallel_is_initialized()

@pytest.mark.world_size(2)
@pytest.mark.megatron(pp=2)
def test_pp2():
    record("pp2")

@pytest.mark.world_size(2)
@pytest.mark.megatron(tp=2)
def test_tp2_again():
    record("tp2-again")
"""

NEXT_MODULE = """
import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps

@pytest.mark.world_size(2)
def test_layout_gone_at_the_module_boundary():
    assert not ps.model_parallel_is_initialized()
    assert len(dist.distributed_c10d._world.pg_map) == 1
"""


def _facts(folder) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


FAILING_LAYOUT_SUITE = (
    LAYOUT_SUITE.split("@pytest.mark.world_size")[0]
    + """
@pytest.mark.world_size(2)
@pytest.mark.megatron(tp=2)
def test_spoils_the_layout_then_fails_on_rank_1():
    record("spoilt")
    ps.set_tensor_model_parallel_rank(5)  # an override a passing test would have undone
    assert dist.get_rank() == 0

@pytest.mark.world_size(2)
@pytest.mark.megatron(tp=2)
def test_the_next_test_of_the_layout_gets_a_fresh_one():
    record("next")
    assert ps.get_tensor_model_parallel_rank() == dist.get_rank()
"""
)


def assert_rebuilt_after_the_failure(facts: dict[str, dict]) -> None:
    for rank in (0, 1):
        spoilt, after = facts[f"spoilt-{rank}"], facts[f"next-{rank}"]
        assert after["tp_group"] != spoilt["tp_group"], "the failed test's layout was kept"
        assert after["pid"] == spoilt["pid"], "an ordinary failure keeps the gang"


def test_layout_is_kept_for_tests_of_the_same_layout_and_rebuilt_after_a_failure(
    pytester, run_pytest, tmp_path, monkeypatch
):
    """Consecutive tests of one layout share its process groups; another layout, a test without
    one and the next module each get the state they ask for. A test that fails, here on one rank
    only, may leave its layout half-changed: the next test of that layout (test_c_fails, a module
    of its own) gets it built again, on every rank alike (or the ranks' group creations would
    not meet), on the same gang. The ranks agree through the driver's store, as they do in an
    xdist worker (a driver too); under torchrun, through the default group's (next test)."""
    monkeypatch.setenv("FACTS", str(tmp_path))
    pytester.makepyfile(
        test_a_layouts=LAYOUT_SUITE, test_b_next=NEXT_MODULE, test_c_fails=FAILING_LAYOUT_SUITE
    )
    run_pytest("--megatron-timeout", "60").assert_outcomes(passed=8, failed=1)
    facts = _facts(tmp_path)
    for rank in (0, 1):
        kept = {facts[f"tp2-{i}-{rank}"]["tp_group"] for i in range(3)}
        assert len(kept) == 1, "one tp=2 initialisation serves the three tests"
        assert facts[f"pp2-{rank}"]["pp"] == 2 and facts[f"pp2-{rank}"]["tp"] == 1
        assert facts[f"tp2-again-{rank}"]["tp_group"] not in kept, "a layout change rebuilds"
        assert facts[f"tp2-again-{rank}"]["pid"] == facts[f"tp2-0-{rank}"]["pid"]
    assert_rebuilt_after_the_failure(facts)


def test_a_failed_test_does_not_hand_its_layout_on_under_torchrun(
    pytester, tmp_path, monkeypatch, tag
):
    """As above, in the torchrun passthrough: the ranks agree through the default group's store
    (only while a layout is kept)."""
    monkeypatch.setenv("FACTS", str(tmp_path))
    pytester.makepyfile(test_fails=FAILING_LAYOUT_SUITE)
    output = torchrun_pytest(pytester, expect_rc=1)
    assert "2 passed" in output and "1 failed, 1 passed" in output, output
    assert_no_processes_left(tag)
    assert_rebuilt_after_the_failure(_facts(tmp_path))


BUILD_FAILS_ON_RANK_1 = """
import os
from megatron.core import parallel_state as ps

real_initialize = ps.initialize_model_parallel
calls = []

def initialize_then_fail_once_on_rank_1(*args, **kwargs):
    # as a build that fails late on one rank (out of memory, a group's backend): its peer's
    # build succeeded
    real_initialize(*args, **kwargs)
    calls.append(1)
    if len(calls) == 1 and os.environ["RANK"] == "1":
        raise RuntimeError("the layout's build failed on rank 1")

ps.initialize_model_parallel = initialize_then_fail_once_on_rank_1
"""

BUILT_TWICE = """
import pytest
from megatron.core import parallel_state as ps

@pytest.mark.world_size(2)
@pytest.mark.megatron(tp=2)
def test_first():
    pass

@pytest.mark.world_size(2)
@pytest.mark.megatron(tp=2)
def test_second():
    assert ps.get_tensor_model_parallel_world_size() == 2
"""


@pytest.mark.parametrize("mode", ["serial", "torchrun"])
def test_a_layout_build_that_fails_on_one_rank_is_built_again_on_all(pytester, run_pytest, mode):
    """The layout's build failed on rank 1 only, so rank 0 holds a layout that rank 1 lacks:
    the test errors, and the next test of that layout builds it again on both ranks (were it
    kept on rank 0 only, rank 1's group creations would wait for it until the timeout)."""
    pytester.makeconftest(BUILD_FAILS_ON_RANK_1)
    pytester.makepyfile(test_built_twice=BUILT_TWICE)
    if mode == "torchrun":
        output = torchrun_pytest(pytester, expect_rc=1)
        assert "= 2 passed" in output and "= 1 passed" in output and " 1 error" in output, output
    else:
        result = run_pytest("--megatron-timeout", "30", "-rA")
        result.assert_outcomes(passed=1, errors=1)
        result.stdout.fnmatch_lines(["*the layout's build failed on rank 1*"])


def test_malformed_layout_is_a_collection_error(pytester, run_pytest):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.world_size(2)
        @pytest.mark.megatron(tp=0)
        def test_bad_layout():
            pass
        """
    )
    result = run_pytest()
    result.stdout.fnmatch_lines(["*test_bad_layout*megatron tp must be a positive int*"])
    assert result.ret != 0


TORCHRUN_SUITE = """
import os
import pytest
import torch
import torch.distributed as dist
import xdist_megatron
from megatron.core import parallel_state as ps

def who():
    return xdist_megatron.rank_info().rank

@pytest.mark.world_size(2)
def test_on_both_ranks(rank, world_size, device):
    assert (rank, world_size) == (dist.get_rank(), 2)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
    dist.new_group([0, 1])

@pytest.mark.world_size(2)
def test_megatron_cleaned_between_tests():
    assert not ps.model_parallel_is_initialized()

@pytest.mark.world_size(2)
@pytest.mark.megatron(tp=2)
def test_layout_under_torchrun():
    assert ps.get_tensor_model_parallel_world_size() == 2

@pytest.mark.world_size(2)
def test_gang_fixture(gang):
    assert gang.run(who) == [0, 1]

@pytest.mark.world_size(1)
def test_other_size():
    pass
"""


def test_torchrun_passthrough(pytester, tag):
    """Under `torchrun -m pytest` marked tests run in-process on each torchrun rank; sizes that
    differ from WORLD_SIZE are skipped; no gang is started."""
    pytester.makepyfile(test_torchrun_suite=TORCHRUN_SUITE)
    output = torchrun_pytest(pytester, expect_rc=0)
    assert output.count("4 passed, 1 skipped") == 2, output
    assert "needs world size 1, torchrun started 2" in output
    assert_no_processes_left(tag)
