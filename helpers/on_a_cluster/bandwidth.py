"""The check a multi-node job runs before it trains: every rank says what Slurm and torchrun gave
it (its node, LOCAL_RANK, CUDA_VISIBLE_DEVICES, the device it takes), then all ranks time an
all-reduce, and rank 0 prints its bus bandwidth (nccl-tests' busbw: helpers.cost_model). Under
torchrun, on every node (gpu.sbatch's first step):

    torchrun --nnodes 2 --nproc-per-node 2 ... -m helpers.on_a_cluster.bandwidth [--megabytes 64]

With one GPU a rank, NCCL on the GPUs; else gloo on the CPU, as on the lesson's cluster, whose
GPUs are Slurm's alone. The slowest link bounds the bus bandwidth: across nodes, the network
(about 25 GB/s each way for a 200 Gbit/s InfiniBand port, more with a port per GPU). Far below it
is a wrong interface or transport (NET/Socket over Ethernet): NCCL_DEBUG=INFO says which it took.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics

import torch
import torch.distributed as dist

from helpers.cost_model import bandwidths
from helpers.launcher.result import get_device, node_backend
from helpers.timing import slowest_rank_seconds

REPEATS = 5


def given() -> str:
    """What this rank was given, in one line."""
    return (f"rank {dist.get_rank()} on {socket.gethostname()}: LOCAL_RANK "
            f"{os.environ.get('LOCAL_RANK')}, CUDA_VISIBLE_DEVICES "
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}, device {get_device()}, "
            f"backend {dist.get_backend()}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=64)
    options = parser.parse_args(argv)
    dist.init_process_group(node_backend())
    os.write(1, (given() + "\n").encode())  # one write: the ranks share the job's output
    size = int(options.megabytes * 2**20) // 4 * 4
    tensor = torch.ones(size // 4, device=get_device())
    dist.all_reduce(tensor)  # connections made once, before timing
    # each time the slowest rank's: a collective ends when its last rank is done (lesson 04)
    seconds = statistics.median(slowest_rank_seconds(lambda: dist.all_reduce(tensor))
                                for _ in range(REPEATS))
    if dist.get_rank() == 0:
        busbw = bandwidths("all_reduce", dist.get_world_size(), size, seconds)["busbw"]
        os.write(1, f"all-reduce of {size / 2**20:g} MiB over {dist.get_world_size()} ranks: "
                    f"busbw {busbw / 1e9:.3f} GB/s (median of {REPEATS})\n".encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
