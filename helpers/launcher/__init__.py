"""The launcher: start N ranks, run a function on each, bring everything back to the kernel.

    run(fn, world_size)        fn(rank, world_size, ...) inside a process group the launcher made
    spawn(fn, args, nprocs)    fn(rank, *args), torch.multiprocessing.spawn's convention; the
                               function starts its own group (lecture and tutorial code, unchanged)

Parent side: `launch`; the worker pool the ranks are forked from: `pool`; what runs inside each
rank: `rank`; what the learner reads (output, errors, where ranks hung): `report`; the same
workers under torchrun: `torchrun`; what `run` returns, the backend and the device: `result`.
How it is built, and why: README.md in this folder.
"""

# In a Jupyter kernel the pool starts now, before this process imports torch below: the two
# imports then run side by side.
from helpers.launcher.pool import warm_up

warm_up(in_background=True, only_in_a_kernel=True)

from helpers.launcher.launch import run, spawn  # noqa: E402
from helpers.launcher.report import WorkerError, WorkerTimeout  # noqa: E402
from helpers.launcher.result import RunResult, default_backend, get_device  # noqa: E402

__all__ = ["RunResult", "WorkerError", "WorkerTimeout", "default_backend", "get_device", "run",
           "spawn", "warm_up"]
