"""Model-Optimizer's `spawn_multiprocess_job` and `DistributedWorkerPool` on gangs: the suite's
own helpers (here ones with their contract, at their path, `_test_utils/torch/distributed/
utils.py`) are replaced where the suite imported them; a job runs on a gang in the state a
spawned process would give it, a job that raises, dies or hangs on one rank fails its test
alone, and a size over the devices spawns."""

from __future__ import annotations

import pytest

HELPER = """
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _child(rank, size, job, backend, port):
    os.environ.update(
        MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size)
    )
    dist.init_process_group(backend, rank=rank, world_size=size)
    torch.manual_seed(1234)
    job(rank, size)


def spawn_multiprocess_job(size, job, backend="gloo"):
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=_child, args=(rank, size, job, backend, port))
        for rank in range(size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
        assert not process.exitcode


def default_worker_teardown(rank, world_size):
    pass


class DistributedWorkerPool:
    def __init__(self, world_size, backend="nccl", teardown_fn=default_worker_teardown):
        raise AssertionError("the pool spawned")
"""

POOL_CONFTEST = """
import pytest
from _test_utils.torch.distributed.utils import DistributedWorkerPool


@pytest.fixture(scope="module")
def dist_workers():
    pool = DistributedWorkerPool(world_size=2, backend="gloo")
    yield pool
    pool.shutdown()
"""

POOL_SUITE = """
import torch
import torch.distributed as dist


def _sum(rank, world_size, value, scale=1):
    tensor = torch.tensor([value * scale])
    dist.all_reduce(tensor)
    assert tensor.item() == value * scale * world_size


def test_p0_run(dist_workers):
    dist_workers.run(_sum, 3, scale=2)


def _fails_on_0(rank, world_size):
    if rank == 0:
        raise KeyError("the pool's job fails on rank 0")


def test_p1_fails_on_rank_0(dist_workers):
    dist_workers.run(_fails_on_0)


def test_p2_after_the_failure(dist_workers):
    dist_workers.run(_sum, 1)
"""

SUITE = """
import os
import signal
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist
from _test_utils.torch.distributed.utils import spawn_multiprocess_job

LEFT_BY = None  # what a job leaves in its process


def _all_reduce(expected_seed, rank, size):
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    assert tensor.item() == size
    assert torch.initial_seed() == expected_seed
    assert os.environ["RANK"] == str(rank) and os.environ["MASTER_ADDR"] == "localhost"
    global LEFT_BY
    assert LEFT_BY is None, LEFT_BY
    LEFT_BY = rank
    torch.manual_seed(rank)


def test_0_all_reduce():
    spawn_multiprocess_job(2, partial(_all_reduce, 1234), backend="gloo")


def test_1_again_from_a_fresh_state():
    spawn_multiprocess_job(2, partial(_all_reduce, 1234), backend="gloo")


def _raises_on_1(rank, size):
    if rank == 1:
        raise ValueError("the job's own failure on rank 1")


def test_2_raises_on_rank_1():
    spawn_multiprocess_job(2, _raises_on_1)


def _destroys_the_group(rank, size):
    dist.destroy_process_group()


def test_3_destroys_the_group():
    spawn_multiprocess_job(2, _destroys_the_group)


def _dies_on_1(rank, size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_4_rank_1_dies():
    spawn_multiprocess_job(2, _dies_on_1)


def _hangs_on_1(rank, size):
    if rank == 1:
        time.sleep(600)


def test_5_hangs_on_rank_1():
    spawn_multiprocess_job(2, _hangs_on_1)


def test_6_after_the_faults():
    spawn_multiprocess_job(2, partial(_all_reduce, 1234))


def _sizes(rank, size):
    assert dist.get_world_size() == size


def test_7_other_sizes():  # the run has 2 devices: 3 ranks spawn as without the plugin
    spawn_multiprocess_job(1, _sizes)
    spawn_multiprocess_job(3, _sizes)
"""

EXPECTED = {
    "test_0_all_reduce": "passed",
    "test_1_again_from_a_fresh_state": "passed",
    "test_2_raises_on_rank_1": "failed",
    "test_3_destroys_the_group": "passed",
    "test_4_rank_1_dies": "failed",
    "test_5_hangs_on_rank_1": "failed",
    "test_6_after_the_faults": "passed",
    "test_7_other_sizes": "passed",
    "test_p0_run": "passed",
    "test_p1_fails_on_rank_0": "failed",
    "test_p2_after_the_failure": "passed",
}


@pytest.fixture
def modelopt_suite(pytester: pytest.Pytester) -> pytest.Pytester:
    for package in ("_test_utils", "_test_utils/torch", "_test_utils/torch/distributed"):
        pytester.mkpydir(package)
    pytester.path.joinpath("_test_utils/torch/distributed/utils.py").write_text(HELPER)
    pytester.makepyfile(test_modelopt_suite=SUITE, test_pool_suite=POOL_SUITE)
    pytester.makeconftest(POOL_CONFTEST)
    # A second conftest outside any package, imported after the first: pytest's default import
    # mode takes the first one's `conftest` out of sys.modules (as Model-Optimizer's tests/gpu
    # lane's), and its pool fixture must still get the pool on gangs.
    later = pytester.mkdir("later")
    later.joinpath("conftest.py").write_text("")
    later.joinpath("test_later.py").write_text("def test_later():\n    pass\n")
    pytester.makeini("[pytest]\nmegatron_timeout = 6\n")  # the hung job's; none in the harness
    return pytester


def outcomes(result: pytest.RunResult) -> dict[str, str]:
    found = {}
    for line in result.outlines:
        for name in EXPECTED:
            if f"::{name} " in line:
                for word in ("PASSED", "FAILED"):
                    if word in line:
                        found[name] = word.lower()
    return found


@pytest.mark.parametrize("mode", ["serial", "xdist"])
def test_jobs_run_on_gangs_with_the_harness_verdicts(modelopt_suite, run_pytest, mode):
    xdist = ("-n", "2", "--dist", "megatron") if mode == "xdist" else ()
    # Two devices: under xdist each worker's home device is in the other's gang of 2.
    result = run_pytest("-v", "--megatron-devices", "cpu:2", *xdist, timeout=240)
    output = result.stdout.str()
    assert outcomes(result) == EXPECTED, output
    assert "ValueError: the job's own failure on rank 1" in output  # the job's traceback
    assert "the job failed on rank(s) 1" in output
    assert "SIGKILL" in output or "signal 9" in output  # the death, named
    assert "time.sleep(600)" in output  # the hung rank's stack
    assert 'KeyError: "the pool\'s job fails on rank 0"' in output
    assert "spawn harnesses on gangs: spawn_multiprocess_job 11 tests" in output
    if mode == "serial":
        counts = "11 jobs on gangs; spawned: 1 size over the devices"
        assert f"Model-Optimizer spawn_multiprocess_job: {counts}" in output
