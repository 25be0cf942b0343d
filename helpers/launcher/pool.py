"""The worker pool: a forkserver that imported torch once, from which every rank is forked.

This module imports only the standard library, so that the pool can start before the kernel
itself imports torch: `import helpers` in a Jupyter kernel starts it in the background, and the
two imports run side by side on two cores.
"""

from __future__ import annotations

import contextlib
import glob
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time

# OpenMP's threads wait for work asleep, never spinning (PyTorch's libgomp spins a while after
# each parallel operation by default). On a laptop the ranks, the kernel and, in the tests,
# several pytest workers share a few cores, and a thread that spins between two operations holds
# a core another rank is waiting for: the tests of three lessons took a third less CPU and wall
# time (benchmarks/README.md, "OpenMP's wait policy"). OpenMP reads it as torch loads it, so it is
# set here, before: for this process where it imports helpers before torch, and for the
# forkserver, whose ranks inherit it. A value set outside is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# What a rank of a lesson imports when it unpickles its worker: the course's shared layer (the
# launcher, which a module's `from helpers import run` brings, with filelock and html; the
# recorders, the reference, the layouts, the strategies, the checkers) and the torch modules that
# lessons 11-14 use in ranks (DCP, with fsspec for its storage; CommDebugMode; the memory
# tracker). A rank imported them on every launch, all of them making a 4-rank launch 0.19 s
# longer: in make test on 2026-11-30, 2,441 of 3,067 ranks imported helpers.instrument after the
# fork, and a rank 20 modules on average (benchmarks/README.md, "Launch time").
SHARED_LAYER = [
    "helpers.launcher.launch", "helpers.instrument", "helpers.reference", "helpers.timing",
    "helpers.layouts", "helpers.strategies", "helpers.rules", "helpers.exercises",
    "torch.utils.serialization", "torch.distributed.checkpoint", "fsspec",
    "torch.distributed.tensor.debug", "torch.distributed._tools",
]

# Imported once by the forkserver, so that no rank pays for them: torch, the parallelism modules
# of lessons 06-10 (together about 1.5 s more on one core; a rank importing them after the fork
# paid it on every launch), what a new rank needs to unpickle its pipe (popen_forkserver), and
# the shared layer. A rank that joins a group and returns imports nothing more
# (tests/test_launcher.py).
FORKSERVER_PRELOAD = [
    "torch", "torch.distributed", "cloudpickle", "helpers.launcher.rank",
    "multiprocessing.popen_forkserver",
    "torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining", "torch.distributed.optim",
    *SHARED_LAYER,
]


_warm_up_lock = threading.Lock()
_warm_up_thread = None


def warm_up(in_background: bool = False, only_in_a_kernel: bool = False) -> None:
    """Start the worker pool now: the forkserver imports torch and FORKSERVER_PRELOAD once (a few
    seconds), and one process is forked from it, so the first launch finds it ready.

    `import helpers` in a Jupyter kernel calls this in the background and shows a progress bar
    while it runs (and starts the kernel's heartbeat, helpers.notebook.Heartbeat, and has it show
    figures with their text size, helpers.notebook.show_figures_with_their_text_size); `run` and
    `spawn` wait for it if it has not finished."""
    global _warm_up_thread
    if only_in_a_kernel and not _in_a_kernel():
        return
    with _warm_up_lock:
        if _warm_up_thread is None:
            indicator = None
            if _in_a_kernel():
                from helpers.notebook import (
                    WarmUpIndicator,
                    keep_a_heartbeat,
                    show_figures_with_their_text_size,
                )

                keep_a_heartbeat()
                show_figures_with_their_text_size()
                if forkserver_pid() is None:
                    indicator = WarmUpIndicator()
            _warm_up_thread = threading.Thread(target=_start_forkserver, args=(indicator,),
                                               name="helpers-warm-up", daemon=True)
            _warm_up_thread.start()
    if not in_background:
        _warm_up_thread.join()


def _start_forkserver(indicator) -> None:
    try:
        with contextlib.suppress(OSError):  # no /proc/net/unix: nothing to clean up here
            remove_stale_forkserver_folders()
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
        first = context.Process(target=_exit_at_once)  # forked once the preloads are imported
        with main_module_kept_from_ranks(), interrupts_kept_from_the_pool():
            first.start()
        first.join()
    finally:
        if indicator is not None:
            indicator.done()


