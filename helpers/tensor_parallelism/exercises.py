"""Lesson 08's exercises, checked by `helpers.exercises.check(name, your_function)`.

The MLP cases: x is (batch, h), the same on every rank; up is Linear(h, 4h), down Linear(4h, h),
both with biases, drawn from seeds; a rank gets its shards of them, as ColumnParallelLinear and
RowParallelLinear keep them. The expected results come from the dense MLP and autograd, here in
the kernel.
"""

import torch
import torch.nn.functional as F

from helpers.exercises import Exercise
from helpers.reference import seeded_randn
from helpers.rules import CallSizes, Only

MLP_CASES = [(2, (0, 3, 8)), (4, (1, 5, 8)), (2, (2, 1, 4)), (4, (3, 2, 12))]  # (seed, batch, h)


def _mlp(seed, batch, h):
    """x, up's weight and bias, down's weight and bias, and the output's gradient."""
    return (seeded_randn(seed, batch, h), seeded_randn(seed + 1, 4 * h, h) / h ** 0.5,
            seeded_randn(seed + 2, 4 * h), seeded_randn(seed + 3, h, 4 * h) / (2 * h ** 0.5),
            seeded_randn(seed + 4, h), seeded_randn(seed + 5, batch, h))


def _mlp_shards(rank, world_size, seed, batch, h):
    x, up, up_bias, down, down_bias, grad_z = _mlp(seed, batch, h)
    part = 4 * h // world_size
    rows = slice(rank * part, (rank + 1) * part)
    return x, up[rows], up_bias[rows], down[:, rows], down_bias, grad_z


def _mlp_dense(seed, batch, h):
    """The dense MLP's output and the gradients of x and of every weight and bias."""
    x, up, up_bias, down, down_bias, grad_z = (t.clone().requires_grad_()
                                               for t in _mlp(seed, batch, h))
    z = F.linear(F.gelu(F.linear(x, up, up_bias)), down, down_bias)
    z.backward(grad_z.detach())
    return z.detach(), x.grad, up.grad, up_bias.grad, down.grad, down_bias.grad


def _forward_expected(rank, world_size, seed, batch, h):
    return _mlp_dense(seed, batch, h)[0]


def _bias_hint(got, expected, world_size, seed, batch, h):
    """The output with down's bias added on every rank before the all-reduce: n biases summed.
    (The tolerance is a hint's, not the check's: float32 sums of 4h products.)"""
    down_bias = _mlp(seed, batch, h)[4]
    if isinstance(got, torch.Tensor) and got.shape == expected.shape and torch.allclose(
            got, expected + (world_size - 1) * down_bias, rtol=1e-4, atol=1e-5):
        return (f"Your output holds down's bias {world_size} times: every rank added it before "
                "the all_reduce, which then summed them. Add it once, after the sum.")
    return None


def _backward_expected(rank, world_size, seed, batch, h):
    _, grad_x, grad_up, grad_up_bias, grad_down, grad_down_bias = _mlp_dense(seed, batch, h)
    part = 4 * h // world_size
    rows = slice(rank * part, (rank + 1) * part)
    return grad_x, grad_up[rows], grad_up_bias[rows], grad_down[:, rows], grad_down_bias


SP_CASES = [(2, (0, 2, 4, 3, 4)), (4, (1, 1, 8, 4, 8)), (2, (2, 3, 2, 5, 2)),
            (4, (3, 2, 4, 2, 4))]  # (seed, batch, seq_len, h, out)


def _sp_case(seed, batch, seq_len, h, out):
    return (seeded_randn(seed, batch, seq_len, h), seeded_randn(seed + 1, out, h),
            seeded_randn(seed + 2, batch, seq_len, out))


def _sp_inputs(rank, world_size, seed, batch, seq_len, h, out):
    x, weight, grad_y = _sp_case(seed, batch, seq_len, h, out)
    tokens, features = seq_len // world_size, out // world_size
    return (x[:, rank * tokens:(rank + 1) * tokens], weight[rank * features:(rank + 1) * features],
            grad_y[..., rank * features:(rank + 1) * features])


def _sp_expected(rank, world_size, seed, batch, seq_len, h, out):
    x, weight, grad_y = _sp_case(seed, batch, seq_len, h, out)
    x, weight = x.requires_grad_(), weight.requires_grad_()
    y = x @ weight.T
    y.backward(grad_y)
    tokens, features = seq_len // world_size, out // world_size
    mine = slice(rank * features, (rank + 1) * features)
    return (y.detach()[..., mine], x.grad[:, rank * tokens:(rank + 1) * tokens],
            weight.grad[mine])


