"""What one test module leaves in a shared gang's processes must not reach the next module.

Module A dirties process-global state on a ws2 gang; module B, on the same rank processes, must
see every value as it was when the gang started. The generated tests record their observations
into $FACTS_DIR; the outer tests compare them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_no_processes_left, torchrun_pytest

FACTS_MODULE = """
import json, os

def record(name, **values):
    values.update(pid=os.getpid())
    with open(os.path.join(os.environ["FACTS_DIR"], name + ".jsonl"), "a") as f:
        f.write(json.dumps(values) + "\\n")
"""

PROBE_MODULE = """
import hashlib, os, random
import torch
from numpy import random as np_random

def digest(data):
    return hashlib.sha1(data).hexdigest()

def settings(legacy=True):
    backends = torch.backends
    cudnn = backends.cudnn
    numpy_state = np_random.get_state()
    values = {
        "cudnn": [cudnn.enabled, cudnn.benchmark, cudnn.deterministic],
        "deterministic": [
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ],
        "default_dtype": str(torch.get_default_dtype()),
        "grad_enabled": torch.is_grad_enabled(),
        "num_threads": torch.get_num_threads(),
        "torch_rng": digest(torch.get_rng_state().numpy().tobytes()),
        "python_rng": digest(repr(random.getstate()).encode()),
        "numpy_rng": digest(numpy_state[1].tobytes() + repr(numpy_state[2:]).encode()),
        "environ": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},
    }
    if hasattr(backends, "fp32_precision"):  # torch >= 2.9
        values["fp32_precision"] = [
            backends.fp32_precision,
            backends.cuda.matmul.fp32_precision,
            cudnn.fp32_precision,
            cudnn.conv.fp32_precision,
            cudnn.rnn.fp32_precision,
            backends.mkldnn.matmul.fp32_precision,
        ]
    if legacy:  # torch refuses these reads once a test mixed in the fp32_precision API
        values["tf32"] = [
            cudnn.allow_tf32,
            backends.cuda.matmul.allow_tf32,
            torch.get_float32_matmul_precision(),
        ]
    return values
"""

DIRTY_MODULE = """
import os, random
import pytest, torch
import torch.distributed as dist
from megatron.core import parallel_state
from numpy import random as np_random
from facts import record
from probe import settings

LEAKED = []

@pytest.mark.world_size(2)
def test_dirty_everything(rank):
    start = settings()
    cudnn = torch.backends.cudnn
    cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = False, True, True, False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_float32_matmul_precision("medium")
    if hasattr(torch.backends, "fp32_precision"):  # torch >= 2.9
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        cudnn.conv.fp32_precision = "tf32"
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(torch.get_num_threads() + 1)
    torch.manual_seed(1234)
    random.seed(1234)
    np_random.seed(1234)
    os.environ["XM_ADDED"] = "added"
    os.environ["XM_CHANGED"] = "changed"
    del os.environ["XM_DELETED"]
    LEAKED.append(dist.new_group([0, 1]))
    record("start", rank=rank, values=start, dirty=settings(legacy=False))

@pytest.mark.world_size(2)
def test_state_is_kept_within_the_module(rank):
    assert LEAKED
    assert torch.get_default_dtype() == torch.float64

@pytest.mark.world_size(2)
def test_megatron_left_initialised(rank):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    record("megatron", rank=rank, groups=len(dist.distributed_c10d._world.pg_map))
"""

CLEAN_MODULE = """
import pytest
import torch.distributed as dist
from megatron.core import parallel_state
from facts import record
from probe import settings

@pytest.mark.world_size(2)
def test_sees_the_startup_state(rank):
    world = dist.distributed_c10d._world
    record(
        "restored",
        rank=rank,
        values=settings(),
        only_default_group=list(world.pg_map) == [world.default_pg],
        megatron=parallel_state.model_parallel_is_initialized(),
    )
"""

PRELOAD_INI = """
[pytest]
megatron_preload =
    numpy.random
    megatron.core.parallel_state
"""


def read_facts(folder: Path, name: str) -> dict[int, dict]:
    """The facts recorded under `name`, by rank."""
    path = folder / f"{name}.jsonl"
    facts = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {fact["rank"]: fact for fact in facts}


@pytest.fixture
def facts_dir(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the generated tests record facts; `facts.record` writes there."""
    folder = pytester.mkdir("facts")
    monkeypatch.setenv("FACTS_DIR", str(folder))
    pytester.makepyfile(facts=FACTS_MODULE)
    return folder


