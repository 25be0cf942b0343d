"""The hand-built ring all-reduces of lesson 05 against gloo's own all_reduce, in one run.

    python benchmarks/ring.py [--world-size 4] [--sizes-mib 16 32 64] [--iterations 7]

Three ways to sum the same float32 tensor across the ranks: the plain ring the notebook shows
(`ring_all_reduce`), the same ring pipelined in segments with reused buffers
(`pipelined_ring_all_reduce`), and `dist.all_reduce`. They take turns; each iteration starts after
a barrier and lasts as long as the slowest rank. Prints the median of each and the ratios to gloo.
"""

import argparse
import functools

import torch
import torch.distributed as dist

from helpers import run
from helpers.how_all_reduce_works.algorithms import ring_all_reduce
from helpers.how_all_reduce_works.pipelined_ring import pipelined_ring_all_reduce
from helpers.timing import take_turns

CONTENDERS = {"plain ring": ring_all_reduce, "pipelined ring": pipelined_ring_all_reduce,
              "gloo": dist.all_reduce}


def compare_worker(rank, world_size, size_bytes, iterations):
    data = torch.randn(size_bytes // 4)
    # The first round of each is a warm-up.
    return take_turns({name: functools.partial(reduce, data)
                       for name, reduce in CONTENDERS.items()}, rounds=iterations)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--iterations", type=int, default=7)
    options = parser.parse_args()
    print(f"{options.world_size} ranks, median of {options.iterations} alternating iterations\n")
    print(f"{'size':>8} | {'plain (s)':>9} {'pipelined (s)':>13} {'gloo (s)':>9} | "
          f"{'plain/gloo':>10} {'pipelined/gloo':>14}")
    for mib in options.sizes_mib:
        medians = run(compare_worker, options.world_size, args=(mib * 2**20, options.iterations),
                      show_output=False, timeout=600)[0]
        plain, pipelined, gloo = (medians[name] for name in CONTENDERS)
        print(f"{mib:>5} MiB | {plain:>9.3f} {pipelined:>13.3f} {gloo:>9.3f} | "
              f"{plain / gloo:>9.2f}x {pipelined / gloo:>13.2f}x", flush=True)


if __name__ == "__main__":
    main()
