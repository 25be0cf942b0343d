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

RULES = {  # what each collective does, in one line
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


def tagged(rank, world_size):
    """Rank r's n numbers, 10 r + [0, 1, ..., n-1]: the tens digit says where a number came from."""
    return 10.0 * rank + torch.arange(world_size, dtype=torch.float32)


# One example per collective: the call, with the buffers each rank passes. Each returns this
# rank's {"before": tensor or None, "after": tensor or None}; None where a rank has no such buffer.

def broadcast_example(rank, world_size):
    tensor = tagged(rank, world_size)
    before = tensor.clone()
    dist.broadcast(tensor, src=0)  # in place: afterwards every rank holds rank 0's tensor
    return {"before": before, "after": tensor}


def scatter_example(rank, world_size):
    mine = tagged(rank, world_size)
    pieces = list(mine.chunk(world_size)) if rank == 0 else None  # only the source has a list
    piece = torch.empty(1)
    dist.scatter(piece, scatter_list=pieces, src=0)
    return {"before": mine if rank == 0 else None, "after": piece}


def gather_example(rank, world_size):
    mine = torch.tensor([10.0 * rank])
    pieces = [torch.empty(1) for _ in range(world_size)] if rank == 0 else None  # only dst
    dist.gather(mine, gather_list=pieces, dst=0)
    return {"before": mine, "after": torch.cat(pieces) if rank == 0 else None}


def all_gather_example(rank, world_size):
    mine = torch.tensor([10.0 * rank])
    everyone = torch.empty(world_size)  # n times the input; dist.all_gather takes a list instead
    dist.all_gather_single(everyone, mine)
    return {"before": mine, "after": everyone}


def all_to_all_example(rank, world_size):
    mine = tagged(rank, world_size)  # piece j (here one number) goes to rank j
    received = torch.empty(world_size)  # piece r of every rank, in rank order
    dist.all_to_all_single(received, mine)
    return {"before": mine, "after": received}


def reduce_example(rank, world_size):
    tensor = tagged(rank, world_size)
    before = tensor.clone()
    dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)  # the sum lands in rank 0's tensor
    # Elsewhere gloo used the tensor as scratch space: it holds partial sums, not a result.
    return {"before": before, "after": tensor, "scratch": rank != 0}


def reduce_scatter_example(rank, world_size):
    mine = tagged(rank, world_size)
    piece = torch.empty(1)  # 1/n of the input: piece r of the sum
    dist.reduce_scatter_single(piece, mine, op=dist.ReduceOp.SUM)
    return {"before": mine, "after": piece}


def all_reduce_example(rank, world_size):
    tensor = tagged(rank, world_size)
    before = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # in place: every rank holds the sum
    return {"before": before, "after": tensor}


EXAMPLES = {"broadcast": broadcast_example, "scatter": scatter_example,
            "gather": gather_example, "reduce": reduce_example,
            "all_gather": all_gather_example, "reduce_scatter": reduce_scatter_example,
            "all_reduce": all_reduce_example, "all_to_all": all_to_all_example}


def collective_worker(rank, world_size, name):
    """Run the example of collective `name` once (see EXAMPLES)."""
    if name not in EXAMPLES:
        raise ValueError(f"unknown collective {name!r}; choose one of {COLLECTIVES}")
    return EXAMPLES[name](rank, world_size)


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
            try:  # PREMUL_SUM takes its factor: ReduceOp.PREMUL_SUM(2.0)
                op = getattr(dist.ReduceOp, name)
                dist.all_reduce(tensor, op=op(2.0) if name == "PREMUL_SUM" else op)
                results[(name, str(dtype).removeprefix("torch."))] = tensor.tolist()
            except RuntimeError as error:
                results[(name, str(dtype).removeprefix("torch."))] = str(error).splitlines()[0]
    return results


def scaled_sum_worker(rank, world_size, factor):
    """PREMUL_SUM (NCCL and XCCL in torch 2.13, not gloo) multiplies every input by `factor`
    inside the reduction. The same result on any backend: scale locally, then SUM. Returns
    factor * sum of the inputs."""
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


def uneven_all_to_all_worker(rank, world_size):
    """What mixture-of-experts routing needs: rank r sends r + j + 1 numbers to rank j, a
    different count for every pair. The counts travel first, one number per pair; then the data,
    with `input_split_sizes` and `output_split_sizes`. Each number is 10 r + j (from r, to j).
    Returns {"before": what this rank sends, "after": what it received}, in rank order."""
    send_counts = torch.tensor([rank + j + 1 for j in range(world_size)])
    receive_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(receive_counts, send_counts)  # rank j learns what every rank sends it
    outgoing = torch.cat([torch.full((int(count),), 10.0 * rank + j)
                          for j, count in enumerate(send_counts)])
    incoming = torch.empty(int(receive_counts.sum()))
    dist.all_to_all_single(incoming, outgoing, output_split_sizes=receive_counts.tolist(),
                           input_split_sizes=send_counts.tolist())
    return {"before": outgoing, "after": incoming}


def strings_worker(rank, world_size):
    """Collectives on Python objects: every rank gets every rank's string."""
    everyone = [None] * world_size
    dist.all_gather_object(everyone, f"rank {rank} says hello")
    return everyone
