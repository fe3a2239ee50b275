"""Plain torch.distributed collectives on gangs of several sizes (gloo on CPU, NCCL on GPUs)."""

import os

import pytest
import torch
import torch.distributed as dist

import xdist_megatron


@pytest.mark.world_size(2)
def test_all_reduce(rank, world_size, device):
    t = torch.full((1,), rank + 1.0, device=device)
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2


@pytest.mark.world_size(1, 2, 4)
def test_all_gather(rank, world_size, device):
    mine = torch.tensor([rank], device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    assert [t.item() for t in gathered] == list(range(world_size))


@pytest.mark.world_size(2)
def test_broadcast_from_last_rank(rank, world_size, device):
    t = torch.full((4,), float(rank), device=device)
    dist.broadcast(t, src=world_size - 1)
    assert torch.equal(t, torch.full((4,), float(world_size - 1), device=device))


@pytest.mark.world_size(2)
def test_subgroup_is_cleaned_up_after_the_test(rank):
    group = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == 2


@pytest.mark.world_size(2)
def test_torchrun_environment(rank, world_size, local_rank):
    assert int(os.environ["RANK"]) == rank
    assert int(os.environ["WORLD_SIZE"]) == world_size
    assert int(os.environ["LOCAL_RANK"]) == local_rank
    assert os.environ["XDIST_MEGATRON_DEVICES"].count(",") == world_size - 1


def _rank_and_sum(values):
    info = xdist_megatron.rank_info()
    return info.rank, sum(values)


@pytest.mark.world_size(2)
def test_explicit_style(gang):
    assert gang.run(_rank_and_sum, [1, 2, 3]) == [(0, 6), (1, 6)]


@pytest.mark.world_size(2)
def test_conftest_fixture_on_the_ranks(hidden_size, rank):
    weight = torch.full((hidden_size,), float(rank))
    dist.all_reduce(weight)
    assert weight.sum().item() == hidden_size * 1.0
