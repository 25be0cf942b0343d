"""The hand-built ring all-reduce (helpers.algorithms) against gloo's own all_reduce, in one run.

    python benchmarks/ring.py [--world-size 4] [--sizes-mib 16 32 64] [--iterations 7]

Both sum the same float32 tensor across the ranks; each iteration starts after a barrier and
lasts as long as the slowest rank. Prints the median of each, and their ratio.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from helpers import run
from helpers.algorithms import ring_all_reduce


def compare_worker(rank, world_size, size_bytes, iterations):
    data = torch.randn(size_bytes // 4)
    timings = {"ring": [], "gloo": []}
    for name, reduce in (("ring", ring_all_reduce), ("gloo", dist.all_reduce)) * (iterations + 1):
        dist.barrier()
        started = time.perf_counter()
        reduce(data)
        elapsed = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        timings[name].append(elapsed.item())
    # The first round of each is a warm-up.
    return {name: statistics.median(values[1:]) for name, values in timings.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--iterations", type=int, default=7)
    options = parser.parse_args()
    print(f"{options.world_size} ranks, median of {options.iterations} alternating iterations\n")
    print(f"{'size':>8} | {'ring (s)':>9} {'gloo (s)':>9} | {'ring/gloo':>9}")
    for mib in options.sizes_mib:
        medians = run(compare_worker, options.world_size, args=(mib * 2**20, options.iterations),
                      show_output=False, timeout=600)[0]
        print(f"{mib:>5} MiB | {medians['ring']:>9.3f} {medians['gloo']:>9.3f} | "
              f"{medians['ring'] / medians['gloo']:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
