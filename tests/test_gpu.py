"""GPU paths (NCCL, device pinning, sticky CUDA errors): run where GPUs are, skipped on CPU."""

from __future__ import annotations

import os

import pytest
import torch

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


CUDA_AT_IMPORT_LIB = "import os\nimport torch\n\ntorch.cuda.init()\nIMPORTED_BY = os.getpid()\n"

CUDA_AT_IMPORT_SUITE = """
import os
import pytest
import cuda_at_import

@pytest.mark.world_size(1)
def test_where_imported():
    parent = cuda_at_import.IMPORTED_BY == os.getppid()
    print("cuda_at_import imported by the", "zygote" if parent else "rank")
"""


def test_a_preload_that_initialises_cuda_is_left_to_gpu_ranks(
    pytester: pytest.Pytester, run_pytest, tmp_path_factory, monkeypatch
) -> None:
    """A package that initialises CUDA at import would leave no forked rank able to use its GPU:
    for GPU ranks the zygote drops it (each rank imports it) and says so; ranks in CPU mode never
    touch CUDA, so there it stays preloaded."""
    vendored = tmp_path_factory.mktemp("vendored")
    (vendored / "cuda_at_import.py").write_text(CUDA_AT_IMPORT_LIB)
    monkeypatch.setenv("PYTHONPATH", str(vendored), prepend=os.pathsep)
    pytester.makepyfile(test_cuda_at_import=CUDA_AT_IMPORT_SUITE)
    on_gpus = run_pytest("-s", "--megatron-timeout", "120", gpus=True)
    on_gpus.assert_outcomes(passed=1)
    on_gpus.stdout.fnmatch_lines(["*imported by the rank*", "*cuda_at_import*CUDA*"])
    on_cpu = run_pytest("-s", "--megatron-devices", "cpu:2", "--megatron-timeout", "120", gpus=True)
    on_cpu.assert_outcomes(passed=1)
    on_cpu.stdout.fnmatch_lines(["*imported by the zygote*"])
