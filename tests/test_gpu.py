"""GPU paths (NCCL, device pinning, sticky CUDA errors): run where GPUs are, skipped on CPU."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

import pytest
import torch
from conftest import assert_no_processes_left

from xdist_megatron.zygote.server import WARM_PER_KEY

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU")

SUITE = """
import os, time
import pytest, torch, torch.distributed as dist

@pytest.mark.world_size(1, 2)
def test_pinned_and_nccl(rank, world_size, local_rank, device):
    assert device == torch.device("cuda", local_rank)
    assert torch.cuda.current_device() == local_rank
    assert torch.cuda.device_count() == world_size
    assert os.environ["CUDA_VISIBLE_DEVICES"] == os.environ["XDIST_MEGATRON_DEVICES"]
    t = torch.full((1024,), rank + 1.0, device=device)
    dist.all_reduce(t)
    assert t[0].item() == world_size * (world_size + 1) / 2

@pytest.mark.world_size(2)
def test_device_side_assert(device):
    index = torch.tensor([10], device=device)
    torch.zeros(2, device=device)[index] = 1.0

@pytest.mark.world_size(2)
def test_after_the_sticky_error(rank, device):
    t = torch.ones(4, device=device)
    dist.all_reduce(t)
    assert t.sum().item() == 8
"""


def test_nccl_pinning_and_sticky_cuda_error(pytester: pytest.Pytester, run_pytest) -> None:
    """A device-side assert fails its own test; the next test passes on a fresh gang."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytester.makepyfile(test_gpu_suite=SUITE)
    result = run_pytest("-v", "-rA", "--megatron-timeout", "120", gpus=True)
    print(result.stdout.str())
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*test_device_side_assert FAILED*", "*rank*"])
    assert "CUDA" in result.stdout.str()


CUDA_AT_IMPORT_LIBS = {
    "torch": "import os\nimport torch\n\ntorch.cuda.init()\nIMPORTED_BY = os.getpid()\n",
    # A C library that calls cuInit itself, as torch never learns (flash-attn's import does
    # through torch; others through the driver API).
    "driver": (
        "import ctypes, os\n\nctypes.CDLL('libcuda.so.1').cuInit(0)\nIMPORTED_BY = os.getpid()\n"
    ),
}

CUDA_AT_IMPORT_SUITE = """
import os
import subprocess
import pytest
import cuda_at_import

@pytest.mark.world_size(1)
def test_where_imported():
    parent = cuda_at_import.IMPORTED_BY == os.getppid()
    print("cuda_at_import imported by the", "zygote" if parent else "rank")
"""


@pytest.mark.parametrize("through", sorted(CUDA_AT_IMPORT_LIBS))
def test_a_preload_that_initialises_cuda_is_left_to_gpu_ranks(
    pytester: pytest.Pytester, run_pytest, tmp_path_factory, monkeypatch, through: str
) -> None:
    """A package that initialises CUDA at import would leave no forked rank able to use its GPU:
    for GPU ranks the zygote drops it (each rank imports it) and says so; ranks in CPU mode never
    touch CUDA, so there it stays preloaded."""
    vendored = tmp_path_factory.mktemp("vendored")
    (vendored / "cuda_at_import.py").write_text(CUDA_AT_IMPORT_LIBS[through])
    monkeypatch.setenv("PYTHONPATH", str(vendored), prepend=os.pathsep)
    pytester.makepyfile(test_cuda_at_import=CUDA_AT_IMPORT_SUITE)
    on_gpus = run_pytest("-s", "--megatron-timeout", "120", gpus=True)
    on_gpus.assert_outcomes(passed=1)
    on_gpus.stdout.fnmatch_lines(["*imported by the rank*", "*cuda_at_import*CUDA*"])
    on_cpu = run_pytest("-s", "--megatron-devices", "cpu:2", "--megatron-timeout", "120", gpus=True)
    on_cpu.assert_outcomes(passed=1)
    on_cpu.stdout.fnmatch_lines(["*imported by the zygote*"])


