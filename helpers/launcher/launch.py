"""`run(fn, world_size)` and `spawn(fn, args, nprocs)`: start N ranks, bring everything back.

Every notebook uses this (first: notebooks/01_processes_and_groups.ipynb). One call:

1. checks its arguments and pickles `(fn, args, kwargs)` by value with cloudpickle, so a worker
   written in a notebook cell runs, before any process starts;
2. makes a private temp dir: the ranks rendezvous through a file store there (no port, no DNS)
   and leave their output in it; it is removed when the call returns;
3. starts the ranks with `torch.multiprocessing.start_processes` from a forkserver that has already
   imported torch and its parallelism modules, so a launch is a fork (~0.1 s), not an interpreter
   start and an import (~3 s);
4. drains every rank's pipe while it waits (results of any size; no full-pipe deadlock);
5. shows each rank's output grouped in rank order, and raises `WorkerError` (the root-cause rank and
   its traceback) or `WorkerTimeout` (where every rank was blocked); no process outlives the call.

`spawn` (and `run(..., init_group=False)`) skip step 2's group: the ranks get MASTER_ADDR,
MASTER_PORT (a free port), RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, and the function
calls `init_process_group` itself. Under torchrun (RANK and WORLD_SIZE set) `run` runs the worker
in this process instead: see `helpers.launcher.torchrun`. Design notes: README.md beside this file.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import warnings

import cloudpickle
import filelock
import torch
import torch.multiprocessing

from helpers.launcher import rank as _rank
from helpers.launcher import report
from helpers.launcher.pool import (
    interrupts_kept_from_the_pool,
    main_module_kept_from_ranks,
    warm_up,
)
from helpers.launcher.report import WorkerError, WorkerInterrupted, WorkerTimeout
from helpers.launcher.result import GLOO_AND_NCCL, RunResult, default_backend, uses_nccl
from helpers.launcher.torchrun import run_in_place

MAX_WORLD_SIZE = 64
BACKENDS = ("gloo", "nccl", GLOO_AND_NCCL)
START_METHODS = ("forkserver", "spawn")
# After the first failure, how long the other ranks get to report their own errors (they usually
# fail a moment later with "Connection closed by peer") before they are stopped.
ERROR_GRACE_S = 1.0
# gloo's full-mesh connect sometimes fails with "Connection closed by peer" while the ranks join
# (2 launches in 500 here). It happens before any worker code runs on that rank, so the launch is
# simply made again, at once; a join that keeps failing is reported like any other error.
JOIN_RETRIES = 2
STACK_DUMP_WAIT_S = 1.0


def run(
    fn,
    world_size: int = 2,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 60,
    backend: str | None = None,
    *,
    init_group: bool = True,
    start_method: str = "forkserver",
    threads_per_rank: int | None = None,
    show_output: bool = True,
    env: dict | None = None,
) -> RunResult:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks and return every result.

    `timeout` (seconds) bounds the whole call; `show_output=False` keeps the ranks' output in
    `out.stdout` without printing it. `env` adds environment variables for the ranks only, set
    before they join the group (e.g. {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}). With
    `init_group=False` the ranks join no group: `fn` calls `init_process_group` itself (see
    `spawn`). Raises `WorkerError` if a rank raises or dies, and `WorkerTimeout` if the run
    outlives `timeout`; in every case no rank survives the call.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _warn_ignored_under_torchrun(world_size, show_output, env, threads_per_rank)
        return run_in_place(fn, args, kwargs or {}, backend, timeout)
    try:
        return _launch(fn, world_size, args, kwargs, timeout, backend, init_group=init_group,
                       pass_world_size=True, start_method=start_method,
                       threads_per_rank=threads_per_rank, show_output=show_output, env=env)
    except (WorkerError, WorkerTimeout) as failure:
        # A rank failed, or the ranks hung: raised here, with none of the launcher's frames
        # under this call, so that what follows the learner's own line is the rank's report.
        raise failure.with_traceback(None) from None


SPAWN_LOCK = os.path.join(tempfile.gettempdir(), "helpers-spawn.lock")


def spawn(
    fn,
    args: tuple = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "forkserver",
    *,
    timeout: float = 60,
    show_output: bool = True,
    env: dict | None = None,
) -> RunResult:
    """`torch.multiprocessing.spawn`, for a notebook: run `fn(i, *args)` on `nprocs` processes.

    The drop-in for `mp.spawn(fn, args=(world_size, ...), nprocs=world_size, join=True)`, for code
    that starts its own process group (a `setup()` that sets MASTER_ADDR/MASTER_PORT and calls
    `dist.init_process_group`): no group is made for it. Each process gets MASTER_ADDR=127.0.0.1,
    MASTER_PORT (a free port; a worker may set its own), RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE, so `init_process_group("gloo")` with `env://` works too. A group the
    function leaves initialised is destroyed. Everything else is `run`'s: a function defined in a
    cell, output grouped by rank, `WorkerError`, `WorkerTimeout`, no process left behind; and the
    return values come back (`mp.spawn` returns None). `daemon` changes nothing: no process
    outlives the call.
    """
    if not join:
        raise ValueError("helpers.spawn always waits for the processes (join=True): it brings "
                         "their output and return values back, and leaves none running")
    # Such code usually binds a port of its own choosing (the CS336 lecture's setup() binds 15623):
    # two launches at once, from two notebooks or two test workers, would collide on it. So
    # spawn()'s launches take turns on this machine.
    with filelock.FileLock(SPAWN_LOCK):
        try:
            return _launch(fn, nprocs, args, None, timeout, None, init_group=False,
                           pass_world_size=False, start_method=start_method,
                           threads_per_rank=None, show_output=show_output, env=env)
        except (WorkerError, WorkerTimeout) as failure:
            raise failure.with_traceback(None) from None  # (run's comment says why)


def _launch(fn, world_size, args, kwargs, timeout, backend, *, init_group, pass_world_size,
            start_method, threads_per_rank, show_output, env) -> RunResult:
    kwargs = {} if kwargs is None else kwargs
    backend = backend or default_backend(world_size)
    _check_arguments(fn, world_size, args, kwargs, timeout, backend, start_method, env)
    payload = _pickle_payload(fn, args, kwargs)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)

    if start_method == "forkserver":
        warm_up()  # at once if the pool is warm; else start it (or wait for the one starting)
    started = time.monotonic()  # the timeout counts from here: the pool's start is not the worker's
    out_dir = tempfile.mkdtemp(prefix="helpers-run-")
    job = _rank.Job(
        payload=payload, world_size=world_size, backend=backend, out_dir=out_dir,
        timeout_s=timeout, threads_per_rank=threads, init_group=init_group,
        pass_world_size=pass_world_size, environ=_rank_environ(env or {}, init_group),
        sys_path=list(sys.path), cwd=os.getcwd(),
    )
    processes, connections, messages, died = [], [], {}, {}
    try:
        try:
            for job.attempt in range(1 + JOIN_RETRIES):
                processes, connections, messages, died = [], [], {}, {}
                _start(job, start_method, processes, connections)
                unfinished = _collect(processes, connections, started + timeout, messages, died)
                if not _join_failed(messages) or job.attempt == JOIN_RETRIES:
                    break
                _stop(processes, connections)
                report.clear_outputs(out_dir, world_size)
        except KeyboardInterrupt:
            _interrupted(processes, world_size, out_dir, started, messages, died, show_output)
        stacks = _dump_stacks(processes, unfinished, out_dir) if unfinished else {}
        outputs = report.read_outputs(out_dir, world_size)
        if show_output:
            report.print_outputs(outputs)
        if unfinished:
            raise WorkerTimeout(timeout, stacks, messages, died, world_size)
        results = _unpack(messages, died, outputs)
        return RunResult(results, outputs, backend)
    finally:
        _stop(processes, connections)
        shutil.rmtree(out_dir, ignore_errors=True)


def _interrupted(processes, world_size, out_dir, started, messages, died, show_output):
    """The learner interrupted the launch (Esc, I, I; Ctrl-C): raise WorkerInterrupted, which says
    where each rank that had not returned was, from its stack, as a timeout does (a rank that
    had not started yet says so)."""
    seconds = time.monotonic() - started
    unfinished = [rank for rank in range(len(processes)) if rank not in messages | died]
    stacks = _dump_stacks(processes, unfinished, out_dir) if unfinished else {}
    stacks.update({rank: report.NOT_STARTED for rank in range(len(processes), world_size)})
    if show_output:
        report.print_outputs(report.read_outputs(out_dir, world_size))
    raise WorkerInterrupted(seconds, stacks, messages, died, world_size) from None


def _warn_ignored_under_torchrun(world_size, show_output, env, threads_per_rank):
    """Under torchrun the processes already exist: say which of run()'s arguments cannot apply."""
    started = int(os.environ["WORLD_SIZE"])
    ignored = []
    if world_size != started:
        ignored.append(f"world_size={world_size} (torchrun started {started} processes)")
    if not show_output:
        ignored.append("show_output=False (each process prints straight to torchrun's output)")
    if env:
        ignored.append("env (set variables before torchrun starts, e.g. in the shell)")
    if threads_per_rank:
        ignored.append("threads_per_rank (set OMP_NUM_THREADS for torchrun)")
    if ignored:
        warnings.warn("run() under torchrun ignores " + "; ".join(ignored), stacklevel=3)


