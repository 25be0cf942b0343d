"""Lesson 04's size sweeps, run from the kernel: one launch of workers.benchmark_worker per
size."""

from __future__ import annotations

from helpers.cost_model import bandwidths
from helpers.launcher import run
from helpers.measuring_communication.workers import benchmark_worker

# A size's timed calls move at most this many bytes a rank, but never fewer than 3 calls: up to
# 4 MiB every size gets all its iterations; 16 MiB gets 3, 64 MiB 3. A large call is long, and
# the median of a few varies little; the small ones, far shorter, need many.
TIMED_BYTES = 40 * 2**20


def iterations_at(size_bytes: int, iterations: int) -> int:
    """The timed calls a sweep makes at `size_bytes`, of at most `iterations`."""
    return min(iterations, max(3, TIMED_BYTES // size_bytes))


def sweep(op, world_size, sizes, warmup=2, iterations=10, progress=None) -> list:
    """Measure `op` at every size (one launch per size; Ctrl-C stops it cleanly between or during
    launches), with `iterations` timed calls, fewer for large sizes (iterations_at). `progress`,
    e.g. a helpers.notebook.progress_bar, advances by one per size. Returns one `bandwidths`
    record per size."""
    records = []
    for size_bytes in sizes:
        seconds = run(benchmark_worker, world_size, show_output=False, timeout=300, kwargs=dict(
            op=op, size_bytes=size_bytes, warmup=warmup,
            iterations=iterations_at(size_bytes, iterations)))[0]
        records.append(bandwidths(op, world_size, size_bytes, seconds))
        if progress is not None:
            progress.value += 1
    return records
