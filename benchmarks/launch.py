"""Launch time of helpers.run against plain torch.multiprocessing.spawn, side by side in one run.

    python benchmarks/launch.py [--spawn-repeats 3] [--many 200]

Both launch the same worker: join a gloo process group of N ranks, return the rank. For each N it
prints the first launch (for helpers.run this includes starting the forkserver, once per kernel),
the median of later launches, and their ratio. Then `--many` launches of helpers.run at 4 ranks:
median, slowest, and how many took over 0.5 s.
"""

import argparse
import os
import socket
import statistics
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import run


def join_and_return(rank, world_size):
    return rank


def spawn_entry(rank, world_size, port):
    """What a plain mp.spawn program does: env:// rendezvous on rank 0's TCP store, then leave."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def time_spawn(world_size):
    started = time.perf_counter()
    mp.spawn(spawn_entry, args=(world_size, free_port()), nprocs=world_size)
    return time.perf_counter() - started


def time_run(world_size):
    started = time.perf_counter()
    run(join_and_return, world_size, show_output=False)
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--spawn-repeats", type=int, default=3, help="later mp.spawn launches")
    parser.add_argument("--run-repeats", type=int, default=20, help="later helpers.run launches")
    parser.add_argument("--many", type=int, default=200)
    options = parser.parse_args()

    print(f"{os.cpu_count()} cores; median of later launches, in seconds\n")
    header = f"{'ranks':>5} | {'run first':>9} {'run later':>9} | {'spawn first':>11} {'spawn later':>11} | {'spawn/run':>9}"
    print(header)
    print("-" * len(header))
    for world_size in options.world_sizes:
        run_first = time_run(world_size)
        run_later = statistics.median(time_run(world_size) for _ in range(options.run_repeats))
        spawn_first = time_spawn(world_size)
        spawn_later = statistics.median(time_spawn(world_size) for _ in range(options.spawn_repeats))
        print(f"{world_size:>5} | {run_first:>9.3f} {run_later:>9.3f} | {spawn_first:>11.2f} "
              f"{spawn_later:>11.2f} | {spawn_later / run_later:>8.0f}x", flush=True)

    times = sorted(time_run(4) for _ in range(options.many))
    print(f"\nhelpers.run, {options.many} launches at 4 ranks: median {statistics.median(times):.3f} s, "
          f"slowest {times[-1]:.3f} s, over 0.5 s: {sum(t > 0.5 for t in times)}")


if __name__ == "__main__":
    main()
