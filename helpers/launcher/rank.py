"""What runs inside each rank's process: capture output, join the group, call the worker, report.

The parent side is `helpers.launcher.launch`; this module is preloaded by the forkserver so a launch
costs a fork, not an `import torch`. Every rank sends exactly one message back on its pipe, then
leaves with `os._exit`:
``("ok", result_bytes)``, ``("error", ExceptionReport)`` when the worker raised, or
``("init_error", ExceptionReport)`` when joining the process group failed (before the worker ran).
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

STACK_DUMP_SIGNAL = signal.SIGUSR1
FINISH_WAIT_S = 1.0


def group_timeout(timeout_s: float) -> timedelta:
    """The process group's (and its store's) own timeout, well past the launcher's. The
    launcher's counts from the launch and reports where every rank waits; a collective's, started
    when a rank reaches the call, would end that rank alone, with its own line, and the report
    would name no other: the launcher's must end a hang first, every time, on a loaded machine
    too. (Under torchrun no launcher watches: run_in_place keeps the timeout it is given.)"""
    return timedelta(seconds=2 * timeout_s + 30)


@dataclass
class Job:
    """Everything a rank needs, pickled once by the parent and handed to every rank."""

    payload: bytes  # cloudpickle of (fn, args, kwargs), shipped by value
    world_size: int
    backend: str
    out_dir: str
    timeout_s: float
    threads_per_rank: int
    init_group: bool = True  # False: the worker calls init_process_group itself (spawn)
    pass_world_size: bool = True  # fn(rank, world_size, *args) (run) or fn(rank, *args) (spawn)
    environ: dict = field(default_factory=dict)  # the kernel's, as of this launch
    sys_path: list = field(default_factory=list)
    cwd: str = "."
    attempt: int = 0  # a join that failed is made again with a fresh store file


@dataclass
class ExceptionReport:
    """An exception raised in a rank, in a form the parent can always unpickle."""

    type_name: str
    message: str
    frames: list  # (filename, lineno, function name), outermost first
    raised_at: float  # time.time() when it was caught: the earliest one is the root cause


def output_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.out")


def store_path(out_dir: str, attempt: int) -> str:
    return os.path.join(out_dir, f"store{attempt}")


def finish_path(out_dir: str, attempt: int) -> str:
    return os.path.join(out_dir, f"finish{attempt}")


def stack_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.stack")


def rank_entry(rank: int, job: Job, senders: list) -> None:
    """What `torch.multiprocessing.start_processes` calls in each rank.

    It lives here, in a module the forkserver preloads, so that unpickling it in a new rank imports
    nothing: a rank entry in the kernel-side `launch` made every rank import the launcher, its
    report and `filelock`, 30-40 ms on every launch (tests/test_launcher.py checks it).
    start_processes hands every rank the same arguments: only this rank's pipe is kept open, so that
    a rank which dies leaves its pipe with no writer (the parent reads EOF at once)."""
    for other, sender in enumerate(senders):
        if other != rank:
            sender.close()
    rank_main(rank, job, senders[rank])


def rank_main(rank: int, job: Job, result_conn) -> None:
    """One rank's life, from rank_entry: output captured, the group joined, the worker run, one
    message sent, and out."""
    os.setpgrp()  # own process group: the parent can kill this rank and anything it started
    if hasattr(signal, "pthread_sigmask"):  # the pool started blocking it: pool.py
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _capture_output(job.out_dir, rank)
    _die_with_the_pool()
    os.environ.clear()
    os.environ.update(job.environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job.world_size),
                      LOCAL_WORLD_SIZE=str(job.world_size))
    sys.path[:] = job.sys_path
    os.chdir(job.cwd)
    dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG was read when the forkserver started
    torch.set_num_threads(job.threads_per_rank)
    _keep_destroyed_groups_alive()
    try:
        fn, args, kwargs = cloudpickle.loads(job.payload)
    except BaseException as exc:  # noqa: BLE001
        _send_and_exit(result_conn, ("error", _report(exc)))
    if job.init_group:
        try:
            _init_process_group(rank, job)
        except BaseException as exc:  # noqa: BLE001 - the launcher may retry a failed join
            _send_and_exit(result_conn, ("init_error", _report(exc)))
    try:
        if job.pass_world_size:
            result = fn(rank, job.world_size, *args, **kwargs)
        else:
            result = fn(rank, *args, **kwargs)
        message = ("ok", _dumps_result(result))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        # A worker that joins its own group can meet gloo's failed join too: launch again.
        kind = "init_error" if _failed_to_join(exc) else "error"
        _send_and_exit(result_conn, (kind, _report(exc)))
    _send(result_conn, message)
    _wait_at_the_finish(rank, job)
    if dist.is_initialized():  # the worker may have left the group itself, or made its own
        dist.destroy_process_group()
    _exit()


def _wait_at_the_finish(rank: int, job: Job) -> None:
    """Wait, at most FINISH_WAIT_S, until every rank has returned from the worker.

    A rank that leaves at once can cut a peer's connection while the peer still completes its side
    of a gloo handshake (`new_group` in the last lines of a worker). But a peer that waits forever
    for this rank (a recv with no send) must learn soon that it is gone: so the wait is short.
    """
    finish = dist.FileStore(finish_path(job.out_dir, job.attempt), job.world_size)
    wait_for_every_rank(finish, "finished", job.world_size, FINISH_WAIT_S)


def wait_for_every_rank(store, key: str, world_size: int, seconds: float | None = None) -> None:
    """Count this rank in at `key` of `store`, then wait until all `world_size` ranks have (at
    most `seconds`, when given)."""
    store.add(key, 1)
    give_up = None if seconds is None else time.monotonic() + seconds
    while store.add(key, 0) < world_size and (give_up is None or time.monotonic() < give_up):
        time.sleep(0.002)


def _failed_to_join(exc: BaseException) -> bool:
    """gloo's full-mesh connect failed inside `init_process_group`: no collective has run yet."""
    names = {frame.name for frame in traceback.extract_tb(exc.__traceback__)}
    return "init_process_group" in names and "connectFullMesh" in str(exc)


