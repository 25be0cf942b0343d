"""Reference solutions of lesson 08's exercises. Try the exercise first."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def tp_mlp_forward(rank, world_size, x, up_rows, up_bias, down_columns, down_bias):
    hidden = F.gelu(F.linear(x, up_rows, up_bias))  # this rank's 4h/n features: no communication
    z = hidden @ down_columns.T  # a partial sum of the output
    dist.all_reduce(z)  # g
    return z + down_bias  # added once, after the sum


def tp_mlp_backward(rank, world_size, x, up_rows, up_bias, down_columns, down_bias, grad_z):
    x = x.clone().requires_grad_()
    shards = [t.clone().requires_grad_() for t in (up_rows, up_bias, down_columns, down_bias)]
    up_rows, up_bias, down_columns, down_bias = shards
    partial = F.gelu(F.linear(x, up_rows, up_bias)) @ down_columns.T
    (partial + down_bias).backward(grad_z)  # g's backward is the identity
    grad_x = x.grad  # this rank's part: through its own 4h/n features only
    dist.all_reduce(grad_x)  # f's backward
    return (grad_x, *(shard.grad for shard in shards))


def _gather_tokens(x_tokens, world_size):
    pieces = x_tokens.transpose(0, 1).contiguous()  # tokens first: all_gather_single's dimension
    whole = pieces.new_empty(pieces.shape[0] * world_size, *pieces.shape[1:])
    dist.all_gather_single(whole, pieces)
    return whole.transpose(0, 1)


def sequence_parallel_linear(rank, world_size, x_tokens, weight_rows, grad_y):
    y = _gather_tokens(x_tokens, world_size) @ weight_rows.T  # forward; the gathered x is freed
    x = _gather_tokens(x_tokens, world_size)  # backward: gathered again
    grad_weight = torch.einsum("bso,bsh->oh", grad_y, x)
    grad_x = (grad_y @ weight_rows).transpose(0, 1).contiguous()  # partial, tokens first
    grad_tokens = grad_x.new_empty(grad_x.shape[0] // world_size, *grad_x.shape[1:])
    dist.reduce_scatter_single(grad_tokens, grad_x)  # the sum over ranks, of my tokens
    return y, grad_tokens.transpose(0, 1), grad_weight


def vocab_parallel_embedding(rank, world_size, rows, vocab, ids):
    first = rank * rows.shape[0]  # the token id of this rank's first row
    mine = (ids >= first) & (ids < first + rows.shape[0])
    embedded = rows[(ids - first).clamp(0, rows.shape[0] - 1)]  # every id looked up somewhere
    embedded[~mine] = 0  # ... and kept only where this rank holds the row
    dist.all_reduce(embedded)  # each token's row comes from exactly one rank
    return embedded

