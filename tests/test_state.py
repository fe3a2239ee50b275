"""xdist_megatron.ranks.isolation on real gangs: two ranks forked from this process, joined on gloo
through a FileStore, as the zygote forks them. Nothing is mocked."""

from __future__ import annotations

import ctypes
import gc
import os
import random
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xdist_megatron.ranks import isolation

WORLD_SIZE = 2
TIMEOUT = 60.0
REPO = Path(__file__).resolve().parents[1]


# --- harness -------------------------------------------------------------------------------------


def _children() -> list[int]:
    """Processes whose parent is this one, zombies included (they were never reaped); not
    torch's own compile-worker pool, which torch < 2.5 starts when megatron.core is imported
    and keeps for the life of the process."""
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if parent == me and b"torch/_inductor/compile_worker" not in command:
            found.append(int(entry))
    return found


@pytest.fixture(autouse=True)
def _no_child_left() -> Iterator[None]:
    yield
    assert _children() == []


def _rank_main(rank: int, store: str, body: Callable[..., None], args: tuple[Any, ...]) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=TIMEOUT),
    )
    try:
        body(rank, *args)
    finally:
        dist.destroy_process_group()


def _run_ranks(tmp_path: Path, body: Callable[..., None], *args: Any) -> None:
    """Run body(rank, *args) on every rank of a fresh gang; a rank's exception fails the test."""
    gc.freeze()  # as the zygote does: the ranks' gc.collect() then skips the inherited heap
    try:
        context = mp.start_processes(
            _rank_main,
            args=(str(tmp_path / "store"), body, args),
            nprocs=WORLD_SIZE,
            join=False,
            start_method="fork",
        )
    finally:
        gc.unfreeze()
    deadline = time.monotonic() + TIMEOUT
    try:
        while not context.join(timeout=1.0):
            assert time.monotonic() < deadline, f"ranks still running after {TIMEOUT} s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


