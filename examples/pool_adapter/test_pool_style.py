"""Tests in Model-Optimizer's pool style (`dist_workers.run(partial(fn, ...))`, `fn(rank, size)`
on every worker), run on gangs through this folder's conftest.py."""

from functools import partial

import torch
import torch.distributed as dist

import xdist_megatron


def _device() -> torch.device:
    return xdist_megatron.rank_info().device


def _all_reduce_sum(rank: int, size: int) -> None:
    value = torch.tensor([float(rank + 1)], device=_device())
    dist.all_reduce(value)
    assert value.item() == size * (size + 1) / 2


def _broadcast(src: int, rank: int, size: int) -> None:
    value = torch.tensor([float(rank)], device=_device())
    dist.broadcast(value, src=src % size)
    assert value.item() == src % size


def test_all_reduce_on_every_device(dist_workers):
    dist_workers.run(_all_reduce_sum)


def test_one_worker(dist_workers_size_1):
    dist_workers_size_1.run(_all_reduce_sum)


def test_broadcast_from_each_rank(dist_workers_size_2):
    for src in range(2):
        dist_workers_size_2.run(partial(_broadcast, src))


def test_four_workers(dist_workers_size_4):
    dist_workers_size_4.run(partial(_broadcast, 3))
