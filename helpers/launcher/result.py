"""What `run` returns, and the two facts both launchers share: which backend a run uses and
which device a rank computes on. Kernel side and rank side alike (torchrun runs a worker in the
process that launched it)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers.launcher import report


@dataclass
class RunResult:
    """What `run` brings back: `results[r]` is rank r's return value, `stdout[r]` what it
    printed."""

    results: list
    stdout: list
    backend: str

    def __getitem__(self, rank):
        return self.results[rank]

    def __len__(self):
        return len(self.results)

    def __iter__(self):
        return iter(self.results)

    def __repr__(self):
        return report.format_results(self.results, self.backend)

    def _repr_html_(self):
        return report.results_html(self.results, self.backend)


GLOO_AND_NCCL = "cpu:gloo,cuda:nccl"  # NCCL for CUDA tensors, gloo for CPU ones, in one group


def default_backend(world_size: int) -> str:
    """With one GPU per rank, NCCL for CUDA tensors and gloo for CPU ones (a rank's CPU-side
    collectives, a checkpoint's planning, all_gather_object, keep working); gloo on the CPU
    otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return GLOO_AND_NCCL
    return "gloo"


def node_backend() -> str:
    """default_backend for a rank that torchrun started: its own node's ranks need a GPU each, not
    the whole job's (LOCAL_WORLD_SIZE, torchrun's, where set; else WORLD_SIZE, all on one
    machine: a script that starts a rank a Slurm task exports LOCAL_WORLD_SIZE itself)."""
    return default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))


def uses_nccl(backend: str) -> bool:
    """Whether `backend` ("nccl", or a per-device list such as "cpu:gloo,cuda:nccl") puts CUDA
    tensors on NCCL, so that each rank needs a GPU of its own."""
    return "nccl" in str(backend)


def get_device(rank: int | None = None) -> torch.device:
    """The device rank `rank` should put its tensors on: `cuda:<local rank>` under NCCL, else
    the CPU. Rank code builds its models, meshes, autocast and GradScaler on it."""
    if dist.is_initialized() and uses_nccl(dist.get_backend()):
        local = int(os.environ.get("LOCAL_RANK", rank if rank is not None else dist.get_rank()))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")
