"""Lesson 03's workers: every collective on tagged inputs, every ReduceOp, and what is built
from them (all-reduce in two steps, sharded softmax and norm, uneven gathers).

A collective is one operation that every rank of a group calls together. The inputs are chosen so
that every number says where it came from: rank r starts with 10*r + [0, 1, ..., n-1], so the tens
digit is the source rank and the units digit the position.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from helpers.reference import seeded_randn

RULES = {
    "broadcast": "rank 0's tensor is copied to every rank",
    "scatter": "rank 0's tensor is cut into n pieces; rank r gets piece r",
    "gather": "every rank's tensor is collected, in rank order, on rank 0",
    "reduce": "the element-wise sum of all tensors arrives on rank 0",
    "all_gather": "every rank gets every rank's tensor, in rank order",
    "reduce_scatter": "the element-wise sum is cut into n pieces; rank r gets piece r",
    "all_reduce": "every rank gets the element-wise sum of all tensors",
    "all_to_all": "rank r's piece j goes to rank j, which stores it at position r (a transpose)",
}
COLLECTIVES = list(RULES)
REDUCING = {"reduce", "reduce_scatter", "all_reduce"}


def collective_worker(rank, world_size, name):
    """Run the collective `name` once. Returns {"before": tensor or None, "after": tensor or None}
    for this rank; None where the rank has no such buffer (scatter's inputs off rank 0, gather's
    and reduce's outputs off rank 0)."""
    n = world_size
    mine = 10.0 * rank + torch.arange(n, dtype=torch.float32)  # n numbers, tagged with the rank
    one = torch.tensor([10.0 * rank])  # one number per rank, for the gathers
    if name == "broadcast":
        after = mine.clone()
        dist.broadcast(after, src=0)
        return {"before": mine, "after": after}
    if name == "scatter":
        after = torch.empty(1)
        dist.scatter(after, list(mine.chunk(n)) if rank == 0 else None, src=0)
        return {"before": mine if rank == 0 else None, "after": after}
    if name == "gather":
        gathered = [torch.empty(1) for _ in range(n)] if rank == 0 else None
        dist.gather(one, gathered, dst=0)
        return {"before": one, "after": torch.cat(gathered) if rank == 0 else None}
    if name == "reduce":
        after = mine.clone()  # off rank 0 gloo may use it as scratch space: not a result
        dist.reduce(after, dst=0, op=dist.ReduceOp.SUM)
        return {"before": mine, "after": after if rank == 0 else None}
    if name == "all_gather":
        after = torch.empty(n)
        dist.all_gather_single(after, one)
        return {"before": one, "after": after}
    if name == "reduce_scatter":
        after = torch.empty(1)
        dist.reduce_scatter_single(after, mine, op=dist.ReduceOp.SUM)
        return {"before": mine, "after": after}
    if name == "all_reduce":
        after = mine.clone()  # all_reduce works in place
        dist.all_reduce(after, op=dist.ReduceOp.SUM)
        return {"before": mine, "after": after}
    if name == "all_to_all":
        after = torch.empty(n)
        dist.all_to_all_single(after, mine)
        return {"before": mine, "after": after}
    raise ValueError(f"unknown collective {name!r}; choose one of {COLLECTIVES}")


def barrier_worker(rank, world_size, seconds_per_rank):
    """Rank r works for r * seconds_per_rank, then waits at `dist.barrier()`. Returns its timeline:
    nobody leaves the barrier before the last rank has arrived."""
    dist.barrier()
    start = time.perf_counter()
    time.sleep(rank * seconds_per_rank)
    arrived = time.perf_counter()
    dist.barrier()
    left = time.perf_counter()
    return [("work", 0.0, arrived - start), ("barrier", arrived - start, left - start)]


REDUCE_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]


def reduce_op_input(rank, dtype):
    """What rank r contributes in `reduce_ops_worker` (also used to compute the reference)."""
    return torch.tensor([rank + 1, 6, 12 - 3 * rank], dtype=dtype)