def _check_arguments(fn, world_size, args, kwargs, timeout, backend, start_method, env):
    if not callable(fn):
        raise TypeError(f"run() needs a function to run on every rank, got {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(
            f"world_size must be between 1 and {MAX_WORLD_SIZE} on one machine, got {world_size}"
        )
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of extra arguments, got {type(args).__name__}")
    if not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    if env is not None and not isinstance(env, dict):
        raise TypeError(f"env must be a dict of environment variables, got {type(env).__name__}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if uses_nccl(backend) and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"backend={backend!r} needs one GPU per rank: {world_size} ranks, "
            f"{torch.cuda.device_count()} GPUs here"
        )
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")


def _pickle_payload(fn, args, kwargs) -> bytes:
    try:
        return cloudpickle.dumps((fn, tuple(args), kwargs))
    except Exception as exc:
        raise TypeError(
            f"the worker and its arguments must be picklable to reach the ranks: {exc}"
        ) from exc


def _rank_environ(extra: dict, init_group: bool) -> dict:
    """The kernel's environment now (the forkserver's is from its start), gloo kept on loopback,
    the variables of an env:// rendezvous for ranks that start their own group, then `extra`.
    The per-rank ones (RANK, LOCAL_RANK) are added in each rank."""
    environ = dict(os.environ)
    loopback = loopback_interface()
    if loopback:
        environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    if not init_group:
        environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        # The TCP store rank 0 starts asks DNS for the name of 127.0.0.1 (for its log messages);
        # an unanswered query costs the resolver's 5 s timeout. Ask once, for 1 s: after a failed
        # lookup torch stops looking names up in that process (README.md beside this file).
        environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    environ.update({name: str(value) for name, value in extra.items()})
    return environ


