"""Reference solutions of lesson 07's exercises. Try the exercise first."""

import math

import torch
import torch.distributed as dist


def zero_bytes_per_rank(sizes, world_size, stage):
    def elements(sharded):
        return sum(math.ceil(numel / world_size) if sharded else numel for numel in sizes)

    return {"weights": 2 * elements(stage >= 3), "gradients": 2 * elements(stage >= 2),
            "optimizer": 12 * elements(stage >= 1)}


def gather_layer(rank, world_size, piece, shapes):
    whole = piece.new_empty(piece.numel() * world_size)
    dist.all_gather_single(whole, piece)
    sizes = [math.prod(shape) for shape in shapes]
    parts = whole[:sum(sizes)].split(sizes)  # cut the padding, then each tensor
    return [part.view(shape) for part, shape in zip(parts, shapes)]


def _gather(piece, shape, world_size):
    whole = piece.new_empty(piece.numel() * world_size)
    dist.all_gather_single(whole, piece)
    return whole[:math.prod(shape)].view(shape)


def _scatter_mean(full, world_size):
    size = math.ceil(full.numel() / world_size)
    flat = torch.cat([full.flatten(), full.new_zeros(size * world_size - full.numel())])
    piece = full.new_empty(size)
    dist.reduce_scatter_single(piece, flat, op=dist.ReduceOp.AVG)
    return piece


def sharded_sgd_step(rank, world_size, params, grads, lr):
    updated = []
    for param, grad in zip(params, grads):
        size = math.ceil(param.numel() / world_size)  # each rank's piece
        grad_piece = _scatter_mean(grad, world_size)
        flat = torch.cat([param.flatten(), param.new_zeros(size * world_size - param.numel())])
        piece = flat[rank * size:(rank + 1) * size] - lr * grad_piece
        updated.append(_gather(piece, param.shape, world_size))
    return updated


def zero3_linear(rank, world_size, piece, shape, x, grad_output):
    weight = _gather(piece, shape, world_size)  # forward
    y = x @ weight.T
    del weight  # freed until the backward
    weight = _gather(piece, shape, world_size)  # backward: gathered again
    grad_x = grad_output @ weight
    grad_piece = _scatter_mean(grad_output.T @ x, world_size)
    return y, grad_x, grad_piece


def clip_sharded_gradients(rank, world_size, pieces, max_norm):
    # the squares of every rank's pieces (padding is zeros), summed over the ranks, are the
    # squares of the whole gradients
    squares = torch.stack([piece.square().sum() for piece in pieces]).sum().reshape(1)
    dist.all_reduce(squares)
    total = squares.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grad_norm_'s own formula
    return [piece * scale for piece in pieces]