SEVERAL_CUDA_AT_IMPORT_SUITE = """
import os
import pytest
import plain_lib, cuda_lib_a, cuda_lib_b

@pytest.mark.world_size(1)
def test_where_imported():
    for lib in (plain_lib, cuda_lib_a, cuda_lib_b):
        parent = lib.IMPORTED_BY == os.getppid()
        print(lib.__name__, "imported by the", "zygote" if parent else "rank")
"""


def test_modules_that_initialise_cuda_cost_one_replacement_zygote_then_none(
    pytester: pytest.Pytester, run_pytest, tmp_path_factory, monkeypatch
) -> None:
    """However many preloads initialise CUDA, one replacement zygote (which tries each in a fork
    first) leaves them all to the ranks and still preloads the rest; the next session remembers
    them (pytest cache) and does not try them again."""
    vendored = tmp_path_factory.mktemp("vendored")
    for name in ("cuda_lib_a", "cuda_lib_b"):
        (vendored / f"{name}.py").write_text(CUDA_AT_IMPORT_LIBS["torch"])
    (vendored / "plain_lib.py").write_text("import os\n\nIMPORTED_BY = os.getpid()\n")
    monkeypatch.setenv("PYTHONPATH", str(vendored), prepend=os.pathsep)
    pytester.makepyfile(test_several=SEVERAL_CUDA_AT_IMPORT_SUITE)
    imported = [
        "*plain_lib imported by the zygote*",
        "*cuda_lib_a imported by the rank*",
        "*cuda_lib_b imported by the rank*",
    ]
    first = run_pytest("-s", "--megatron-timeout", "120", gpus=True, cache=True)
    first.assert_outcomes(passed=1)
    first.stdout.fnmatch_lines(imported)
    replaced = "replaced it with one that tries each preload"
    assert first.stdout.str().count(replaced) == 1
    first.stdout.fnmatch_lines([f"*preload of cuda_lib_a initialised CUDA: {replaced}*"])
    # the replacement's trial found cuda_lib_b, not the spoilt zygote's next import
    first.stdout.fnmatch_lines(["*megatron_preload: cuda_lib_b: initialised CUDA at import*"])
    second = run_pytest("-s", "--megatron-timeout", "120", gpus=True, cache=True)
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines(imported)
    assert "initialised CUDA" not in second.stdout.str()
    second.stdout.fnmatch_lines(["*not preloaded, as earlier sessions*: cuda_lib_a, cuda_lib_b"])


FAULTS = """
import pytest, torch, torch.distributed as dist

def all_reduce_works(device):
    t = torch.ones(1 << 20, device=device)
    dist.all_reduce(t)
    assert t.eq(2).all().item()

@pytest.mark.world_size(2)
def test_out_of_memory_on_one_rank(rank, device):
    if rank == 1:
        torch.empty(1 << 50, dtype=torch.uint8, device=device)

@pytest.mark.world_size(2)
def test_after_out_of_memory(device):
    all_reduce_works(device)

@pytest.mark.world_size(2)
def test_moves_to_the_other_gpu(local_rank):
    torch.cuda.set_device(1 - local_rank)
    assert torch.ones(1, device="cuda").device.index == 1 - local_rank

@pytest.mark.world_size(2)
def test_after_the_move(local_rank, device):
    assert torch.cuda.current_device() == local_rank
    all_reduce_works(device)

@pytest.mark.world_size(2)
def test_one_rank_skips_the_all_reduce(rank, device):
    t = torch.ones(1 << 20, device=device)
    if rank == 0:
        dist.all_reduce(t)
        torch.cuda.synchronize()

@pytest.mark.world_size(2)
def test_after_the_skipped_all_reduce(device):
    all_reduce_works(device)

@pytest.mark.world_size(2)
def test_all_reduce_sizes_differ(rank, device):
    t = torch.ones(1024 * (rank + 1), device=device)
    dist.all_reduce(t)
    assert t.eq(2).all().item()

@pytest.mark.world_size(2)
def test_after_the_size_mismatch(device):
    all_reduce_works(device)
"""


