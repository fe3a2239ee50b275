"""megatron-core initialised in the test body, for options `@pytest.mark.megatron` does not take
(rank order, virtual pipeline stages, expert tensor parallelism).

No marker here: the test calls `initialize_model_parallel` itself and the plugin tears the state
down after the test (every rank, process groups included), so the next test starts clean.
"""

import pytest
import torch.distributed as dist
from megatron_ranks import ranks_sharing

parallel_state = pytest.importorskip("megatron.core").parallel_state


@pytest.mark.world_size(8)
def test_pipeline_before_data_rank_order(rank):
    """order="tp-pp-dp" puts pipeline stages next to each other and data parallelism outermost."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-pp-dp"
    )
    sizes = {"tp": 2, "pp": 2, "dp": 2}
    assert dist.get_process_group_ranks(
        parallel_state.get_pipeline_model_parallel_group()
    ) == ranks_sharing(rank, sizes, "pp")
    assert dist.get_process_group_ranks(parallel_state.get_data_parallel_group()) == ranks_sharing(
        rank, sizes, "dp"
    )
    assert parallel_state.get_data_parallel_rank() == rank // 4


@pytest.mark.world_size(8)
def test_expert_parallel_groups(rank):
    """Experts get their own tensor-parallel size: dense layers tp=2, experts tp=1 over ep=4."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1
    )
    expert_sizes = {"tp": 1, "ep": 4, "dp": 2, "pp": 1}  # the expert ranks follow "tp-ep-dp-pp"
    built = {
        "ep": parallel_state.get_expert_model_parallel_group(),
        "tp": parallel_state.get_expert_tensor_parallel_group(),
        "dp": parallel_state.get_expert_data_parallel_group(),
    }
    for dim, group in built.items():
        assert dist.get_process_group_ranks(group) == ranks_sharing(rank, expert_sizes, dim), dim
    assert parallel_state.get_expert_model_parallel_rank() == rank % 4
    assert parallel_state.get_tensor_model_parallel_world_size() == 2


@pytest.mark.world_size(4)
def test_virtual_pipeline_stages(rank):
    """With interleaving each rank holds two model chunks; only the first chunk of the first
    stage and the last chunk of the last stage are the pipeline's ends."""
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    stage = rank // 2  # tp=1, dp=2: ranks 0, 1 are stage 0
    assert parallel_state.get_virtual_pipeline_model_parallel_world_size() == 2
    firsts = [parallel_state.is_pipeline_first_stage(False, vp_stage=vp) for vp in (0, 1)]
    lasts = [parallel_state.is_pipeline_last_stage(False, vp_stage=vp) for vp in (0, 1)]
    assert firsts == [stage == 0, False]
    assert lasts == [False, stage == 1]


@pytest.mark.world_size(2)
def test_tensor_parallel_in_body(rank):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    assert parallel_state.get_tensor_model_parallel_rank() == rank


@pytest.mark.world_size(2)
def test_state_from_the_last_test_is_gone():
    assert not parallel_state.model_parallel_is_initialized()
    assert dist.is_initialized()  # the gang's default group stays
