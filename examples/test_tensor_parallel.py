"""megatron-core tensor-parallel layers against dense torch references, forward and backward.

Every rank builds the same dense tensors from a seeded generator; megatron keeps each rank's shard
of the weights (`use_cpu_initialization=True` initialises the full matrix and splits it, the path
that works without a GPU) and the test checks the shard's outputs and gradients against slices of
the dense computation. The layers run on the `device` fixture, so the same tests check NCCL on GPUs.

Some megatron paths allocate on `torch.cuda.current_device()` (gather_output=True, sequence
parallelism) or seed CUDA generators (the RNG tracker): those tests are skipped without CUDA.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron_ranks import Layout

mcore = pytest.importorskip("megatron.core")
parallel_state, tensor_parallel = mcore.parallel_state, mcore.tensor_parallel

try:
    import transformer_engine.pytorch as te
except Exception:  # a broken install raises RuntimeError or FileNotFoundError, not ImportError
    te = None

SEQUENCE, BATCH, VOCAB = 8, 2, 32

LAYOUTS = [Layout(2, tp=2), Layout(4, tp=4), Layout(4, tp=2)]
by_layout = pytest.mark.parametrize("layout", [lay.param() for lay in LAYOUTS], scope="module")
needs_cuda = functools.partial(pytest.mark.skipif, not torch.cuda.is_available())
close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)


def dense(*shapes, seed=0):
    """Random tensors that are the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def shard(tensor, dim):
    """This rank's tensor-parallel slice of a dense tensor."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return tensor.chunk(tp, dim)[parallel_state.get_tensor_model_parallel_rank()]


def writes(full):
    """An init_method that fills megatron's full master weight with `full`."""

    def init(master_weight):
        master_weight.copy_(full)

    return init


