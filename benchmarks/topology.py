"""All-reduce within a node against across nodes, on the cluster's network
(helpers.on_a_cluster.network: a network namespace a node, joined by links shaped to LINK_MBIT):
two ranks on one node talk over its loopback, two ranks on two nodes over the shaped link. Prints
each size's bus bandwidth both ways and their ratio, in one run. As root:

    python benchmarks/topology.py

A rank of it runs as `python benchmarks/topology.py --rank R --master ADDRESS --port P`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LINK_MBIT = 800  # each node's link, megabits a second each way
SIZES = [2**20, 4 * 2**20, 16 * 2**20]  # float32 bytes a rank all-reduces
REPEATS = 5


def rank_main(rank: int, master: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=2)
    seconds = {}
    for size in SIZES:
        tensor = torch.ones(size // 4)
        dist.all_reduce(tensor)  # the connections and buffers made once, before timing
        times = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        seconds[size] = statistics.median(times)
    if rank == 0:
        print(json.dumps(seconds))
    dist.destroy_process_group()


def measure(network, nodes: tuple, ifname: str) -> dict:
    """Median seconds of an all-reduce per size, two ranks on `nodes` (one node twice: within)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": ifname}
    master = "127.0.0.1" if ifname == "lo" else network.address(nodes[0])
    ranks = [subprocess.Popen(
        network.command(node, [sys.executable, os.path.abspath(__file__), "--rank", rank,
                               "--master", master, "--port", 29500]),
        env=env, stdout=subprocess.PIPE, text=True) for rank, node in enumerate(nodes)]
    out = [process.communicate(timeout=300)[0] for process in ranks]
    if any(process.returncode for process in ranks):
        raise SystemExit(f"a rank failed: {out}")
    return {int(size): seconds for size, seconds in json.loads(out[0]).items()}


def bus_gbps(size: int, seconds: float) -> float:
    """Two ranks' all-reduce bus bandwidth in GB/s (nccl-tests' busbw: helpers.cost_model)."""
    from helpers.cost_model import bandwidths

    return bandwidths("all_reduce", 2, size, seconds)["busbw"] / 1e9


def main() -> None:
    from helpers.on_a_cluster.network import Network, unavailable

    if unavailable():
        print(f"benchmarks/topology.py: skipped, {unavailable()}")
        return
    network = Network.start(("n1", "n2"), link_mbit=LINK_MBIT)
    try:
        within = measure(network, ("n1", "n1"), "lo")
        across = measure(network, ("n1", "n2"), "eth0")
    finally:
        network.stop()
    print(f"all-reduce of two ranks, bus bandwidth in GB/s (median of {REPEATS}); "
          f"each node's link {LINK_MBIT} Mbit/s = {LINK_MBIT / 8e3:g} GB/s each way")
    print("| bytes a rank | within a node (loopback) | across nodes (the link) | within / across |")
    print("|---:|---:|---:|---:|")
    for size in SIZES:
        inside, outside = bus_gbps(size, within[size]), bus_gbps(size, across[size])
        print(f"| {size:,} | {inside:.3f} | {outside:.3f} | {inside / outside:.1f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int)
    parser.add_argument("--master")
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.rank is None:
        main()
    else:
        rank_main(args.rank, args.master, args.port)
