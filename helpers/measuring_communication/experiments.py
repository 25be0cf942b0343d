"""Lesson 04's size sweeps, run from the kernel: one launch of workers.benchmark_worker per
size."""

from __future__ import annotations

from helpers.cost_model import bandwidths
from helpers.launcher import run
from helpers.measuring_communication.workers import benchmark_worker


def sweep(op, world_size, sizes, warmup=2, iterations=10, progress=None) -> list:
    """Measure `op` at every size (one launch per size; Ctrl-C stops it cleanly between or during
    launches). `progress`, e.g. a helpers.notebook.progress_bar, advances by one per size.
    Returns one `bandwidths` record per size."""
    records = []
    for size_bytes in sizes:
        seconds = run(benchmark_worker, world_size, show_output=False, timeout=300, kwargs=dict(
            op=op, size_bytes=size_bytes, warmup=warmup, iterations=iterations))[0]
        records.append(bandwidths(op, world_size, size_bytes, seconds))
        if progress is not None:
            progress.value += 1
    return records