def test_module_boundary_restores_startup_state(pytester, run_pytest, facts_dir, monkeypatch):
    """Torch flags, dtype, grad mode, RNGs, environment, process groups and Megatron's parallel
    state are back at their start-up values in the next module, on the same rank processes."""
    monkeypatch.setenv("XM_CHANGED", "original")
    monkeypatch.setenv("XM_DELETED", "present")
    pytester.makeini(PRELOAD_INI)
    pytester.makepyfile(probe=PROBE_MODULE, test_a_dirty=DIRTY_MODULE, test_b_clean=CLEAN_MODULE)
    run_pytest("--megatron-timeout", "120").assert_outcomes(passed=4)
    start = read_facts(facts_dir, "start")
    restored = read_facts(facts_dir, "restored")
    megatron = read_facts(facts_dir, "megatron")
    assert sorted(start) == sorted(restored) == sorted(megatron) == [0, 1]
    for rank in (0, 1):
        assert restored[rank]["pid"] == start[rank]["pid"], "module B ran on another gang"
        before, dirty = start[rank]["values"], start[rank]["dirty"]
        unchanged = [key for key in dirty if dirty[key] == before[key]]
        assert not unchanged, f"module A failed to change {unchanged}: the check would be vacuous"
        assert restored[rank]["values"] == before
        assert megatron[rank]["groups"] > 2, "megatron created no process groups"
        assert restored[rank]["only_default_group"], "process groups leaked into module B"
        assert restored[rank]["megatron"] is False, "megatron parallel state leaked into module B"


# As Megatron-LM's MoEModelTestContainer: a finalizer that tears down global state. Each test leaves
# one in a reference cycle, the first also in the traceback pytest keeps of the last failure.
CYCLES_MODULE = """
import os
import pytest
from facts import record

finalized = []

class Container:
    def __init__(self, fail):
        self.me = self  # only the garbage collector ends it
        if fail:
            raise RuntimeError("world_size (2) is not divisible by 8")

    def __del__(self):
        finalized.append(os.getpid())

@pytest.mark.world_size(2)
def test_fails_leaving_a_cycle(rank):
    Container(fail=True)

@pytest.mark.world_size(2)
def test_passes_leaving_a_cycle(rank):
    Container(fail=False)

@pytest.mark.world_size(2)
def test_starts_after_both_ended(rank):
    record("next", rank=rank, finalized=len(finalized))
"""


@pytest.mark.parametrize("launch", ["gang", "torchrun"])
def test_what_a_test_left_in_cycles_ends_before_the_next_test(
    pytester, run_pytest, facts_dir, tag, launch
):
    """Garbage a test leaves (in reference cycles, or held by the last failure's traceback) is
    collected after that test, so its finalizers cannot run inside a later one. Megatron-LM's
    MoE dispatcher tests failed so under the plugin: a finalizer reset the parallel state of
    the test that happened to trigger the garbage collector."""
    pytester.makepyfile(test_cycles=CYCLES_MODULE)
    if launch == "gang":
        run_pytest("--megatron-timeout", "60").assert_outcomes(passed=2, failed=1)
    else:
        assert torchrun_pytest(pytester, expect_rc=1).count("1 failed, 2 passed") == 2
        assert_no_processes_left(tag)
    finalized = {rank: fact["finalized"] for rank, fact in read_facts(facts_dir, "next").items()}
    assert finalized == {0: 2, 1: 2}


CRASH_LATER_MODULE = """
import os, threading
import pytest
from facts import record

@pytest.mark.world_size(1)
def test_leaves_a_crashing_thread(rank):
    record("doomed", rank=rank)
    threading.Timer(0.2, os._exit, (7,)).start()
"""

AFTER_CRASH_MODULE = """
import json, os, time
import pytest
from facts import record

@pytest.mark.timeout(30)
def test_wait_until_the_rank_is_gone():
    with open(os.path.join(os.environ["FACTS_DIR"], "doomed.jsonl")) as f:
        pid = json.loads(f.readline())["pid"]
    while os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)

@pytest.mark.world_size(1)
def test_runs_on_a_fresh_gang(rank):
    record("fresh", rank=rank)
"""


def test_failed_reset_retires_the_gang_without_failing_tests(pytester, run_pytest, facts_dir):
    """A reset that cannot complete (here: the rank died after module A's last test) must
    replace the gang, not fail module B's test."""
    pytester.makepyfile(test_a_crash=CRASH_LATER_MODULE, test_b_after=AFTER_CRASH_MODULE)
    result = run_pytest("--megatron-timeout", "30")
    result.assert_outcomes(passed=3)
    assert read_facts(facts_dir, "fresh")[0]["pid"] != read_facts(facts_dir, "doomed")[0]["pid"]


