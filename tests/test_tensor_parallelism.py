"""Lesson 08 (helpers.tensor_parallelism): the lecture's forward as it is and rebuilt; the paper's
MLP and a transformer block, tensor-parallel with and without sequence parallelism, equal to the
dense module forward and backward and to PyTorch's parallelize_module; the bytes sent and the
activations kept against their formulas; the exercises."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.distributed as dist
from checker import expect_rejection
from compare import labelled
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from helpers import WorkerError, reference, run, spawn
from helpers.cost_model import BUSBW_FACTORS
from helpers.instrument import saved_activations, saved_bytes
from helpers.tensor_parallelism import checks, cost, lecture, megatron, memory, plots, workers
from helpers.tensor_parallelism.checks import dense

# Results that are numbers: `make test` runs these again on other CPU kernels (Makefile).
pytestmark = pytest.mark.numerical

B, S, H, HEADS = 2, 8, 32, 4


def block_case(seed=0):
    return (reference.make_block(H, HEADS, seed), reference.seeded_randn(seed + 1, B, S, H),
            reference.seeded_randn(seed + 2, B, S, H))


def assert_like_dense(results, expected, sequence_parallel):
    world_size = len(results)
    for rank, got in enumerate(results):
        output, input_grad, grads = checks.rank_views(expected, rank, world_size,
                                                      sequence_parallel)
        torch.testing.assert_close(got["output"], output)
        torch.testing.assert_close(got["input_grad"], input_grad)
        assert list(got["grads"]) == list(grads)
        for name, grad in grads.items():
            torch.testing.assert_close(got["grads"][name], grad,
                                       msg=labelled(f"rank {rank}: {name}"))


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_lectures_forward_runs_unchanged_and_repeats_one_block(world_size):
    data = reference.seeded_randn(0, 4, 16)
    result = spawn(lecture.tensor_parallelism_main, args=(world_size, data, 2), nprocs=world_size,
                   show_output=False)
    expected = lecture.lecture_forward(data, 2, world_size)
    for rank in range(world_size):
        assert result.stdout[rank].strip() == (
            f"[tensor_parallelism] Rank {rank}: forward pass produced activations "
            f"{lecture.summarize_tensor(expected)}")
    blocks = expected.chunk(world_size, dim=1)
    assert all(torch.equal(block, blocks[0]) for block in blocks)  # copies of one block
    assert not torch.allclose(expected, lecture.dense_forward(data, 2))


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_rebuilt_forward_equals_the_dense_one(world_size):
    data = reference.seeded_randn(0, 4, 16)
    out = run(lecture.sliced_tensor_parallelism, world_size, args=(data, 3), show_output=False)
    for x in out:
        torch.testing.assert_close(x, lecture.dense_forward(data, 3))


def mlp_case(width, bias, seed=0):
    feed_forward = reference.seeded(seed, lambda: reference.FeedForward(width))
    if not bias:
        feed_forward.up.bias = feed_forward.down.bias = None
    return (feed_forward, reference.seeded_randn(seed + 1, 3, width),
            reference.seeded_randn(seed + 2, 3, width))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("world_size,width", [(2, 6), (4, 8), (4, 5)])
def test_the_papers_mlp_equals_the_dense_one_forward_and_backward(world_size, width, bias):
    """Every shard's gradient is its slice of the dense gradient; one all-reduce of the
    activations forward (g) and one backward (f), of 2(t-1)/t x their bytes each."""
    feed_forward, inputs, targets = mlp_case(width, bias)
    out = run(workers.mlp_worker, world_size, args=(feed_forward, inputs, targets),
              show_output=False)
    assert_like_dense(out, dense(feed_forward, inputs, targets), sequence_parallel=False)
    activation_bytes = inputs.numel() * 4
    for got in out:
        for direction in ("forward", "backward"):
            assert got["calls"][direction] == {"all_reduce": 1}
            assert got["sent"][direction]["all_reduce"] == pytest.approx(
                2 * (world_size - 1) / world_size * activation_bytes)


def block_communication(sequence_parallel):
    """{direction: {collective: calls}} of one block, and the bytes of the activations' and the
    partial gradients' collectives."""
    if not sequence_parallel:
        calls = {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    else:  # and in backward, the LayerNorms' 4 gradients and the 2 row-parallel biases summed
        calls = {"forward": {"all_gather_single": 2, "reduce_scatter_single": 2},
                 "backward": {"all_gather_single": 2, "reduce_scatter_single": 2,
                              "all_reduce": 6}}
    return calls


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_tensor_parallel_block_equals_the_dense_one(world_size, sequence_parallel):
    block, inputs, targets = block_case()
    out = run(workers.block_worker, world_size, show_output=False, kwargs=dict(
        block=block, inputs=inputs, targets=targets, sequence_parallel=sequence_parallel))
    assert_like_dense(out, dense(block, inputs, targets), sequence_parallel)
    activations = B * S * H * 4
    for got in out:
        for direction, counts in block_communication(sequence_parallel).items():
            assert got["calls"][direction] == counts
            # the activations' collectives send what four all-reduces would, with or without SP
            sent = sum(got["sent"][direction].get(name, 0) for name in (
                "all_gather_single", "reduce_scatter_single"))
            if not sequence_parallel:
                sent = got["sent"][direction]["all_reduce"]
            assert sent == pytest.approx(2 * BUSBW_FACTORS["all_reduce"](world_size)
                                         * activations)
        if sequence_parallel:  # 4 LayerNorm parameters and 2 biases of h elements each
            assert got["sent"]["backward"]["all_reduce"] == pytest.approx(
                6 * BUSBW_FACTORS["all_reduce"](world_size) * H * 4)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_activations_kept_equal_the_formula(sequence_parallel):
    block, inputs, targets = block_case()
    with saved_activations(block) as saved:
        block(inputs.clone().requires_grad_())
    assert saved_bytes(saved) == sum(memory.block_formula(S, B, H, HEADS).values())
    for world_size in (2, 4):
        out = run(workers.block_worker, world_size, show_output=False, kwargs=dict(
            block=block, inputs=inputs, targets=targets, sequence_parallel=sequence_parallel))
        formula = memory.block_formula(S, B, H, HEADS, world_size, sequence_parallel)
        assert [got["activation_bytes"] for got in out] == [sum(formula.values())] * world_size


def test_sequence_parallelism_keeps_fewer_activations_and_the_paper_agrees():
    for t in (2, 4, 8):
        ours = [sum(memory.block_formula(S, B, H, HEADS, t, sp).values()) for sp in (False, True)]
        paper = [memory.paper_formula(S, B, H, HEADS, t, sp) for sp in (False, True)]
        assert ours[1] < ours[0] and paper[1] < paper[0]
    # with one rank both are the whole layer: the paper's 34 sbh + 5 a s^2 b
    assert memory.paper_formula(S, B, H, HEADS, 1, True) == memory.paper_formula(S, B, H, HEADS)
    assert memory.paper_formula(S, B, H, HEADS) == S * B * H * 34 + 5 * HEADS * S * S * B


def accumulating_worker(rank, world_size, block, inputs, targets):
    parallel = megatron.parallelize_block(block, sequence_parallel=True)
    local = megatron.sequence_shard(inputs, rank, world_size)
    for _ in range(2):
        out = parallel(local)
        ((out - megatron.sequence_shard(targets, rank, world_size)).square().sum()
         / targets.numel()).backward()
    return {name: param.grad for name, param in parallel.named_parameters()}


def test_sequence_parallel_gradients_accumulate_over_two_backwards():
    """The partial gradients are summed before they are accumulated: two backwards give twice
    the dense gradient, not the first one summed twice."""
    block, inputs, targets = block_case()
    _, _, grads = dense(block, inputs, targets)
    out = run(accumulating_worker, 2, args=(block, inputs, targets), show_output=False)
    for rank, got in enumerate(out):
        for name, grad in grads.items():
            torch.testing.assert_close(got[name],
                                       2 * megatron.shard_of_gradient(name, grad, rank, 2))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_pytorchs_parallelize_module_gives_the_same_block(sequence_parallel):
    block, inputs, targets = block_case()
    expected = dense(block, inputs, targets)
    out = run(workers.torch_block_worker, 2, show_output=False, kwargs=dict(
        block=block, inputs=inputs, targets=targets, sequence_parallel=sequence_parallel))
    hand = run(workers.block_worker, 2, show_output=False, kwargs=dict(
        block=block, inputs=inputs, targets=targets, sequence_parallel=sequence_parallel))
    assert_like_dense(out, expected, sequence_parallel)
    for ours, theirs in zip(hand, out):
        torch.testing.assert_close(ours["output"], theirs["output"])
    placements = out[0]["placements"]
    assert placements["attention.q.weight"] == ("Shard(dim=0)",)
    assert placements["feed_forward.down.weight"] == ("Shard(dim=1)",)
    assert placements["norm1.weight"] == (("Partial(sum)",) if sequence_parallel else ())


def test_a_head_count_the_ranks_do_not_divide_is_refused():
    block, inputs, targets = block_case()
    with pytest.raises(WorkerError, match="32 features do not split over 3 ranks"):
        run(workers.block_worker, 3, args=(block, inputs, targets), show_output=False)


def test_the_flop_count_is_what_the_block_computes():
    """PyTorch's FlopCounterMode, with the attention computed by plain matrix products."""
    block = reference.make_block(H, HEADS)
    inputs = reference.seeded_randn(1, B, S, H).requires_grad_()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        block(inputs).sum().backward()
    assert counter.get_total_flops() == cost.layer_flops(S, B, H)


def test_the_projection_divides_the_formulas_by_the_published_peaks():
    seconds = cost.projected_layer_seconds(2048, 1, 12288, 8, "NVLink 4 (H100, H200)")
    assert seconds["communication"] == pytest.approx(4 * 2 * 7 / 8 * 2048 * 12288 * 2 / 450e9)
    assert seconds["compute"] == pytest.approx(cost.layer_flops(2048, 1, 12288) / 8 / 989e12)
    with pytest.raises(KeyError, match="is not among"):
        cost.projected_layer_seconds(2048, 1, 12288, 8, "carrier pigeon")


def test_the_communication_share_is_measured_inside_the_step():
    step, communication = run(workers.communication_share_worker, 2, show_output=False,
                              kwargs=dict(dim=32, heads=4, batch=2, seq_len=8, iterations=2))[0]
    assert 0 < communication < step


@pytest.mark.once  # no rounding changes what it checks
def test_the_pictures_draw():
    block, inputs, targets = block_case()
    data = reference.seeded_randn(0, 4, 16)
    figures = [
        plots.plot_outputs({"lecture": lecture.lecture_forward(data, 2, 2),
                            "dense": lecture.dense_forward(data, 2)}, 2),
        plots.plot_sharded_mlp(2),
        plots.plot_activation_memory({(1, False): 1e4, (2, False): 8e3, (2, True): 6e3},
                                     S, B, H, HEADS),
        plots.plot_communication_share({2: {32: (1.0, 0.5), 64: (2.0, 0.5)}}, 2048, 1,
                                       [1024, 4096], ["NVLink 4 (H100, H200)"]),
    ]
    assert all(figure.axes for figure in figures)


# The exercises: a typical mistake each checker must reject.

def forward_with_the_bias_on_every_rank(rank, world_size, x, up_rows, up_bias, down_columns,
                                        down_bias):
    import torch.distributed as dist
    import torch.nn.functional as F

    z = F.gelu(F.linear(x, up_rows, up_bias)) @ down_columns.T + down_bias
    dist.all_reduce(z)  # the bias is summed n times
    return z


def forward_gathering_the_hidden_features(rank, world_size, x, up_rows, up_bias, down_columns,
                                          down_bias):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    hidden = F.gelu(F.linear(x, up_rows, up_bias))
    pieces = [torch.empty_like(hidden) for _ in range(world_size)]
    dist.all_gather(pieces, hidden)
    return torch.cat(pieces, dim=1) @ torch.cat([down_columns] * world_size, dim=1).T


def backward_without_summing_x(rank, world_size, x, up_rows, up_bias, down_columns, down_bias,
                               grad_z):
    import torch.distributed as dist
    import torch.nn.functional as F

    shards = [t.clone().requires_grad_() for t in (x, up_rows, up_bias, down_columns, down_bias)]
    x, up_rows, up_bias, down_columns, down_bias = shards
    (F.gelu(F.linear(x, up_rows, up_bias)) @ down_columns.T + down_bias).backward(grad_z)
    dist.all_reduce(down_bias.grad)  # summed, but the wrong one
    return tuple(shard.grad for shard in shards)


def sp_linear_keeping_the_gathered_x(rank, world_size, x_tokens, weight_rows, grad_y):
    import torch
    import torch.distributed as dist

    pieces = x_tokens.transpose(0, 1).contiguous()
    whole = pieces.new_empty(pieces.shape[0] * world_size, *pieces.shape[1:])
    dist.all_gather_single(whole, pieces)
    x = whole.transpose(0, 1)
    grad_x = (grad_y @ weight_rows).transpose(0, 1).contiguous()
    mine = grad_x.new_empty(grad_x.shape[0] // world_size, *grad_x.shape[1:])
    dist.reduce_scatter_single(mine, grad_x)
    return x @ weight_rows.T, mine.transpose(0, 1), torch.einsum("bso,bsh->oh", grad_y, x)


def sp_linear_gathering_the_batch(rank, world_size, x_tokens, weight_rows, grad_y):
    import torch
    import torch.distributed as dist

    def gather():  # along dimension 0 as it comes: the batch, not the tokens
        whole = x_tokens.new_empty(x_tokens.shape[0] * world_size, *x_tokens.shape[1:])
        dist.all_gather_single(whole, x_tokens.contiguous())
        return whole.view(x_tokens.shape[0], -1, x_tokens.shape[2])

    y = gather() @ weight_rows.T
    x = gather()
    grad_x = (grad_y @ weight_rows).contiguous()
    mine = grad_x.new_empty(grad_x.shape[0], grad_x.shape[1] // world_size, grad_x.shape[2])
    dist.reduce_scatter_single(mine, grad_x.view(-1, *mine.shape[1:]))
    return y, mine, torch.einsum("bso,bsh->oh", grad_y, x)


@pytest.mark.parametrize("name,mistake,says", [
    ("tp_mlp_forward", forward_with_the_bias_on_every_rank, "On 2 ranks, rank 0:"),
    ("tp_mlp_forward", forward_with_the_bias_on_every_rank,
     "Your output holds down's bias 2 times: every rank added it before the all_reduce"),
    ("tp_mlp_forward", forward_gathering_the_hidden_features,
     "Your code called dist.all_gather()."),
    ("tp_mlp_backward", backward_without_summing_x, "one all_reduce, of x's gradient"),
    ("sequence_parallel_linear", sp_linear_keeping_the_gathered_x,
     "gather x's tokens twice: for the forward, and again for the backward"),
    ("sequence_parallel_linear", sp_linear_gathering_the_batch, "On 2 ranks, rank 0:"),
])
def test_checker_rejects_a_typical_mistake(name, mistake, says):
    expect_rejection(name, mistake, says)


def test_one_plan_cuts_the_block_for_the_hand_built_layers_the_slices_and_pytorch():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert megatron.BLOCK_PLAN == {  # Megatron-LM's MLP and attention (the paper's §3)
        "attention.q": "column", "attention.k": "column", "attention.v": "column",
        "attention.out": "row", "feed_forward.up": "column", "feed_forward.down": "row"}
    plan = megatron.torch_plan(sequence_parallel=False)
    assert {name: type(style) for name, style in plan.items()} == {
        name: ColwiseParallel if style == "column" else RowwiseParallel
        for name, style in megatron.BLOCK_PLAN.items()}
    layers = run(layer_types_worker, 2, show_output=False)[0]
    assert layers == {name: "ColumnParallelLinear" if style == "column" else "RowParallelLinear"
                      for name, style in megatron.BLOCK_PLAN.items()}
    for name, style in [("blocks.1.attention.k", "column"), ("down", "row"), ("norm1", None)]:
        assert megatron.plan_style(name) == style


def layer_types_worker(rank, world_size):
    parallel = megatron.parallelize_block(reference.make_block(8, 2))
    return {name: type(parallel.get_submodule(name)).__name__ for name in megatron.BLOCK_PLAN}


def embedding_by_gathering_the_table(rank, world_size, rows, vocab, ids):
    table = rows.new_empty(vocab, rows.shape[1])
    dist.all_gather_single(table, rows)
    return table[ids]


def embedding_without_the_mask(rank, world_size, rows, vocab, ids):
    first = rank * rows.shape[0]
    embedded = rows[(ids - first).clamp(0, rows.shape[0] - 1)]  # other ranks' ids land on an end
    dist.all_reduce(embedded)
    return embedded


@pytest.mark.parametrize("mistake, says", [
    (embedding_by_gathering_the_table, "the task says: communicate with all_reduce only"),
    (embedding_without_the_mask, "On 2 ranks, rank 0: elements"),
])
def test_vocab_parallel_embedding_checker_rejects_a_typical_mistake(mistake, says):
    expect_rejection("vocab_parallel_embedding", mistake, says)
