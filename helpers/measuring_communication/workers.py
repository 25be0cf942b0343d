"""Lesson 04's workers: timing a collective, size sweeps, memory-copy bandwidth. The bandwidths
and the alpha-beta model they feed are the course's cost model (helpers.cost_model).

The timing differs from nccl-tests' (see benchmark_worker): here every call starts after a
barrier and lasts as long as its slowest rank, and the median of the calls is kept.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from helpers.cost_model import OPERATIONS
from helpers.timing import Clock, take_turns


def collective_call(op, size_bytes, world_size):
    """Allocate the buffers of `op` for an array of `size_bytes` and return a call that runs it."""
    numel = max(world_size, size_bytes // 4 // world_size * world_size)  # float32, divisible by n
    whole, shard = torch.randn(numel), torch.randn(numel // world_size)
    if op == "all_reduce":
        return lambda: dist.all_reduce(whole)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(shard, whole)
    if op == "all_gather":
        return lambda: dist.all_gather_single(whole, shard)
    if op == "all_to_all":
        received = torch.empty(numel)
        return lambda: dist.all_to_all_single(received, whole)
    if op == "broadcast":
        return lambda: dist.broadcast(whole, src=0)
    if op == "reduce":
        return lambda: dist.reduce(whole, dst=0)
    raise ValueError(f"unknown operation {op!r}; choose one of {OPERATIONS}")


def benchmark_worker(rank, world_size, op, size_bytes, warmup, iterations):
    """Time `op` on an array of `size_bytes`: `warmup` untimed calls, then `iterations` timed ones,
    each started together after a barrier. A collective lasts as long as its slowest rank, so the
    per-iteration times are reduced with MAX across ranks. Returns the median, in seconds.

    nccl-tests instead times its iterations back to back, with no barrier between them, takes the
    mean per iteration, and averages it over the ranks (src/common.cu, defaults -n 20 -z 0 -a 1)."""
    return take_turns({op: collective_call(op, size_bytes, world_size)}, rounds=iterations,
                      warmup=warmup)[op]


def memory_copy_bandwidth(size_bytes=64 * 2**20, repeats=7) -> float:
    """Bytes/s of copying a tensor into a preallocated one, in this process: the ceiling for
    gloo, whose transfers on one machine are memory copies through the kernel."""
    source, target = torch.randn(size_bytes // 4), torch.empty(size_bytes // 4)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        clock = Clock()
        target.copy_(source)
        times.append(clock())
    return size_bytes / statistics.median(times)
