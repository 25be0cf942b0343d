"""Flat shards and the two collectives that move them (lesson 07).

Every sharded tensor is cut the same way: flattened, padded with zeros to a multiple of n, and
cut into n equal pieces; rank r holds piece r. Padding keeps every piece the same size, which
all_gather_single and reduce_scatter_single need, whatever the tensor's size.

    before                       after
    shard_of      full tensor    its piece r (a copy)
    gather        piece r        the full tensor, on every rank       (all-gather)
    scatter_mean  full gradient  piece r of the gradients' average    (reduce-scatter)

`CommCounter` counts, per rank, the bytes each collective sends (nccl-tests' bus bytes, lesson 04).
"""

from __future__ import annotations

import inspect
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


# The bytes each rank sends for a collective on S bytes (S: the whole array; for all_gather the
# gathered output, for reduce_scatter the input), on a ring: nccl-tests' bus bytes.
SENT_PER_RANK = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_single": lambda n: (n - 1) / n,
    "reduce_scatter_single": lambda n: (n - 1) / n,
}


class CommCounter:
    """While active, counts the bytes this rank sends in all_reduce, all_gather_single and
    reduce_scatter_single (called as torch.distributed.<name>), by collective:
    `counter.sent["all_reduce"]`. Bytes are the ring's: SENT_PER_RANK[name](n) * S."""

    # The argument that holds the whole array S.
    ARRAY = {"all_reduce": "tensor", "all_gather_single": "output_tensor",
             "reduce_scatter_single": "input"}

    def __init__(self):
        self.sent = dict.fromkeys(SENT_PER_RANK, 0.0)
        self.calls = dict.fromkeys(SENT_PER_RANK, 0)
        self._saved = {}

    @property
    def total(self) -> float:
        return sum(self.sent.values())

    def __enter__(self):
        for name in SENT_PER_RANK:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._counting(name, self._saved[name]))
        return self

    def __exit__(self, *exc_info):
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def _counting(self, name, original):
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            array = arguments[self.ARRAY[name]]
            world_size = dist.get_world_size(arguments.get("group"))
            size = array.numel() * array.element_size()
            self.sent[name] += SENT_PER_RANK[name](world_size) * size
            self.calls[name] += 1
            return original(*args, **kwargs)

        return counted
