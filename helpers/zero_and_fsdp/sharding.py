"""Flat shards and the two collectives that move them (lesson 07).

Every sharded tensor is cut the same way: flattened, padded with zeros to a multiple of n, and
cut into n equal pieces; rank r holds piece r. Padding keeps every piece the same size, which
all_gather_single and reduce_scatter_single need, whatever the tensor's size.

    before                       after
    shard_of      full tensor    its piece r (a copy)
    gather        piece r        the full tensor, on every rank       (all-gather)
    scatter_mean  full gradient  piece r of the gradients' average    (reduce-scatter)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def shard_numel(numel: int, world_size: int) -> int:
    """Elements in each rank's piece of a tensor of `numel` elements: ceil(numel / n)."""
    return math.ceil(numel / world_size)


def shard_of(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s piece of `tensor`: flattened, zero-padded to n equal pieces (a copy)."""
    size = shard_numel(tensor.numel(), world_size)
    piece = tensor.detach().flatten()[rank * size:(rank + 1) * size]
    return torch.cat([piece, piece.new_zeros(size - piece.numel())])


def gather(shard: torch.Tensor, shape: torch.Size, group=None) -> torch.Tensor:
    """The full tensor of `shape` from every rank's piece (all_gather_single), padding cut."""
    world_size = dist.get_world_size(group)
    flat = shard.new_empty(shard.numel() * world_size)
    dist.all_gather_single(flat, shard.contiguous(), group=group)
    return flat[:math.prod(shape)].view(shape)


def scatter_mean(full: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's piece of the average of `full` over the ranks (reduce_scatter_single, AVG)."""
    world_size = dist.get_world_size(group)
    size = shard_numel(full.numel(), world_size)
    flat = full.flatten()
    flat = torch.cat([flat, flat.new_zeros(size * world_size - flat.numel())])
    piece = flat.new_empty(size)
    dist.reduce_scatter_single(piece, flat, op=dist.ReduceOp.AVG, group=group)
    return piece
