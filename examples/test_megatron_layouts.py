"""megatron-core parallel_state layouts on gangs of 2, 4 and 8 ranks, set up by the plugin.

Each layout is a parameter carrying `@pytest.mark.world_size(N)` and `@pytest.mark.megatron(...)`:
the plugin initialises `parallel_state` before the first test of a layout and keeps it for the
next tests of the same layout, so the tests never call `initialize_model_parallel` (nor destroy
it). `scope="module"` makes pytest order the items by layout, so all tests of one layout run one
after the other and share that one initialisation.
"""

import pytest
import torch
import torch.distributed as dist
from megatron_ranks import Layout

parallel_state = pytest.importorskip("megatron.core").parallel_state

LAYOUTS = [
    Layout(2, tp=2),
    Layout(2, pp=2),
    Layout(2, cp=2),
    Layout(4, tp=2),
    Layout(4, pp=2),
    Layout(4, tp=2, pp=2),
    Layout(4, tp=2, cp=2),
    Layout(8, tp=2, pp=2),
    Layout(8, tp=4, pp=2),
    Layout(8, tp=2, cp=2),
    Layout(8, tp=2, cp=2, pp=2),
]
by_layout = pytest.mark.parametrize("layout", [lay.param() for lay in LAYOUTS], scope="module")

# Each group parallel_state builds, with the dimensions its members differ in.
GROUPS = {
    "tensor": (parallel_state.get_tensor_model_parallel_group, ("tp",)),
    "context": (parallel_state.get_context_parallel_group, ("cp",)),
    "data": (parallel_state.get_data_parallel_group, ("dp",)),
    "data_with_cp": (
        lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
        ("cp", "dp"),
    ),
    "pipeline": (parallel_state.get_pipeline_model_parallel_group, ("pp",)),
    "model": (parallel_state.get_model_parallel_group, ("tp", "pp")),
    "tensor_and_data": (parallel_state.get_tensor_and_data_parallel_group, ("tp", "dp")),
    "tensor_and_context": (parallel_state.get_tensor_and_context_parallel_group, ("tp", "cp")),
}


@by_layout
def test_group_memberships(layout, rank, world_size):
    assert parallel_state.model_parallel_is_initialized()
    assert layout.world_size == world_size
    built = {name: dist.get_process_group_ranks(get()) for name, (get, _) in GROUPS.items()}
    expected = {name: layout.group(rank, *dims) for name, (_, dims) in GROUPS.items()}
    assert built == expected


@by_layout
def test_ranks_and_sizes_within_groups(layout, rank):
    ps = parallel_state
    reported = {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        "cp": (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
    }
    expected = {}
    for dim in reported:
        members = layout.group(rank, dim)
        expected[dim] = (members.index(rank), len(members))
    assert reported == expected
    assert ps.get_tensor_model_parallel_src_rank() == layout.group(rank, "tp")[0]
    assert ps.get_data_parallel_src_rank() == layout.group(rank, "dp")[0]


@by_layout
def test_pipeline_stages_and_embedding_ranks(layout, rank):
    """The embedding groups tie the word embeddings of the first and the last stage together."""
    ps = parallel_state
    pipeline = layout.group(rank, "pp")
    stage = pipeline.index(rank)
    assert ps.is_pipeline_first_stage() == (stage == 0)
    assert ps.is_pipeline_last_stage() == (stage == layout.pp - 1)
    assert ps.get_pipeline_model_parallel_first_rank() == pipeline[0]
    assert ps.get_pipeline_model_parallel_last_rank() == pipeline[-1]
    assert ps.get_pipeline_model_parallel_next_rank() == pipeline[(stage + 1) % layout.pp]
    assert ps.get_pipeline_model_parallel_prev_rank() == pipeline[(stage - 1) % layout.pp]
    assert ps.is_rank_in_embedding_group() == (rank in {pipeline[0], pipeline[-1]})
    assert ps.is_rank_in_position_embedding_group() == (rank == pipeline[0])


@by_layout
def test_collectives_stay_inside_their_groups(layout, rank, device):
    for name in ("tensor", "data", "pipeline", "model"):
        get, dims = GROUPS[name]
        total = torch.tensor([rank + 1.0], device=device)
        dist.all_reduce(total, group=get())
        assert total.item() == sum(r + 1 for r in layout.group(rank, *dims)), name


@by_layout
def test_activations_travel_down_the_pipeline(layout, rank, device):
    """One pipeline step: every stage sends to the next and receives from the previous one."""
    if layout.pp == 1:
        assert parallel_state.get_pipeline_model_parallel_next_rank() == rank
        return
    sent = torch.full((2, 3), float(rank), device=device)
    received = torch.empty_like(sent)
    ops = [
        dist.P2POp(dist.isend, sent, parallel_state.get_pipeline_model_parallel_next_rank()),
        dist.P2POp(dist.irecv, received, parallel_state.get_pipeline_model_parallel_prev_rank()),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    pipeline = layout.group(rank, "pp")
    previous = pipeline[(pipeline.index(rank) - 1) % layout.pp]
    assert torch.equal(received, torch.full_like(sent, float(previous)))