def reduce_ops_worker(rank, world_size):
    """All-reduce the same small tensors with every ReduceOp, on float32 and on int64.
    Returns {(op, dtype name): result list, or the error message gloo gave}."""
    results = {}
    for name in REDUCE_OPS:
        for dtype in (torch.float32, torch.int64):
            tensor = reduce_op_input(rank, dtype)
            try:
                if name == "PREMUL_SUM":
                    op = dist._make_nccl_premul_sum(2.0)
                else:
                    op = getattr(dist.ReduceOp, name)
                dist.all_reduce(tensor, op=op)
                results[(name, str(dtype).removeprefix("torch."))] = tensor.tolist()
            except RuntimeError as error:
                results[(name, str(dtype).removeprefix("torch."))] = str(error).splitlines()[0]
    return results


def scaled_sum_worker(rank, world_size, factor):
    """PREMUL_SUM (NCCL only) multiplies every input by `factor` inside the reduction. The same
    result on any backend: scale locally, then SUM. Returns factor * sum of the inputs."""
    tensor = reduce_op_input(rank, torch.float32) * factor
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def two_step_all_reduce_worker(rank, world_size, numel, seed):
    """all_reduce = reduce_scatter + all_gather, on random data.

    Before: rank r holds x_r (numel numbers). reduce_scatter leaves rank r with shard r of the sum
    (numel / n numbers); all_gather then gives every rank all n shards, i.e. the whole sum.
    Returns the direct all_reduce, the two-step result and this rank's shard.
    """
    data = seeded_randn(seed + rank, numel)
    direct = data.clone()
    dist.all_reduce(direct)
    shard = torch.empty(numel // world_size)
    dist.reduce_scatter_single(shard, data)
    two_step = torch.empty(numel)
    dist.all_gather_single(two_step, shard)
    return {"direct": direct, "two_step": two_step, "shard": shard}


def softmax_worker(rank, world_size, vector):
    """Softmax of a vector sharded across ranks (rank r holds chunk r), with two all_reduces:
    MAX of the local maxima (for numerical stability), then SUM of the local sums of exp.
    Returns this rank's chunk of softmax(vector)."""
    shard = vector.chunk(world_size)[rank]
    largest = shard.max().reshape(1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    exponentials = (shard - largest).exp()
    total = exponentials.sum().reshape(1)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return exponentials / total


def l2_normalize_worker(rank, world_size, vector):
    """x / ||x|| for a vector sharded across ranks: all_reduce SUM of the local sums of squares.
    Returns this rank's chunk of the normalised vector."""
    shard = vector.chunk(world_size)[rank]
    squares = shard.square().sum().reshape(1)
    dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    return shard / squares.sqrt()


def strided_view_worker(rank, world_size, contiguous):
    """All-reduce the even columns x[:, ::2] of a 2x4 matrix, a non-contiguous view.

    gloo reduces the view's *memory* as if it were contiguous: the wrong elements. With
    `contiguous=True` the view is copied to contiguous memory, reduced, and copied back.
    Returns the whole matrix afterwards."""
    matrix = torch.arange(8, dtype=torch.float32).reshape(2, 4) + 100 * rank
    even_columns = matrix[:, ::2]
    if contiguous:
        packed = even_columns.contiguous()
        dist.all_reduce(packed)
        even_columns.copy_(packed)
    else:
        dist.all_reduce(even_columns)
    return matrix


def uneven_all_gather_worker(rank, world_size):
    """Rank r holds r + 1 numbers. all_gather needs equal sizes: gather the lengths, pad to the
    longest, gather, trim. `all_gather_object` does it for any picklable object (slower: pickling).
    Returns both results, as lists of per-rank tensors."""
    mine = torch.arange(rank + 1, dtype=torch.float32) + 10 * rank
    length = torch.tensor([mine.numel()])
    lengths = [torch.empty_like(length) for _ in range(world_size)]
    dist.all_gather(lengths, length)
    longest = int(max(lengths))
    padded = torch.zeros(longest)
    padded[: mine.numel()] = mine
    gathered = [torch.empty(longest) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    trimmed = [tensor[: int(n)] for tensor, n in zip(gathered, lengths)]
    as_objects = [None] * world_size
    dist.all_gather_object(as_objects, mine)
    return {"padded": trimmed, "objects": as_objects}


def strings_worker(rank, world_size):
    """Collectives on Python objects: every rank gets every rank's string."""
    everyone = [None] * world_size
    dist.all_gather_object(everyone, f"rank {rank} says hello")
    return everyone