def _exit_at_once():
    pass


STALE_S = 600  # a socket no process has held for this long is a killed kernel's


def remove_stale_forkserver_folders() -> list:
    """Remove the forkserver folders that kernels before this one left, and return their paths.

    multiprocessing keeps the forkserver's socket in a folder of its own (tempdir/pymp-*) and
    removes it in Python's atexit, which a Jupyter kernel's shutdown never reaches (its kernel
    manager ends it first). A folder is stale when it is this user's and holds only sockets, each
    made more than STALE_S ago and held open by no process (Linux lists those that are in
    /proc/net/unix, read again just before the folder goes): a live forkserver's is never
    touched, nor even connected to, and a pool starting beside this one is not either. (A
    kernel still running whose forkserver was killed loses its folder too: it could not start
    its pool again anyway.) Elsewhere than Linux nothing is removed. Each new pool cleans up
    after the old ones."""
    removed = []
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "pymp-*")):
        try:
            if os.stat(folder).st_uid != os.getuid():
                continue
            paths = [os.path.join(folder, name) for name in os.listdir(folder)]
            old = [path for path in paths if stat.S_ISSOCK(os.lstat(path).st_mode)
                   and time.time() - os.lstat(path).st_mtime > STALE_S]
            if paths and len(old) == len(paths) and not set(old) & _open_sockets():
                shutil.rmtree(folder)
                removed.append(folder)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return removed


def _open_sockets() -> set:
    """The paths of the Unix sockets some process holds open (Linux's /proc/net/unix; its last
    column, which a path with spaces keeps whole). Raises OSError where there is no such file."""
    with open("/proc/net/unix", "rb") as table:
        rows = [line.rstrip(b"\n").split(None, 7) for line in table.readlines()[1:]]
    return {os.fsdecode(row[7]) for row in rows if len(row) == 8}


@contextlib.contextmanager
def interrupts_kept_from_the_pool():
    """Start processes that a Ctrl+C meant for this one cannot kill.

    Jupyter interrupts a kernel by sending SIGINT to its whole process group, which holds the
    forkserver and multiprocessing's resource tracker too. Each ignores SIGINT, but only once it
    is running: a forkserver still importing torch (seconds, more on a loaded machine) dies of an
    interrupt meant for the cell, and the next launch pays for a new one. A process started from
    here begins with SIGINT blocked (a signal mask survives fork and exec), so the signal waits
    until the forkserver ignores it, which discards it. Blocked in warm_up's thread alone, it
    does not delay the learner's interrupt: the main thread still takes it. In launch._start, in
    the main thread, an interrupt that lands while a dead forkserver starts again is raised once
    the ranks have started. The ranks forked from the pool unblock it (rank_main).

    The resource tracker is started first: it guards its own start the same way, but unblocks
    SIGINT in the calling thread afterwards (multiprocessing/resource_tracker.py, bpo-33613),
    which would leave the forkserver started after it unguarded."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no process groups to fear
        yield
        return
    multiprocessing.resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def main_module_kept_from_ranks():
    """Start processes without re-running the main module in them.

    multiprocessing makes every new process import the parent's main module again (from its
    `__spec__` under `python -m`, else from its `__file__`), so a script without an
    `if __name__ == "__main__":` guard would launch again from inside each rank, and a script
    read from standard input (`__file__ = "<stdin>"`) could not start any rank at all. The ranks
    need nothing from the main module: the worker and its arguments travel by value
    (cloudpickle). So the two names are hidden while the processes start."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__")
             if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None  # multiprocessing reads main.__spec__ itself: it must exist
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _in_a_kernel() -> bool:
    """Whether this process is a Jupyter kernel (not a script, a test run, or a rank)."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return "ipykernel" in sys.modules and type(shell).__name__ == "ZMQInteractiveShell"


def forkserver_pid():
    """The pid of this interpreter's forkserver, or None before it is started."""
    return multiprocessing.forkserver._forkserver._forkserver_pid