_destroyed_groups = []


def _keep_destroyed_groups_alive() -> None:
    """Make `destroy_process_group` keep a reference to the groups it destroys, until os._exit.

    torch 2.13 can deadlock when the last reference to a gloo group goes while the GIL is held:
    ~ProcessGroupGloo joins its worker thread, and that thread waits for the GIL to release a
    Python object it kept (gdb: c10d::Reducer::~Reducer > ~ProcessGroupGloo > std::thread::join,
    while pt_gloo_runloop waits in take_gil). That happens when a DDP model outlives
    `destroy_process_group` in a tutorial's cleanup(), and goes at the worker's return. With the
    groups kept, their destructors never run: the rank leaves with os._exit.
    """
    destroy = dist.distributed_c10d.destroy_process_group

    def destroy_process_group(group=None):
        world = dist.distributed_c10d._world
        _destroyed_groups.extend(list(world.pg_map) if group is None else [group])
        destroy(group)

    destroy_process_group.__doc__ = destroy.__doc__
    dist.destroy_process_group = dist.distributed_c10d.destroy_process_group = destroy_process_group


def _send(result_conn, message) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    result_conn.send_bytes(pickle.dumps(message))


def _exit() -> None:
    # Skip interpreter shutdown: torch's C++ destructors can abort after a DDP backward
    # ("terminate called without an active exception") once the results are already out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _send_and_exit(result_conn, message) -> None:
    try:
        _send(result_conn, message)
    finally:
        _exit()


def _die_with_the_pool() -> None:
    """End this rank when the process it was forked from ends: a kernel killed with its ranks
    running must not leave them running on, nor waiting in a collective until the group's
    timeout. The pool's forkserver ends once no process holds the write end of its life line, a
    pipe whose other end it watches: the kernel holds it, and multiprocessing hands every process
    it forks a copy (for processes of its own, which a rank starts otherwise). This rank closes
    its copy, so the forkserver ends with the kernel, and asks Linux to end the rank with the
    thread that forked it, the forkserver's only one (PR_SET_PDEATHSIG; elsewhere, only the copy
    is closed; under the "spawn" start method, with the thread of the kernel that started it)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the call
        os._exit(1)


def _capture_output(out_dir: str, rank: int) -> None:
    """Send fd 1 and 2 (Python prints and C++ logs alike) to this rank's file; arm the stack
    dump."""
    log_fd = os.open(output_path(out_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    # Kept open for the life of the process: faulthandler writes to its file descriptor.
    stack_file = open(stack_path(out_dir, rank), "w")  # noqa: SIM115
    faulthandler.register(STACK_DUMP_SIGNAL, file=stack_file, all_threads=True)


def _init_process_group(rank: int, job: Job) -> None:
    """Join the group through a FileStore in this run's private directory.

    Not a TCPStore: its client and server look up a host name for every connection (to log the
    peer as ::ffff:127.0.0.1, which /etc/hosts does not list), and when that DNS query goes
    unanswered the resolver waits 5 s. A file needs no port, no DNS and no network interface.
    """
    timeout = group_timeout(job.timeout_s)
    store = dist.FileStore(store_path(job.out_dir, job.attempt), job.world_size)
    store.set_timeout(timeout)
    device_id = None
    if "nccl" in job.backend:  # "nccl" or "cpu:gloo,cuda:nccl"
        device_id = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        job.backend,
        store=store,
        rank=rank,
        world_size=job.world_size,
        timeout=timeout,
        device_id=device_id,
    )


def join_and_leave(rank: int, store_file: str, world_size: int) -> None:
    """The least a rank forked from the pool can do: join a gloo group through a file store, wait
    until every rank has joined (one that left at once could cut a peer's handshake), and leave.
    benchmarks/launch.py starts these from the same forkserver to measure the floor that `run`'s
    own work (pickling, output, results, errors) adds to."""
    store = dist.FileStore(store_file, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    wait_for_every_rank(store, "joined", world_size)
    os._exit(0)


class _ByValuePickler(cloudpickle.Pickler):
    """cloudpickle, plus: tensors travel detached and on the CPU (never a CUDA or autograd
    handle)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and (obj.device.type != "cpu" or obj.requires_grad):
            return _identity, (obj.detach().cpu(),)
        return super().reducer_override(obj)


def _identity(value):
    return value


def dumps_by_value(value) -> bytes:
    buffer = io.BytesIO()
    _ByValuePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


class ResultNotPicklable(TypeError):
    """The worker returned something that cannot travel back (a lock, a generator, an open file)."""


def _dumps_result(result) -> bytes:
    try:
        return dumps_by_value(result)
    except Exception as exc:
        raise ResultNotPicklable(
            f"the worker's return value cannot be sent back to the notebook ({exc}); "
            "return plain data: tensors, numbers, lists, dicts, dataclasses"
        ) from exc


def _report(exc: BaseException) -> ExceptionReport:
    frames = [
        (frame.filename, frame.lineno, frame.name)
        for frame in traceback.extract_tb(exc.__traceback__)
        if frame.filename != __file__
    ]
    return ExceptionReport(type(exc).__name__, str(exc), frames, time.time())
