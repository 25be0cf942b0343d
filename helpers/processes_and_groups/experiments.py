"""Lesson 01's experiment run from the kernel: it starts ranks (helpers.run) and times them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from helpers.launcher import run
from helpers.processes_and_groups.workers import busy_loop, busy_worker


def time_threads_and_processes(worker_counts, iterations) -> dict:
    """Wall time of `n` copies of the busy loop, as n threads in this process and as n ranks;
    and how long one copy takes alone, in this process and inside a rank."""
    timings = {"workers": list(worker_counts), "threads": [], "processes": []}
    run(busy_worker, 1, args=(1,), show_output=False)  # start the launcher before timing it
    started = time.perf_counter()
    busy_loop(iterations)
    timings["one copy here"] = time.perf_counter() - started
    timings["one copy in a rank"] = run(busy_worker, 1, args=(iterations,), show_output=False)[0]
    for count in worker_counts:
        started = time.perf_counter()
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(busy_loop, [iterations] * count))
        timings["threads"].append(time.perf_counter() - started)
        started = time.perf_counter()
        run(busy_worker, count, args=(iterations,), show_output=False, threads_per_rank=1)
        timings["processes"].append(time.perf_counter() - started)
    return timings