def loopback_interface() -> str | None:
    """'lo' on Linux, 'lo0' on macOS. Binding gloo to it also skips a hostname lookup per rank."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in names if name.startswith("lo")), None)


def _free_port() -> int:
    """A TCP port nobody listens on now (the kernel picks it), for rank 0's store."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(job: _rank.Job, start_method: str, processes: list, connections: list) -> None:
    """Start the ranks into `processes`, with `connections` their pipes. Both are filled before
    an interrupt held back while they start (interrupts_kept_from_the_pool) is raised on the way
    out, so that the caller still stops the ranks it interrupted."""
    receivers, senders = zip(*(multiprocessing.Pipe(duplex=False) for _ in range(job.world_size)))
    connections.extend(receivers)
    try:
        # a forkserver that died is started again from here: keep the kernel's Ctrl+C from it too
        with main_module_kept_from_ranks(), interrupts_kept_from_the_pool():
            context = torch.multiprocessing.start_processes(
                _rank.rank_entry, args=(job, list(senders)), nprocs=job.world_size, join=False,
                start_method=start_method,
            )
            processes.extend(context.processes)
    finally:
        for sender in senders:  # the ranks hold their own copies now
            sender.close()


def _collect(processes, connections, deadline, messages: dict, died: dict) -> list:
    """Wait for one message per rank, reading each as soon as it arrives; watch for deaths.

    Fills `messages` (rank -> message) and `died` (rank -> exit code of a rank that ended without
    a word) as they come, so that what arrived survives an interrupt; returns the ranks still
    running at the deadline (empty unless it timed out). A rank already in either is not waited
    for. While it waits, `waiting()` says for what (the cell's heartbeat shows it).
    """
    global _waiting
    try:
        return _wait_for_messages(processes, connections, deadline, messages, died)
    finally:
        _waiting = None