def reference(fn, grad_output, *inputs):
    """Output of `fn` on dense inputs and the gradients of those inputs."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_output)
    return out.detach(), [leaf.grad for leaf in leaves]


def config(**overrides):
    return mcore.ModelParallelConfig(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,
        **overrides,
    )


class ParallelMLP(torch.nn.Module):
    """Megatron's MLP pattern: column-parallel h -> 4h, gelu, row-parallel 4h -> h; the only
    communication is the row layer's all-reduce (and the column layer's one in backward)."""

    def __init__(self, w1, b1, w2, b2, cfg):
        super().__init__()
        hidden, ffn = w1.shape[1], w1.shape[0]
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            hidden, ffn, config=cfg, init_method=writes(w1), bias=True, gather_output=False
        )
        self.fc2 = tensor_parallel.RowParallelLinear(
            ffn,
            hidden,
            config=cfg,
            init_method=writes(w2),
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
        )
        with torch.no_grad():  # megatron initialises biases to zero
            self.fc1.bias.copy_(shard(b1, 0))
            self.fc2.bias.copy_(b2)

    def forward(self, x):
        hidden, _ = self.fc1(x)
        out, _ = self.fc2(F.gelu(hidden))
        return out


def dense_mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


@by_layout
def test_column_parallel_linear(layout, hidden_size, device):
    ffn = 4 * hidden_size
    weight, bias, x, grad = dense(
        (ffn, hidden_size), (ffn,), (SEQUENCE, BATCH, hidden_size), (SEQUENCE, BATCH, ffn)
    )
    layer = tensor_parallel.ColumnParallelLinear(
        hidden_size,
        ffn,
        config=config(),
        init_method=writes(weight),
        bias=True,
        gather_output=False,  # gathering the output is the CUDA-only path, tested below
    ).to(device)
    with torch.no_grad():  # megatron initialises biases to zero
        layer.bias.copy_(shard(bias, 0))
    x_local = x.to(device).requires_grad_()
    out, _ = layer(x_local)
    out.backward(shard(grad, -1).to(device))

    expected, (x_grad, w_grad, b_grad) = reference(F.linear, grad, x, weight, bias)
    close(out.cpu(), shard(expected, -1))
    close(layer.weight.grad.cpu(), shard(w_grad, 0))
    close(layer.bias.grad.cpu(), shard(b_grad, 0))
    close(x_local.grad.cpu(), x_grad)  # the layer all-reduces the input gradient


@by_layout
def test_row_parallel_linear(layout, hidden_size, device):
    ffn = 4 * hidden_size
    weight, bias, x, grad = dense(
        (hidden_size, ffn), (hidden_size,), (SEQUENCE, BATCH, ffn), (SEQUENCE, BATCH, hidden_size)
    )
    layer = tensor_parallel.RowParallelLinear(
        ffn,
        hidden_size,
        config=config(),
        init_method=writes(weight),
        bias=True,
        input_is_parallel=True,  # the other path scatters in megatron's CUDA-only helper
        skip_bias_add=False,
    ).to(device)
    with torch.no_grad():
        layer.bias.copy_(bias)
    x_local = shard(x, -1).to(device).requires_grad_()
    out, _ = layer(x_local)
    out.backward(grad.to(device))

    expected, (x_grad, w_grad, b_grad) = reference(F.linear, grad, x, weight, bias)
    close(out.cpu(), expected)  # the partial products are all-reduced, then the bias added
    close(layer.weight.grad.cpu(), shard(w_grad, 1))
    close(layer.bias.grad.cpu(), b_grad)
    close(x_local.grad.cpu(), shard(x_grad, -1))


@by_layout
def test_tensor_parallel_mlp_block(layout, hidden_size, device):
    ffn = 4 * hidden_size
    w1, b1, w2, b2, x, grad = dense(
        (ffn, hidden_size),
        (ffn,),
        (hidden_size, ffn),
        (hidden_size,),
        (SEQUENCE, BATCH, hidden_size),
        (SEQUENCE, BATCH, hidden_size),
    )
    mlp = ParallelMLP(w1, b1, w2, b2, config()).to(device)
    x_local = x.to(device).requires_grad_()
    out = mlp(x_local)
    out.backward(grad.to(device))

    expected, (x_grad, w1_grad, b1_grad, w2_grad, b2_grad) = reference(
        dense_mlp, grad, x, w1, b1, w2, b2
    )
    close(out.cpu(), expected)
    close(x_local.grad.cpu(), x_grad)
    close(mlp.fc1.weight.grad.cpu(), shard(w1_grad, 0))
    close(mlp.fc1.bias.grad.cpu(), shard(b1_grad, 0))
    close(mlp.fc2.weight.grad.cpu(), shard(w2_grad, 1))
    close(mlp.fc2.bias.grad.cpu(), b2_grad)


@by_layout
def test_vocab_parallel_embedding(layout, hidden_size, device):
    (table, grad) = dense((VOCAB, hidden_size), (BATCH, SEQUENCE, hidden_size))
    tokens = torch.randint(VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    embedding = tensor_parallel.VocabParallelEmbedding(
        VOCAB, hidden_size, init_method=writes(table), config=config()
    ).to(device)
    out = embedding(tokens.to(device))  # each rank looks up its rows; the sum completes them
    out.backward(grad.to(device))

    expected, (table_grad,) = reference(lambda t: F.embedding(tokens, t), grad, table)
    close(out.cpu(), expected)
    close(embedding.weight.grad.cpu(), shard(table_grad, 0))


@by_layout
def test_vocab_parallel_cross_entropy(layout, device):
    (logits, grad) = dense((SEQUENCE, BATCH, VOCAB), (SEQUENCE, BATCH))
    target = torch.randint(VOCAB, (SEQUENCE, BATCH), generator=torch.Generator().manual_seed(1))
    # megatron overwrites the logits it is given (in place, to save memory): hand it its own copy
    logits_local = shard(logits, -1).to(device, copy=True).requires_grad_()
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits_local, target.to(device))
    loss.backward(grad.to(device))

    def cross_entropy(full):
        return F.cross_entropy(full.flatten(0, 1), target.flatten(), reduction="none").view_as(
            target
        )

    expected, (logits_grad,) = reference(cross_entropy, grad, logits)
    close(loss.cpu(), expected)
    close(logits_local.grad.cpu(), shard(logits_grad, -1))


# -- CUDA-only paths: skipped on CPU, checked on GPUs ---------------------------------------------


@needs_cuda(reason="gather_output=True allocates its output on torch.cuda.current_device()")
@pytest.mark.world_size(2)
@pytest.mark.megatron(tp=2)
def test_column_parallel_linear_gather_output(hidden_size, device):
    ffn = 4 * hidden_size
    weight, x, grad = dense(
        (ffn, hidden_size), (SEQUENCE, BATCH, hidden_size), (SEQUENCE, BATCH, ffn)
    )
    layer = tensor_parallel.ColumnParallelLinear(
        hidden_size,
        ffn,
        config=config(),
        init_method=writes(weight),
        bias=False,
        gather_output=True,
    ).to(device)
    x_local = x.to(device).requires_grad_()
    out, _ = layer(x_local)
    out.backward(grad.to(device))  # every rank holds the full output and its full gradient

    expected, (x_grad, w_grad) = reference(F.linear, grad, x, weight)
    close(out.cpu(), expected)
    close(layer.weight.grad.cpu(), shard(w_grad, 0))
    close(x_local.grad.cpu(), x_grad)


@needs_cuda(reason="sequence parallelism gathers into megatron's global memory buffer, on CUDA")
@pytest.mark.world_size(2, 4)
@pytest.mark.megatron(tp=2)
def test_sequence_parallel_mlp_block(hidden_size, device):
    """With sequence parallelism activations outside the MLP are split along the sequence: the
    column layer all-gathers them, the row layer reduce-scatters its output."""
    ffn = 4 * hidden_size
    w1, b1, w2, b2, x, grad = dense(
        (ffn, hidden_size),
        (ffn,),
        (hidden_size, ffn),
        (hidden_size,),
        (SEQUENCE, BATCH, hidden_size),
        (SEQUENCE, BATCH, hidden_size),
    )
    mlp = ParallelMLP(w1, b1, w2, b2, config(sequence_parallel=True)).to(device)
    x_local = shard(x, 0).to(device).requires_grad_()
    out = mlp(x_local)
    out.backward(shard(grad, 0).to(device))

    expected, (x_grad, w1_grad, _, w2_grad, b2_grad) = reference(dense_mlp, grad, x, w1, b1, w2, b2)
    close(out.cpu(), shard(expected, 0))
    close(x_local.grad.cpu(), shard(x_grad, 0))
    close(mlp.fc1.weight.grad.cpu(), shard(w1_grad, 0))
    close(mlp.fc2.weight.grad.cpu(), shard(w2_grad, 1))
    # fc2's bias sees only this rank's tokens: megatron marks it `sequence_parallel` and sums its
    # gradient over the tensor-parallel group when it finalises gradients.
    assert mlp.fc2.bias.sequence_parallel
    bias_grad = mlp.fc2.bias.grad.clone()
    dist.all_reduce(bias_grad, group=parallel_state.get_tensor_model_parallel_group())
    close(bias_grad.cpu(), b2_grad)


def _gather(tensor, group):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


@needs_cuda(reason="model_parallel_cuda_manual_seed and the CUDA RNG tracker seed CUDA generators")
@pytest.mark.world_size(2, 4)
@pytest.mark.megatron(tp=2)
def test_cuda_rng_tracker_forks_per_tensor_parallel_rank(device):
    """Dropout inside tensor-parallel regions must differ between the shards of a layer and agree
    between data-parallel replicas; outside them every rank draws the same numbers."""
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        in_region = torch.rand(16, device=device)
    outside = torch.rand(16, device=device)

    shards = _gather(in_region, parallel_state.get_tensor_model_parallel_group())
    assert not torch.equal(shards[0], shards[1])
    replicas = _gather(in_region, parallel_state.get_data_parallel_group())
    assert all(torch.equal(replica, in_region) for replica in replicas)
    everyone = _gather(outside, None)
    assert all(torch.equal(other, outside) for other in everyone)

    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(16, device=device), in_region)  # reseeding replays it


@pytest.mark.skipif(te is None, reason="transformer_engine is not installed or does not load")
@needs_cuda(reason="Transformer Engine layers run on CUDA only")
@pytest.mark.world_size(2)
@pytest.mark.megatron(tp=2)
def test_transformer_engine_linears_match_dense(hidden_size, device):
    """TE's own column/row parallel Linear on megatron's tensor-parallel group."""
    ffn = 4 * hidden_size
    w1, b1, w2, b2, x, grad = dense(
        (ffn, hidden_size),
        (ffn,),
        (hidden_size, ffn),
        (hidden_size,),
        (SEQUENCE, BATCH, hidden_size),
        (SEQUENCE, BATCH, hidden_size),
    )
    group = parallel_state.get_tensor_model_parallel_group()
    common = dict(bias=True, tp_group=group, params_dtype=torch.float32, device=device)
    fc1 = te.Linear(hidden_size, ffn, parallel_mode="column", **common)
    fc2 = te.Linear(ffn, hidden_size, parallel_mode="row", **common)
    with torch.no_grad():
        fc1.weight.copy_(shard(w1, 0))
        fc1.bias.copy_(shard(b1, 0))
        fc2.weight.copy_(shard(w2, 1))
        fc2.bias.copy_(b2)
    x_local = x.to(device).requires_grad_()
    out = fc2(F.gelu(fc1(x_local)))
    out.backward(grad.to(device))

    expected, (x_grad, w1_grad, _, w2_grad, _) = reference(dense_mlp, grad, x, w1, b1, w2, b2)
    te_close = functools.partial(torch.testing.assert_close, rtol=1e-2, atol=1e-2)  # TF32 GEMMs
    te_close(out.cpu(), expected)
    te_close(x_local.grad.cpu(), x_grad)
    te_close(fc1.weight.grad.cpu(), shard(w1_grad, 0))
    te_close(fc2.weight.grad.cpu(), shard(w2_grad, 1))
