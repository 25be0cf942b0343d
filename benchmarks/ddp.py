"""Lesson 06's hand-built data parallelism against torch's DistributedDataParallel, in one run.

    python benchmarks/ddp.py [--world-sizes 2 4] [--dim 256] [--layers 32] [--batch 256]
                             [--bucket-mb 2] [--iterations 15]

Four copies of the same MLP train side by side in every rank, one per way of averaging the
gradients: naive (the lecture's loop: one blocking all_reduce per parameter after backward),
overlapped (the hand-built DDP, one asynchronous all_reduce per gradient during backward),
bucketed (the hand-built DDP with buckets of --bucket-mb) and torch DDP (the same bucket size).
They take turns, step after step; each step starts after a barrier and lasts as long as the
slowest rank. Prints the median step time of each and the ratios the lesson quotes.
"""

import argparse

from helpers import run
from helpers.data_parallelism.workers import LABELS, STRATEGIES, step_times_worker


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256, help="the global batch")
    parser.add_argument("--bucket-mb", type=float, default=2.0)
    parser.add_argument("--iterations", type=int, default=15)
    options = parser.parse_args()
    megabytes = options.layers * options.dim**2 * 4 / 2**20
    print(f"MLP of {options.layers} Linear({options.dim}, {options.dim}): {megabytes:.0f} MiB of "
          f"gradients; global batch {options.batch}; buckets of {options.bucket_mb:g} MB; "
          f"median of {options.iterations} alternating steps\n")
    print(f"{'ranks':>5} | " + " ".join(f"{LABELS[name] + ' (ms)':>15}" for name in STRATEGIES)
          + f" | {'bucketed/torch':>14} {'naive/bucketed':>14}")
    for world_size in options.world_sizes:
        medians = run(step_times_worker, world_size, show_output=False, timeout=600, kwargs=dict(
            dim=options.dim, layers=options.layers, batch_size=options.batch,
            bucket_mb=options.bucket_mb, iterations=options.iterations))[0]
        times = " ".join(f"{medians[name] * 1e3:>15.1f}" for name in STRATEGIES)
        print(f"{world_size:>5} | {times} | {medians['bucketed'] / medians['torch_ddp']:>13.2f}x"
              f" {medians['naive'] / medians['bucketed']:>13.2f}x", flush=True)


if __name__ == "__main__":
    main()