@cache
def _megatron() -> ModuleType | None:
    """megatron.core.parallel_state, imported here before the ranks fork (as the zygote preloads
    it), or None where megatron-core is not installed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns at import that TE and Apex are missing
        try:
            from megatron.core import parallel_state
        except ImportError:
            return None
    return parallel_state


needs_megatron = pytest.mark.skipif("_megatron() is None", reason="needs megatron-core")


@cache
def _cuda_usable() -> bool:
    """Asked in a child: CUDA initialised in this process would be broken in forked ranks."""
    if torch.version.cuda is None:
        return False
    probe = "import torch; print(torch.cuda.is_available())"
    output = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=TIMEOUT
    )
    return output.stdout.strip() == "True"


needs_cuda = pytest.mark.skipif("not _cuda_usable()", reason="needs a CUDA device")


def _only_default_group() -> bool:
    world = dist.distributed_c10d._world
    return list(world.pg_map) == [world.default_pg]


def _all_reduce_sum(group: Any = None) -> float:
    value = torch.ones(1)
    dist.all_reduce(value, group=group)
    return value.item()


# --- process groups ------------------------------------------------------------------------------


def _leak_groups_then_clean_up(rank: int) -> None:
    world = dist.distributed_c10d._world
    both = dist.new_group([0, 1])
    dist.new_group([0])  # rank 1 is no member: the ranks' lists of groups differ
    dist.new_group([0, 1], backend="gloo")
    assert _all_reduce_sum(both) == 2
    assert len(world.pg_map) == (4 if rank == 0 else 3)

    isolation.cleanup_after_job()

    assert _only_default_group()
    assert _all_reduce_sum() == 2
    assert _all_reduce_sum(dist.new_group([0, 1])) == 2  # groups made afterwards work
    isolation.cleanup_after_job()
    assert _only_default_group()
    assert not torch.cuda.is_initialized()


def test_cleanup_after_job_destroys_every_group_but_the_default(tmp_path: Path) -> None:
    _run_ranks(tmp_path, _leak_groups_then_clean_up)


# --- Megatron ------------------------------------------------------------------------------------


def _dirty_megatron(rank: int) -> None:
    """What Megatron tests leave behind: a layout, overrides and singletons."""
    from megatron.core import num_microbatches_calculator, rerun_state_machine
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    ps._MPU_DATA_PARALLEL_WORLD_SIZE = 4
    ps.set_data_parallel_rank(3)
    ps._HYBRID_DP_CP_GROUPS[2] = ps.get_tensor_model_parallel_group()
    num_microbatches_calculator.init_num_microbatches_calculator(rank, None, 16, 2, 4)
    rerun_state_machine.initialize_rerun_state_machine()
    tp_random.get_cuda_rng_tracker()
    moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"] = {"values": None}
    assert ps.model_parallel_is_initialized()
    assert ps.get_data_parallel_world_size() == 4
    assert ps._GLOBAL_MEMORY_BUFFER is not None
    assert ps._EMBEDDING_GLOBAL_RANKS is not None


def _assert_megatron_clean() -> None:
    from megatron.core import num_microbatches_calculator, rerun_state_machine
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    assert not ps.model_parallel_is_initialized()
    assert ps._MPU_DATA_PARALLEL_WORLD_SIZE is None
    assert ps._MPU_DATA_PARALLEL_RANK is None
    assert ps._EMBEDDING_GLOBAL_RANKS is None
    assert ps._HYBRID_DP_CP_GROUPS == {}
    assert ps._GLOBAL_MEMORY_BUFFER is None
    assert num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None
    assert rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE is None
    assert not tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    assert moe_utils.get_moe_layer_wise_logging_tracker() == {}
    assert _only_default_group()


def _megatron_teardown(rank: int) -> None:
    from megatron.core import parallel_state as ps

    startup = isolation.snapshot()
    _dirty_megatron(rank)
    isolation.cleanup_after_job()
    _assert_megatron_clean()

    # The next layout sees its own sizes, not the previous test's overrides.
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    assert ps.get_data_parallel_world_size() == 2
    assert ps.get_data_parallel_rank() == rank
    dist.new_group([0, 1])

    isolation.cleanup_after_job()  # a module boundary: the per-job cleanup, then the restore
    isolation.restore(startup)
    _assert_megatron_clean()
    assert not torch.cuda.is_initialized()


@needs_megatron
def test_cleanup_after_job_and_restore_tear_down_megatron(tmp_path: Path) -> None:
    _run_ranks(tmp_path, _megatron_teardown)


def _keep_megatron_layout(rank: int) -> None:
    from megatron.core import num_microbatches_calculator
    from megatron.core import parallel_state as ps

    _dirty_megatron(rank)
    leaked = dist.new_group([0, 1])

    isolation.cleanup_after_job(keep_megatron=True)

    groups = dist.distributed_c10d._world.pg_map
    assert ps.model_parallel_is_initialized()
    assert leaked not in groups
    tensor_parallel, data_parallel = (
        ps.get_tensor_model_parallel_group(),
        ps.get_data_parallel_group_gloo(),
    )
    assert tensor_parallel in groups and data_parallel in groups
    assert _all_reduce_sum(tensor_parallel) == 2
    assert _all_reduce_sum(data_parallel) == 1
    assert num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None

    isolation.cleanup_after_job()
    _assert_megatron_clean()


@needs_megatron
def test_cleanup_after_job_can_keep_the_megatron_layout(tmp_path: Path) -> None:
    _run_ranks(tmp_path, _keep_megatron_layout)


# --- restore -------------------------------------------------------------------------------------

ENV_REMOVED, ENV_CHANGED, ENV_ADDED = "XDM_TEST_REMOVED", "XDM_TEST_CHANGED", "XDM_TEST_ADDED"


def _c_getenv(key: str) -> bytes | None:
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    return getenv(key.encode())


def _fp32_precisions() -> list[str | None]:
    backends = torch.backends
    owners = [backends, backends.cuda.matmul, backends.cudnn, backends.mkldnn]
    owners += [getattr(backends.cudnn, "conv", None), getattr(backends.mkldnn, "matmul", None)]
    return [getattr(owner, "fp32_precision", None) for owner in owners]


def _observe() -> dict[str, Any]:
    """Process-global state as tests see it, through torch's public API (legacy reads included:
    they raise if the TF32 switches disagree). Draws from each RNG stand for its state."""
    import numpy

    cudnn, cuda = torch.backends.cudnn, torch.backends.cuda
    return {
        "cudnn": (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32),
        "matmul": (
            cuda.matmul.allow_tf32,
            torch.get_float32_matmul_precision(),
            cuda.matmul.allow_fp16_reduced_precision_reduction,
            cuda.matmul.allow_bf16_reduced_precision_reduction,
        ),
        "fp32_precision": _fp32_precisions(),
        "sdp": (cuda.flash_sdp_enabled(), cuda.math_sdp_enabled()),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "anomaly": torch.is_anomaly_enabled(),
        "dtype": torch.get_default_dtype(),
        "device": torch.empty(()).device,
        "grad": torch.is_grad_enabled(),
        "torch_rng": torch.rand(4, device="cpu").tolist(),
        "python_rng": random.random(),
        "numpy_rng": numpy.random.rand(),
        "environ": dict(os.environ),
        "c_environ": [_c_getenv(key) for key in (ENV_REMOVED, ENV_CHANGED, ENV_ADDED)],
    }


def _dirty_torch() -> None:
    import numpy

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    cudnn.enabled, cudnn.benchmark, cudnn.deterministic = False, True, True
    cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("medium")
    matmul.allow_fp16_reduced_precision_reduction = False
    matmul.allow_bf16_reduced_precision_reduction = False
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9: legacy reads now raise
        matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    torch.backends.cuda.enable_flash_sdp(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.autograd.set_detect_anomaly(True)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_default_device("meta")
    torch.manual_seed(1234)
    random.seed(1234)
    numpy.random.seed(1234)
    del os.environ[ENV_REMOVED]
    os.environ[ENV_CHANGED] = "new"
    os.environ[ENV_ADDED] = "added"


def _restore_everything(rank: int, with_megatron: bool) -> None:
    import numpy.random  # noqa: F401 - imported before the snapshot, so it is recorded

    os.environ[ENV_REMOVED] = "here at start-up"
    os.environ[ENV_CHANGED] = "old"
    startup = isolation.snapshot()
    expected = _observe()

    _dirty_torch()
    if with_megatron:
        _dirty_megatron(rank)
    dist.new_group([0, 1])

    isolation.cleanup_after_job()
    isolation.restore(startup)

    assert _observe() == expected
    assert isolation.snapshot().settings == startup.settings
    if with_megatron:
        _assert_megatron_clean()
    assert _only_default_group()
    assert not torch.cuda.is_initialized()


def test_restore_returns_a_rank_to_its_startup_state(tmp_path: Path) -> None:
    _run_ranks(tmp_path, _restore_everything, _megatron() is not None)


def test_state_imports_no_optional_package_and_leaves_cuda_alone() -> None:
    script = textwrap.dedent(
        """
        import sys
        import torch
        import xdist_megatron
        before = set(sys.modules)
        from xdist_megatron.ranks import isolation
        startup = isolation.snapshot()
        isolation.cleanup_after_job()
        isolation.restore(startup)
        optional = ("numpy.random", "megatron", "transformer_engine", "torch._inductor")
        loaded = sorted(m for m in set(sys.modules) - before if m.startswith(optional))
        assert not loaded, loaded
        assert not torch.cuda.is_initialized()
        """
    )
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=TIMEOUT)


# --- CUDA (run on a GPU machine; skipped elsewhere) ----------------------------------------------


def _sticky_cuda_error(rank: int) -> None:
    values = torch.zeros(2, device="cuda")
    values[torch.tensor([rank + 8], device="cuda")] = 1.0  # asynchronous device-side assert
    with pytest.raises(RuntimeError):
        isolation.cleanup_after_job()


@needs_cuda
def test_cleanup_after_job_raises_an_asynchronous_cuda_error(tmp_path: Path) -> None:
    _run_ranks(tmp_path, _sticky_cuda_error)


def _cuda_rng_restored(rank: int) -> None:
    torch.manual_seed(1000 + rank)  # the rank's start-up seed, queued for CUDA until it starts
    startup = isolation.snapshot()
    assert startup.cuda_rng is None  # CUDA not initialised yet
    fresh = torch.cuda.get_rng_state()  # initialises CUDA: its generators' first state
    torch.cuda.manual_seed(7)
    torch.rand(4, device="cuda")
    isolation.cleanup_after_job()
    isolation.restore(startup)
    assert torch.equal(torch.cuda.get_rng_state(), fresh)

    later = isolation.snapshot()  # CUDA initialised now
    draws = torch.rand(4, device="cuda")
    isolation.cleanup_after_job()
    isolation.restore(later)
    assert torch.equal(torch.rand(4, device="cuda"), draws)


@needs_cuda
def test_restore_returns_cuda_generators_to_their_startup_state(tmp_path: Path) -> None:
    _run_ranks(tmp_path, _cuda_rng_restored)