def gpu_memory_used() -> list[int]:
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    return [int(v) for v in subprocess.check_output(query, text=True).split()]


def gpu_processes() -> set[int]:
    query = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
    return {int(v) for v in subprocess.check_output(query, text=True).split()}


def test_gpu_faults_cost_one_test_each(pytester: pytest.Pytester, run_pytest) -> None:
    """Out of memory on one rank, a rank that skips a collective (the plugin's timeout fires, not
    NCCL's watchdog), a test that moves its rank to the other GPU, an all_reduce whose sizes
    differ: each fails (or warns about) its own test, with the cause first; the next test passes;
    after the session no process is left on the GPUs and their memory is back where it was."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    before = gpu_memory_used()
    pytester.makepyfile(test_gpu_faults=FAULTS)
    result = run_pytest("-vv", "-rA", "--megatron-timeout", "30", gpus=True)
    print(result.stdout.str())
    result.stdout.fnmatch_lines(
        [
            "*::test_out_of_memory_on_one_rank - rank 1: *OutOfMemoryError: CUDA out of memory*",
            "*::test_one_rank_skips_the_all_reduce - rank 0 timed out after 30 s in synchronize*",
        ],
        consecutive=False,
    )
    result.stdout.fnmatch_lines(["*rank ?: the test left cuda:? current; the gang made it*"])
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 3 and outcomes.get("passed") == 5, outcomes
    for name in ("out_of_memory", "the_move", "the_skipped_all_reduce", "the_size_mismatch"):
        result.stdout.fnmatch_lines([f"PASSED *::test_after_{name}"])
    assert gpu_processes() <= {os.getpid()}
    after = gpu_memory_used()
    print(f"GPU memory used (MiB) before the session {before}, after {after}")
    assert after == before


GANG_FUNCTION_FAULTS = """
import pytest, torch, torch.distributed as dist
import xdist_megatron


def device_side_assert():
    device = xdist_megatron.rank_info().device
    torch.zeros(2, device=device)[torch.tensor([10], device=device)] = 1.0


def all_reduce_unless_rank_one():
    if xdist_megatron.rank_info().rank == 1:
        raise ValueError("rank one skips the all_reduce")
    dist.all_reduce(torch.ones(4, device=xdist_megatron.rank_info().device))


def total_after_all_reduce():
    total = torch.ones(4, device=xdist_megatron.rank_info().device)
    dist.all_reduce(total)
    return total.sum().item()


@pytest.mark.world_size(1)
def test_device_side_assert_in_a_function(gang):
    gang.run(device_side_assert)


@pytest.mark.world_size(1)
def test_after_the_functions_cuda_error(gang):
    assert gang.run(total_after_all_reduce) == [4.0]


@pytest.mark.world_size(2)
def test_a_peer_raises_beside_an_nccl_all_reduce(gang):
    gang.run(all_reduce_unless_rank_one)


@pytest.mark.world_size(2)
def test_after_the_unmatched_all_reduce(gang):
    assert gang.run(total_after_all_reduce) == [8.0, 8.0]