REFUSING_RESTORE_CONFTEST = """
from xdist_megatron.ranks import isolation


def refuse(startup):
    raise RuntimeError("restore refused")


isolation.restore = refuse  # on the ranks: every module boundary's reset fails
"""

BEFORE_REFUSED_RESET = """
import pytest
from facts import record

@pytest.mark.world_size(1)
def test_before_the_boundary(rank):
    record("before", rank=rank)
"""

AFTER_REFUSED_RESET = """
import json, os
import pytest
from facts import record

@pytest.mark.world_size(1)
def test_after_the_boundary(rank):
    with open(os.path.join(os.environ["FACTS_DIR"], "before.jsonl")) as f:
        old = json.loads(f.readline())["pid"]
    record("after", rank=rank, old_rank_alive=os.path.exists(f"/proc/{old}"))
"""


def test_a_reset_that_raises_on_live_ranks_ends_them(pytester, run_pytest, facts_dir):
    """A reset that fails on ranks that are alive replaces the gang, and the old ranks are gone
    before the next module's first test runs on the new one; that test does not fail."""
    pytester.makeconftest(REFUSING_RESTORE_CONFTEST)
    pytester.makepyfile(test_a_first=BEFORE_REFUSED_RESET, test_b_second=AFTER_REFUSED_RESET)
    result = run_pytest("--megatron-timeout", "30")
    result.assert_outcomes(passed=2)
    after = read_facts(facts_dir, "after")[0]
    assert after["pid"] != read_facts(facts_dir, "before")[0]["pid"]
    assert not after["old_rank_alive"]


MEGATRON_DIRTY = """
import os
import pytest
import torch.distributed as dist
from megatron.core import num_microbatches_calculator as nmc
from megatron.core import parallel_state as ps
from megatron.core import rerun_state_machine as rsm
from megatron.core.tensor_parallel import random as tp_random

@pytest.mark.world_size(2)
def test_leave_every_megatron_singleton_dirty(rank):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    ps.set_data_parallel_rank(7)
    nmc.init_num_microbatches_calculator(rank, None, 8, 1, 1)
    tp_random.initialize_rng_tracker(inference_rng_tracker=True)
    rsm.initialize_rerun_state_machine()
    dist.new_group([0, 1])
    assert ps._MPU_DATA_PARALLEL_RANK == 7 and ps._EMBEDDING_GLOBAL_RANKS
    assert ps._GLOBAL_MEMORY_BUFFER is not None
    assert nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None
    assert tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    assert rsm._GLOBAL_RERUN_STATE_MACHINE is not None
    with open(os.path.join(os.environ["PIDS"], f"dirty-{rank}"), "w") as f:
        f.write(str(os.getpid()))
"""

MEGATRON_CLEAN = """
import os
import pytest
import torch.distributed as dist
from megatron.core import num_microbatches_calculator as nmc
from megatron.core import parallel_state as ps
from megatron.core import rerun_state_machine as rsm
from megatron.core.tensor_parallel import random as tp_random

@pytest.mark.world_size(2)
def test_every_megatron_singleton_is_clean():
    assert not ps.model_parallel_is_initialized()
    assert ps._MPU_DATA_PARALLEL_RANK is None and ps._MPU_DATA_PARALLEL_WORLD_SIZE is None
    assert ps._EMBEDDING_GLOBAL_RANKS is None
    assert ps._GLOBAL_MEMORY_BUFFER is None
    assert nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None
    assert not tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    assert rsm._GLOBAL_RERUN_STATE_MACHINE is None
    assert len(dist.distributed_c10d._world.pg_map) == 1
    with open(os.path.join(os.environ["PIDS"], f"clean-{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
"""


def test_megatron_state_dirtied_in_one_module_is_clean_in_the_next(
    pytester, run_pytest, tmp_path, monkeypatch
):
    """Parallel state, the data-parallel rank override, embedding ranks, the global memory
    buffer, the microbatch calculator, the RNG tracker, the rerun state machine and leaked
    groups: all left dirty by module A, all clean in module B on the same gang."""
    pytest.importorskip("megatron.core")
    monkeypatch.setenv("PIDS", str(tmp_path))
    pytester.makepyfile(test_a_megatron=MEGATRON_DIRTY, test_b_megatron=MEGATRON_CLEAN)
    run_pytest("--megatron-timeout", "120").assert_outcomes(passed=2)
    for rank in (0, 1):
        dirty, clean = ((tmp_path / f"{t}-{rank}").read_text() for t in ("dirty", "clean"))
        assert dirty == clean, "the gang was replaced, not reset"
