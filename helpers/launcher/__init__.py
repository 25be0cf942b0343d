"""The launcher: start N ranks, run a function on each, bring everything back to the kernel.

    run(fn, world_size)        fn(rank, world_size, ...) inside a process group the launcher made
    spawn(fn, args, nprocs)    fn(rank, *args), torch.multiprocessing.spawn's convention; the
                               function starts its own group (lecture and tutorial code, unchanged)

Parent side: `launch`; the worker pool the ranks are forked from: `pool`; what runs inside each
rank: `rank`; what the learner reads (output, errors, where ranks hung): `report`; the same
workers under torchrun: `torchrun`; what `run` returns, the backend and the device: `result`.
How it is built, and why: README.md in this folder.
"""

import importlib

# In a Jupyter kernel the pool starts now, before this process imports torch: the two imports
# then run side by side.
from helpers.launcher.pool import warm_up

warm_up(in_background=True, only_in_a_kernel=True)

# The rest is loaded on first use, so that a rank, which imports `helpers` for its lessons'
# modules, never loads the kernel-side launcher (tests/test_structure.py checks it).
_HOMES = {"run": "launch", "spawn": "launch", "WorkerError": "report", "WorkerTimeout": "report",
          "WorkerInterrupted": "report", "RunResult": "result", "default_backend": "result",
          "get_device": "result"}

__all__ = ["RunResult", "WorkerError", "WorkerInterrupted", "WorkerTimeout", "default_backend",
           "get_device", "run", "spawn", "warm_up"]


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(f"helpers.launcher.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'helpers.launcher' has no attribute {name!r}")
