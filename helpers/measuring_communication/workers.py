"""Lesson 04's workers and formulas: timing a collective, algbw and busbw, size sweeps, the
alpha-beta fit, memory-copy bandwidth.

The bandwidths follow nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): S is the size
of the whole array (for all_gather the gathered output, for reduce_scatter the input),
algbw = S / t, and busbw = algbw * factor(n), the factor making busbw comparable with the
hardware's link bandwidth whatever the collective and the number of ranks. The timing differs
from nccl-tests' (see benchmark_worker): here every call starts after a barrier and lasts as long
as its slowest rank, and the median of the calls is kept.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from helpers.launcher import run

BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
OPERATIONS = list(BUSBW_FACTORS)


def _collective(op, size_bytes, world_size):
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
    call = _collective(op, size_bytes, world_size)
    for _ in range(warmup):
        call()
    times = torch.empty(iterations, dtype=torch.float64)
    for i in range(iterations):
        dist.barrier()
        started = time.perf_counter()
        call()
        times[i] = time.perf_counter() - started
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return float(times.median())


def bandwidths(op: str, world_size: int, size_bytes: int, seconds: float) -> dict:
    """algbw and busbw in bytes/s for one measurement, with nccl-tests' factors."""
    algbw = size_bytes / seconds
    return {"op": op, "world_size": world_size, "size_bytes": size_bytes, "seconds": seconds,
            "algbw": algbw, "busbw": algbw * BUSBW_FACTORS[op](world_size)}


def sweep(op, world_size, sizes, warmup=2, iterations=10, progress=None) -> list:
    """Measure `op` at every size (one launch per size; Ctrl-C stops it cleanly between or during
    launches). `progress`, e.g. a helpers.notebook.progress_bar, advances by one per size.
    Returns one `bandwidths` record per size."""
    records = []
    for size_bytes in sizes:
        seconds = run(benchmark_worker, world_size, args=(op, size_bytes, warmup, iterations),
                      show_output=False, timeout=300)[0]
        records.append(bandwidths(op, world_size, size_bytes, seconds))
        if progress is not None:
            progress.value += 1
    return records


def fit_alpha_beta(records, relative: bool = True) -> tuple:
    """Fit t = alpha + S_bus / beta (the alpha-beta model) to measurements, where S_bus = S *
    factor(n) is the data each rank must move. Least squares on the *relative* error by default,
    so the microsecond-scale small messages count as much as the large ones; `relative=False`
    minimises the error in seconds, the right choice for predicting the sum of many calls.
    Returns (alpha seconds, beta bytes/s)."""
    bus_bytes = np.array([r["busbw"] / r["algbw"] * r["size_bytes"] for r in records])
    seconds = np.array([r["seconds"] for r in records])
    weights = 1 / seconds if relative else np.ones_like(seconds)
    design = np.stack([np.ones_like(bus_bytes), bus_bytes], axis=1) * weights[:, None]
    (alpha, inverse_beta), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    return float(alpha), float(1 / inverse_beta)


def model_seconds(alpha, beta, op, world_size, size_bytes):
    """The alpha-beta model's time for `op` on an array of `size_bytes`."""
    return alpha + size_bytes * BUSBW_FACTORS[op](world_size) / beta


def memory_copy_bandwidth(size_bytes=64 * 2**20, repeats=7) -> float:
    """Bytes/s of copying a tensor into a preallocated one, in this process: the ceiling for
    gloo, whose transfers on one machine are memory copies through the kernel."""
    source, target = torch.randn(size_bytes // 4), torch.empty(size_bytes // 4)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return size_bytes / statistics.median(times)