EXERCISES = {
    "tp_mlp_forward": Exercise(
        "the paper's MLP, forward, on your shards: you get `x` (batch x h, the same on every "
        "rank), your rows of up's weight `up_rows` (4h/n x h) and of its bias `up_bias`, your "
        "columns of down's weight `down_columns` (h x 4h/n) and down's whole bias `down_bias`; "
        "return the MLP's whole output GeLU(x up^T + up_bias) down^T + down_bias on every rank, "
        "with one all_reduce and no other communication (mind where the bias goes)",
        MLP_CASES, _forward_expected,
        inputs=lambda rank, n, seed, batch, h: _mlp_shards(rank, n, seed, batch, h)[:5],
        rules=(Only("all_reduce", text="use one all_reduce and no other communication"),
               CallSizes("all_reduce", lambda n, seed, batch, h: [batch * h],
                         text="one all_reduce, of the output (batch x h)")),
        hint_for=_bias_hint),
    "tp_mlp_backward": Exercise(
        "the same MLP, backward: you get what tp_mlp_forward got and `grad_z`, the gradient of "
        "the loss with respect to the MLP's output (batch x h, the same on every rank); return "
        "(grad_x, grad_up_rows, grad_up_bias, grad_down_columns, grad_down_bias): the whole "
        "gradient of x, and the gradients of the shards you hold, with one all_reduce (f's, in "
        "backward) and no other communication; you may use autograd on your own shards",
        MLP_CASES, _backward_expected,
        inputs=lambda rank, n, seed, batch, h: _mlp_shards(rank, n, seed, batch, h),
        rules=(Only("all_reduce", text="use one all_reduce and no other communication"),
               CallSizes("all_reduce", lambda n, seed, batch, h: [batch * h],
                         text="one all_reduce, of x's gradient (batch x h)")),
        names=("grad_x", "grad_up_rows", "grad_up_bias", "grad_down_columns",
               "grad_down_bias")),
    "sequence_parallel_linear": Exercise(
        "a column-parallel Linear (no bias) behind sequence parallelism, forward and backward, "
        "keeping only your tokens between them, as Megatron does: you get `x_tokens`, your "
        "tokens of x (batch x seq/n x h: rank r holds tokens r*seq/n to (r+1)*seq/n - 1), "
        "`weight_rows`, your rows of the weight (out/n x h), and `grad_y`, the gradient of your "
        "output features (batch x seq x out/n); forward: all-gather every rank's tokens "
        "(all_gather_single, which works on dimension 0) and compute your features y = x "
        "weight_rows^T; backward: all-gather the tokens again, compute your weight's gradient, "
        "and reduce-scatter x's gradient so that you keep your tokens' sum; return (y, the "
        "gradient of x_tokens, the gradient of weight_rows)",
        SP_CASES, _sp_expected,
        inputs=lambda rank, n, *case: _sp_inputs(rank, n, *case),
        rules=(Only("all_gather_single", "reduce_scatter_single",
                    text="use only all_gather_single and reduce_scatter_single"),
               CallSizes("all_gather_single",  # a call's logged size is its first tensor's
                         lambda n, seed, batch, seq_len, h, out: [batch * seq_len * h] * 2,
                         text="gather x's tokens twice: for the forward, and again for the "
                              "backward"),
               CallSizes("reduce_scatter_single",
                         lambda n, seed, batch, seq_len, h, out: [batch * seq_len * h // n],
                         text="one reduce_scatter_single of x's gradient, into your tokens")),
        names=("y", "the gradient of x_tokens", "the gradient of weight_rows"), points=2),
}


def _vocabulary(seed, vocab, h, tokens):
    """The whole embedding table (vocab x h) and a batch of token ids touching every rank's rows."""
    table = seeded_randn(seed, vocab, h)
    ids = (seeded_randn(seed + 1, 2, tokens).abs() * vocab).long() % vocab
    ids[0, 0], ids[-1, -1] = 0, vocab - 1  # the first and the last row, on the end ranks
    return table, ids


EXERCISES["vocab_parallel_embedding"] = Exercise(
    "an embedding table cut by rows over the ranks, as Megatron-LM cuts a large vocabulary: "
    "rank r holds rows r V/n to (r + 1) V/n - 1 of the table (V x h) as `rows`. You get your "
    "`rows`, the vocabulary size `vocab`, and `ids`, a batch of token ids (the same on every "
    "rank, any of the V tokens). Return, on every rank, the embedding of every token (shape "
    "ids.shape + (h,)), equal to a lookup in the whole table. No rank may assemble the whole "
    "table: communicate with one all_reduce of the batch's embeddings",
    [(2, (0, 8, 3, 5)), (4, (1, 12, 2, 6)), (3, (2, 9, 4, 4))],
    lambda rank, n, seed, vocab, h, tokens: _vocabulary(seed, vocab, h, tokens)[0][
        _vocabulary(seed, vocab, h, tokens)[1]],
    inputs=lambda rank, n, seed, vocab, h, tokens: (
        _vocabulary(seed, vocab, h, tokens)[0].chunk(n)[rank], vocab,
        _vocabulary(seed, vocab, h, tokens)[1]),
    rules=(Only("all_reduce", text="communicate with all_reduce only"),
           CallSizes("all_reduce", lambda n, seed, vocab, h, tokens: [2 * tokens * h],
                     text="one all_reduce of the batch's embeddings")), points=3)

