"""The same workers on a real cluster: `torchrun ... -m helpers.launcher.torchrun module:function`.

One machine, 4 processes:

    torchrun --standalone --nproc-per-node 4 \
        -m helpers.launcher.torchrun helpers.processes_and_groups.workers:halves_worker

Two machines, 8 processes each: run the same line on both. The c10d rendezvous hands out the node
ranks (with the default static rendezvous both machines would take node rank 0):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-id my-job \
        --rdzv-endpoint HOST:29500 -m helpers.launcher.torchrun module:function

torchrun starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...; here each
process joins the group from those variables, runs the worker once and prints its result.
`helpers.run` called from code running under torchrun takes the same path (`run_in_place`), so a
script written for the notebook runs unchanged on many machines. Used by notebook 01.
"""

from __future__ import annotations

import argparse
import importlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from helpers.launcher.result import (
    GLOO_AND_NCCL,
    RunResult,
    get_device,
    node_backend,
    uses_nccl,
)


def run_in_place(fn, args=(), kwargs=None, backend=None, timeout=1800) -> RunResult:
    """Run `fn` as this process's rank; every rank gets every rank's result (all_gather_object)."""
    owns_group = not dist.is_initialized()
    if owns_group:
        backend = backend or node_backend()
        if uses_nccl(backend):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        result = fn(rank, world_size, *args, **(kwargs or {}))
        if isinstance(result, torch.Tensor):
            result = result.detach().cpu()
        results = [None] * world_size
        dist.all_gather_object(results, result)
        return RunResult(results, [""] * world_size, dist.get_backend())
    finally:
        if owns_group:
            dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "target", help="module:function, e.g. helpers.processes_and_groups.workers:halves_worker")
    parser.add_argument("--backend", choices=("gloo", "nccl", GLOO_AND_NCCL), default=None)
    options = parser.parse_args(argv)
    module_name, _, function_name = options.target.partition(":")
    if not function_name:
        parser.error("target must look like module:function")
    fn = getattr(importlib.import_module(module_name), function_name)
    out = run_in_place(fn, backend=options.backend)
    rank = int(os.environ["RANK"])
    line = f"[rank {rank}] device={get_device(rank)} result={out.results[rank]!r}\n"
    os.write(1, line.encode())  # one write: the ranks share this stdout, lines must not interleave


if __name__ == "__main__":
    main()
