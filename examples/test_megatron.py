"""megatron-core on gangs: parallel state layouts and tensor-parallel layers (CPU init on CPU)."""

import pytest
import torch
import torch.distributed as dist

parallel_state = pytest.importorskip("megatron.core.parallel_state")
tensor_parallel = pytest.importorskip("megatron.core.tensor_parallel")


def _init(tp: int, pp: int = 1) -> None:
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )


@pytest.mark.world_size(2, 4)
def test_tensor_parallel_groups(rank, world_size):
    _init(tp=2)
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    assert parallel_state.get_tensor_model_parallel_rank() == rank % 2
    assert parallel_state.get_data_parallel_world_size() == world_size // 2
    members = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    assert members == [rank - rank % 2, rank - rank % 2 + 1]


@pytest.mark.world_size(4)
def test_pipeline_parallel_groups(rank):
    _init(tp=1, pp=2)
    assert parallel_state.get_pipeline_model_parallel_world_size() == 2
    members = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    assert rank in members and len(members) == 2


@pytest.mark.world_size(2)
def test_state_from_the_last_test_is_gone():
    assert not parallel_state.model_parallel_is_initialized()


def _config():
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)


@pytest.mark.world_size(2)
def test_column_parallel_linear_matches_dense(rank, hidden_size):
    _init(tp=2)
    torch.manual_seed(0)
    layer = tensor_parallel.ColumnParallelLinear(
        hidden_size,
        4 * hidden_size,
        config=_config(),
        init_method=torch.nn.init.xavier_normal_,
        bias=False,
        gather_output=False,
    )
    x = torch.randn(3, hidden_size)
    out, _ = layer(x)
    outs = [torch.empty_like(out) for _ in range(2)]
    shards = [torch.empty_like(layer.weight) for _ in range(2)]
    dist.all_gather(outs, out.detach())
    dist.all_gather(shards, layer.weight.detach())
    dense = torch.cat(shards, dim=0)
    torch.testing.assert_close(torch.cat(outs, dim=-1), x @ dense.t())