def _wait_for_messages(processes, connections, deadline, messages, died) -> list:
    global _waiting
    pending = {connection: rank for rank, connection in enumerate(connections)
               if rank not in messages and rank not in died}
    sentinel_rank = {process.sentinel: rank for rank, process in enumerate(processes)}
    first_error = None
    while pending:
        _waiting = (len(connections), tuple(sorted(pending.values())), deadline)
        now = time.monotonic()
        limit = deadline if first_error is None else min(deadline, first_error + ERROR_GRACE_S)
        if now >= limit:
            break
        waitables = list(pending) + [sentinel for sentinel, r in sentinel_rank.items()
                                     if connections[r] in pending]
        for ready in multiprocessing.connection.wait(waitables, timeout=limit - now):
            rank = pending.get(ready, sentinel_rank.get(ready))
            connection = connections[rank]
            if connection not in pending:
                continue
            del pending[connection]
            try:
                # A rank that ended may still have its message in the pipe: read that first.
                if ready is not connection and not connection.poll():
                    raise EOFError
                messages[rank] = pickle.loads(connection.recv_bytes())
            except EOFError:  # ended without a word: killed by a signal, or os._exit
                processes[rank].join(1)
                died[rank] = processes[rank].exitcode
            if rank in died or messages[rank][0] != "ok":
                if messages.get(rank, ("",))[0] == "init_error":
                    return []  # no worker code has run there: retry at once
                first_error = first_error if first_error is not None else time.monotonic()
    timed_out = first_error is None and pending
    return sorted(pending.values()) if timed_out else []


_waiting = None  # (world size, the ranks not yet returned, the deadline) while _collect waits


def waiting() -> str | None:
    """What this kernel's launch waits for, as a sentence, or None when none waits: "ranks 0 and
    2 of 4 have not returned; the timeout stops them in 23 s"."""
    now = _waiting
    if now is None:
        return None
    world_size, ranks, deadline = now
    named = (f"rank {ranks[0]}" if len(ranks) == 1 else
             "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}")
    return (f"{named} of {world_size} {'has' if len(ranks) == 1 else 'have'} not returned; "
            f"the timeout stops {'it' if len(ranks) == 1 else 'them'} in "
            f"{max(0.0, deadline - time.monotonic()):.0f} s")


def _dump_stacks(processes, ranks, out_dir) -> dict:
    """Ask each unfinished rank for its Python stack (faulthandler) and return rank -> dump text."""
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError):  # it has just ended
            os.kill(processes[rank].pid, _rank.STACK_DUMP_SIGNAL)
    stopped = {rank for rank in ranks if _stopped(processes[rank].pid)}  # they cannot answer
    sizes, settled, give_up = {}, set(stopped), time.monotonic() + STACK_DUMP_WAIT_S
    while len(settled) < len(ranks) and time.monotonic() < give_up:
        time.sleep(0.05)
        for rank in set(ranks) - stopped:  # a dump is complete once non-empty and not growing
            size = _size(_rank.stack_path(out_dir, rank))
            if size and size == sizes.get(rank):
                settled.add(rank)
            sizes[rank] = size
    dumps = {}
    for rank in ranks:  # a rank that had not started yet has no file: an empty dump
        if rank in stopped:
            dumps[rank] = report.STOPPED
        elif _size(_rank.stack_path(out_dir, rank)):
            with open(_rank.stack_path(out_dir, rank)) as stack_file:
                dumps[rank] = stack_file.read()
        else:
            dumps[rank] = ""
    return dumps


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, or a debugger holds it): it runs nothing, so it
    cannot write its stack. Linux's /proc tells; elsewhere, False."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _unpack(messages, died, outputs):
    errors = {rank: message[1] for rank, message in messages.items() if message[0] != "ok"}
    if errors or died:
        finished = sorted(rank for rank, message in messages.items() if message[0] == "ok")
        raise WorkerError.from_reports(errors, died, finished, outputs, len(outputs))
    return [cloudpickle.loads(messages[rank][1]) for rank in range(len(outputs))]


def _join_failed(messages) -> bool:
    return any(kind == "init_error" for kind, _ in messages.values())


def _stop(processes, connections):
    """Kill whatever is still running (the rank and anything it started), reap it, close pipes."""
    for process in processes:
        if process.is_alive():
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                process.kill()
    for process in processes:
        process.join(5)
        process.close()
    for connection in connections:
        connection.close()