"""


def test_gang_function_faults_cost_one_test_each(pytester: pytest.Pytester, run_pytest) -> None:
    """A `gang.run` function whose asynchronous CUDA work fails, or that raises on one rank
    while its peer's NCCL all_reduce waits for it (queued: the peer's function returned), fails
    its own test, without a teardown error or the full timeout; the next test passes."""
    pytester.makepyfile(test_gang_faults=GANG_FUNCTION_FAULTS)
    result = run_pytest("-vv", "-rA", "--megatron-timeout", "60", gpus=True)
    print(result.stdout.str())
    result.stdout.fnmatch_lines(["*device_side_assert failed on rank(s) 0: *CUDA error*"])
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors", 0) == 0, outcomes
    if torch.cuda.device_count() < 2:
        assert outcomes.get("failed") == 1 and outcomes.get("passed") == 1, outcomes
        return
    result.stdout.fnmatch_lines(["*rank 0 was still in * 2 s after rank 1 failed*"])
    assert outcomes.get("failed") == 2 and outcomes.get("passed") == 2, outcomes


def test_a_gang_after_the_first_starts_from_a_warm_standby(tmp_path, tag) -> None:
    """Once a gang has run on a device, the zygote keeps a standby rank that already made that
    device current (its CUDA context made while idle): the next gang there, a replacement or
    a new one, does not pay the context. Seen from outside: the standby holds the GPU before the
    gang is asked for, and becomes its rank."""
    from xdist_megatron.driver.gang import Gang
    from xdist_megatron.driver.zygote_client import ZygoteClient
    from xdist_megatron.placement import parse_devices

    devices = parse_devices("0", torch.cuda.device_count(), os.cpu_count() or 1, None)
    zygote = ZygoteClient(["torch", "torch.distributed"], None, cuda=True)
    try:
        with Gang(1, devices, zygote=zygote, workdir=str(tmp_path)) as first:
            assert first.run(torch.cuda.current_device) == [0]
            gone = {os.getpid(), *first.pids}
        holding = wait_for(lambda: gpu_processes() - gone, WARM_PER_KEY, seconds=30)
        asked = time.perf_counter()
        with Gang(1, devices, zygote=zygote, workdir=str(tmp_path)) as second:
            assert second.run(torch.cuda.current_device) == [0]
            print(f"second gang ready and called in {time.perf_counter() - asked:.3f} s")
            assert set(second.pids) <= holding
    finally:
        zygote.close()
    assert_no_processes_left(tag)


def wait_for(probe: Callable[[], set[int]], count: int, seconds: float) -> set[int]:
    """What `probe` finds once it finds `count` (or the time is up)."""
    deadline = time.monotonic() + seconds
    while len(found := probe()) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


SHARED_GPU_SUITE = """
import os, time
import pytest, torch, torch.distributed as dist

RECORD = os.environ["WINDOWS_DIR"]


def meet(name, other, device):
    open(os.path.join(RECORD, name), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(RECORD, other)):
        assert time.monotonic() < deadline, f"{other} never ran beside {name}"
        time.sleep(0.05)
    t = torch.ones(1024, device=device)
    dist.all_reduce(t)
    assert t[0].item() == 1.0
"""

SHARED_GPU_MODULES = {
    "test_a": SHARED_GPU_SUITE
    + """
@pytest.mark.world_size(1)
def test_meet_b(device):
    meet("a", "b", device)

@pytest.mark.world_size(1)
def test_out_of_memory_beside_b(device):
    torch.empty(1 << 50, dtype=torch.uint8, device=device)
""",
    "test_b": SHARED_GPU_SUITE
    + """
@pytest.mark.world_size(1)
def test_meet_a(device):
    meet("b", "a", device)

@pytest.mark.world_size(1)
def test_wait_for_the_out_of_memory(device):
    time.sleep(3)
""",
}


def test_two_gangs_share_one_gpu(pytester: pytest.Pytester, run_pytest, monkeypatch) -> None:
    """`-n 2 --dist megatron --megatron-gangs-per-device 2` on one GPU: two gangs run on it at
    once, each with its own NCCL communicator; a test that runs out of memory there says how many
    gangs held the GPU."""
    pytester.makepyfile(**SHARED_GPU_MODULES)
    records = pytester.path / "records"
    records.mkdir()
    monkeypatch.setenv("WINDOWS_DIR", str(records))
    result = run_pytest(
        *("-n", "2", "--dist", "megatron", "--megatron-devices", "0"),
        *("--megatron-gangs-per-device", "2", "-rA"),
        gpus=True,
    )
    print(result.stdout.str())
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*gangs on the device*", "*as the test ended: cuda-*: 2 of 2*"])
