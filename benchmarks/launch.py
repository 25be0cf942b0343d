"""Launch time of helpers.run and helpers.spawn against plain torch.multiprocessing.spawn, side by
side in one run.

    python benchmarks/launch.py [--world-sizes 2 4 8] [--many 200]

1. For each N: the floor, the median of later launches of helpers.run and their ratio, taken in
   turns; then run's first launch (it starts the worker pool, once per kernel) and mp.spawn's. The
   floor is the same forkserver forking N ranks that only join a gloo group and exit
   (helpers.launcher.rank.join_and_leave): what is left of run's time is its own work (pickling,
   output capture, results, the finish wait). A regression shows as a ratio, on any machine.
2. At 4 ranks, later launches of workers that lessons 06-10 run: one that imports torch's
   parallelism modules (DDP, FSDP, tensor parallel, pipelining, distributed optimizers), measured
   here and in a pool that preloads torch alone (a second process, --preload torch); and one that
   starts its own group the way lecture code does (helpers.spawn: a TCP store, env://). And one
   that imports what a lesson's worker module brings (pool.SHARED_LAYER: the launcher, the
   recorders, DCP, ...), here and in a pool that does not preload it (--preload parallelism).
3. `--many` launches of helpers.run at 4 ranks: median, slowest, how many took over 0.5 s.
"""

import argparse
import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import run, spawn
from helpers.launcher import pool
from helpers.launcher.launch import loopback_interface
from helpers.launcher.rank import join_and_leave


def join_and_return(rank, world_size):
    return rank


def import_parallelism_modules(rank, world_size):
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.optim  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    return rank


def import_the_shared_layer(rank, world_size):
    for name in pool.SHARED_LAYER:
        importlib.import_module(name)
    return rank


def start_own_group(rank, world_size):
    """What lecture code does: env:// rendezvous on rank 0's TCP store, then leave."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    dist.destroy_process_group()


def spawn_entry(rank, world_size, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    start_own_group(rank, world_size)


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def seconds(launch):
    started = time.perf_counter()
    launch()
    return time.perf_counter() - started


def time_mp_spawn(world_size):
    return seconds(lambda: mp.spawn(spawn_entry, args=(world_size, free_port()), nprocs=world_size))


def time_floor(world_size):
    """N ranks forked from run's own pool that join a group and exit, nothing else."""
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        with pool.main_module_kept_from_ranks():
            return seconds(lambda: mp.start_processes(
                join_and_leave, args=(store, world_size), nprocs=world_size,
                start_method="forkserver"))


def time_run(world_size, worker=join_and_return):
    return seconds(lambda: run(worker, world_size, show_output=False))


def time_helpers_spawn(world_size):
    return seconds(lambda: spawn(start_own_group, args=(world_size,), nprocs=world_size,
                                 show_output=False))


def summary(times):
    times = sorted(times)
    return {"median": statistics.median(times), "slowest": times[-1],
            "over_1s": sum(t > 1 for t in times)}


def in_a_smaller_pool(preload, repeats):
    """Later launches from a pool that preloads less, measured in a separate process (a process
    has one pool): `preload` "torch" (torch alone) times the parallelism-importing worker,
    "parallelism" (all but the shared layer) the shared-layer-importing one."""
    completed = subprocess.run(
        [sys.executable, __file__, "--preload", preload, "--repeats", str(repeats)],
        capture_output=True, text=True, check=True)
    return json.loads(completed.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--spawn-repeats", type=int, default=3, help="later mp.spawn launches")
    parser.add_argument("--repeats", type=int, default=20, help="later launches of the others")
    parser.add_argument("--many", type=int, default=200)
    parser.add_argument("--preload", choices=["torch", "parallelism"], help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.preload == "torch":
        pool.FORKSERVER_PRELOAD = ["torch", "torch.distributed", "cloudpickle",
                                   "helpers.launcher.rank"]
        worker = import_parallelism_modules
    elif options.preload == "parallelism":
        pool.FORKSERVER_PRELOAD = [name for name in pool.FORKSERVER_PRELOAD
                                   if name not in pool.SHARED_LAYER]
        worker = import_the_shared_layer
    if options.preload:
        time_run(4)
        print(json.dumps(summary([time_run(4, worker) for _ in range(options.repeats)])))
        return

    # The floor's ranks find gloo on loopback, as run's do: the pool, started by the first run
    # below, inherits this.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    print(f"{os.cpu_count()} cores, torch {torch.__version__}; median of later launches, "
          f"in seconds\n")
    header = (f"{'ranks':>5} | {'floor':>6} {'run':>6} {'run/floor':>9} | {'run first':>9} | "
              f"{'spawn first':>11} {'spawn later':>11} {'spawn/run':>9}")
    print(f"helpers.run against its floor and against plain mp.spawn\n{header}\n"
          f"{'-' * len(header)}")
    for world_size in options.world_sizes:
        run_first = time_run(world_size)
        floors, runs = [], []
        for _ in range(options.repeats):  # in turns, so that the machine's load falls on both
            floors.append(time_floor(world_size))
            runs.append(time_run(world_size))
        floor, run_later = statistics.median(floors), statistics.median(runs)
        spawn_first = time_mp_spawn(world_size)
        spawn_later = statistics.median(time_mp_spawn(world_size)
                                        for _ in range(options.spawn_repeats))
        print(f"{world_size:>5} | {floor:>6.3f} {run_later:>6.3f} {run_later / floor:>8.2f}x | "
              f"{run_first:>9.3f} | {spawn_first:>11.2f} {spawn_later:>11.2f} "
              f"{spawn_later / run_later:>8.0f}x", flush=True)

    cases = {
        "run, joins and returns": summary(time_run(4) for _ in range(options.repeats)),
        "run, imports the parallelism modules": summary(
            time_run(4, import_parallelism_modules) for _ in range(options.repeats)),
        "the same, pool preloads torch alone": in_a_smaller_pool("torch", options.repeats),
        "run, imports the shared layer": summary(
            time_run(4, import_the_shared_layer) for _ in range(options.repeats)),
        "the same, pool does not preload it": in_a_smaller_pool("parallelism", options.repeats),
        "helpers.spawn, worker starts its own group": summary(
            time_helpers_spawn(4) for _ in range(options.repeats)),
    }
    print(f"\nLater launches at 4 ranks, {options.repeats} each")
    print(f"{'':<45} {'median':>8} {'slowest':>8} {'over 1 s':>8}")
    for label, numbers in cases.items():
        print(f"{label:<45} {numbers['median']:>8.3f} {numbers['slowest']:>8.3f} "
              f"{numbers['over_1s']:>8}")

    times = sorted(time_run(4) for _ in range(options.many))
    print(f"\nhelpers.run, {options.many} launches at 4 ranks: "
          f"median {statistics.median(times):.3f} s, slowest {times[-1]:.3f} s, "
          f"over 0.5 s: {sum(t > 0.5 for t in times)}")


if __name__ == "__main__":
    main()
