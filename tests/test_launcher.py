"""helpers.run: results, output, errors, timeouts, clean-up. Every expected value is computed
here."""

import contextlib
import gc
import importlib
import json
import multiprocessing.resource_tracker
import os
import pathlib
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback

import psutil
import pytest
import torch
from workers import (
    abort_on_rank_one,
    all_reduce_worker,
    big_result_worker,
    device_worker,
    environment_worker,
    grad_worker,
    kwargs_worker,
    long_error_worker,
    printing_worker,
    raise_on_rank,
    recv_first_worker,
    send_first_worker,
    spin_worker,
    unpicklable_result_worker,
)

from helpers import WorkerError, WorkerTimeout, run
from helpers.launcher.pool import forkserver_pid
from helpers.reference import seeded_randn

# One of a tier's longest files: a tier starts it first (helpers/lessons.py).
STARTS_FIRST = True

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_equal_the_formula(world_size):
    out = run(all_reduce_worker, world_size, args=(0.5,), show_output=False)
    ranks_plus_one = sum(range(1, world_size + 1))
    expected = torch.arange(4, dtype=torch.float64) * ranks_plus_one + 0.5 * world_size
    assert len(out) == world_size
    for rank in range(world_size):
        torch.testing.assert_close(out[rank], expected)
        assert out.results[rank] is out[rank]
    assert out.backend == "gloo"


def test_kwargs_and_plain_data_come_back():
    out = run(kwargs_worker, 3, kwargs={"scale": 10, "offset": 1}, show_output=False)
    assert out.results == [{"rank": r, "world_size": 3, "value": r * 10 + 1} for r in range(3)]


def test_results_of_several_megabytes_arrive_intact():
    out = run(big_result_worker, 4, args=(8,), show_output=False)
    for rank in range(4):
        expected = seeded_randn(rank, 8 * 2**20 // 4)
        torch.testing.assert_close(out[rank], expected, rtol=0, atol=0)


def test_tensors_come_back_detached_on_cpu():
    out = run(grad_worker, 2, show_output=False)
    for rank in range(2):
        torch.testing.assert_close(out[rank]["weight"], torch.full((3,), float(rank)))
        torch.testing.assert_close(out[rank]["grad"], torch.full((3,), 2.0))
        torch.testing.assert_close(out[rank]["activation"], torch.full((3,), 3.0 * rank))
        assert not out[rank]["activation"].requires_grad
        assert out[rank]["activation"].device.type == "cpu"


def test_output_is_grouped_by_rank_in_rank_order(capsys):
    out = run(printing_worker, 3)
    shown = capsys.readouterr().out.splitlines()
    expected = [
        line
        for rank in range(3)
        for line in (f"[rank {rank}] line one from rank {rank}",
                     f"[rank {rank}] to stderr from rank {rank}",
                     f"[rank {rank}] raw fd write from rank {rank}")
    ]
    assert shown == expected
    assert out.stdout[2] == (
        "line one from rank 2\nto stderr from rank 2\nraw fd write from rank 2\n"
    )
    assert not any("[Gloo]" in text for text in out.stdout)


def test_show_output_false_prints_nothing(capsys):
    out = run(printing_worker, 2, show_output=False)
    assert capsys.readouterr().out == ""
    assert "line one from rank 1" in out.stdout[1]


def test_cpu_device_and_threads_fit_the_cores():
    out = run(device_worker, 2, show_output=False)
    cores = os.cpu_count()
    assert out.results == [("cpu", max(1, cores // 2))] * 2


def _modules_worker():
    """A worker cloudpickle ships by value (a nested function), so that unpickling it imports no
    test module: what it sees in sys.modules is what the rank's own start imported."""
    def modules(rank, world_size):
        return sorted(sys.modules)
    return modules


def test_a_rank_imports_nothing_the_pool_did_not_preload():
    """A launch is a fork, not an import: every module a rank needs to join and return is already
    in the forkserver (a rank entry in the kernel-side launch.py cost every launch 30-40 ms)."""
    from helpers.launcher.pool import FORKSERVER_PRELOAD

    code = ("import importlib, json, multiprocessing.forkserver, sys\n"
            f"for name in {FORKSERVER_PRELOAD!r}:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    preloaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True, cwd=REPO).stdout
    out = run(_modules_worker(), 2, show_output=False)
    for rank in range(2):
        assert set(out[rank]) - set(json.loads(preloaded)) == set()


INTERRUPTED_WHILE_STARTING = textwrap.dedent(
    """
    import json, os, signal, time
    import psutil
    from helpers.launcher import run
    from helpers.launcher import pool

    def sigint_blocked(rank, world_size):
        return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel, whoever started us
    pool.warm_up(in_background=True)
    while pool.forkserver_pid() is None:
        time.sleep(0.01)
    first = pool.forkserver_pid()
    time.sleep(0.3)  # the forkserver is importing torch now (seconds)
    starting = pool._warm_up_thread.is_alive()
    try:
        os.killpg(0, signal.SIGINT)  # what Jupyter's interrupt does: the kernel's whole group
        time.sleep(5)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    blocked = run(sigint_blocked, 2, show_output=False).results
    print(json.dumps(dict(starting=starting, interrupted=interrupted, blocked=blocked,
                          same=pool.forkserver_pid() == first, alive=psutil.pid_exists(first))))
    """)


def test_an_interrupt_while_the_pool_starts_stops_the_cell_not_the_pool():
    """Jupyter's interrupt is a SIGINT to the kernel's process group, forkserver included. The
    forkserver ignores SIGINT only once it has imported torch; started with SIGINT blocked, it
    lives through an interrupt that lands before (it died, and the next launch started another:
    seconds, a timeout in a loaded slideshow). Its ranks take SIGINT as any process does."""
    completed = subprocess.run([sys.executable, "-c", INTERRUPTED_WHILE_STARTING],
                               capture_output=True, text=True, cwd=REPO, timeout=120,
                               start_new_session=True)  # its own group: the SIGINT stays there
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == dict(starting=True, interrupted=True,
                                                blocked=[False, False], same=True, alive=True)
    assert "EOFError" not in completed.stderr and "KeyboardInterrupt" not in completed.stderr

@pytest.mark.parametrize("failing_rank", [0, 2])
def test_exception_names_rank_and_original_message(failing_rank):
    with pytest.raises(WorkerError) as caught:
        run(raise_on_rank, 3, args=(failing_rank,), show_output=False)
    error = caught.value
    assert error.rank == failing_rank
    assert error.type_name == "ValueError"
    assert error.message == f"rank {failing_rank} refuses"
    text = str(error)
    assert text.startswith(f"rank {failing_rank} raised ValueError: rank {failing_rank} refuses")
    assert "in raise_on_rank" in text and 'raise ValueError(f"rank {rank} refuses")' in text
    others = [rank for rank in range(3) if rank != failing_rank]
    assert f"ranks {others[0]}, {others[1]} stopped or failed after rank {failing_rank}" in text
    assert set(error.others) <= set(others)


def test_a_rank_killed_by_a_signal_is_the_root_cause():
    with pytest.raises(WorkerError) as caught:
        run(abort_on_rank_one, 2, show_output=False)
    assert caught.value.rank == 1
    assert str(caught.value).startswith("rank 1 died from signal SIGABRT")


def test_unpicklable_result_is_a_clear_error():
    with pytest.raises(WorkerError, match="cannot be sent back to the notebook"):
        run(unpicklable_result_worker, 2, show_output=False)


def test_send_send_deadlock_ends_at_the_timeout_naming_the_call():
    started = time.monotonic()
    with pytest.raises(WorkerTimeout) as caught:
        run(send_first_worker, 2, timeout=3, show_output=False)
    assert time.monotonic() - started < 3 + 10  # it ends; not a speed claim
    line = send_first_worker.__code__.co_firstlineno + 2
    for rank in range(2):
        where = caught.value.where[rank]
        assert where.startswith(
            "blocked in torch.distributed.send(), called from send_first_worker")
        assert f'workers.py", line {line}: dist.send(tensor, dst=1 - rank)' in where


def _hogs(count: int, seconds: float = 180, after: float = 0) -> list:
    """Processes that keep the cores busy for at most `seconds`, from `after` seconds on: a loaded
    machine, as a lecture hall's laptop runs a browser and a server beside the kernel."""
    spin = (f"import time\ntime.sleep({after})\nend = time.time() + {seconds}\n"
            "while time.time() < end: pass")
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]


def _both_recv_located(timeout, loaded_after: float = 0):
    hogs = _hogs(2, after=loaded_after)
    try:
        with pytest.raises(WorkerTimeout) as caught:
            run(recv_first_worker, 2, timeout=timeout, show_output=False)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    line = recv_first_worker.__code__.co_firstlineno + 2
    for rank in range(2):
        where = caught.value.where[rank]
        assert where.startswith("blocked in torch.distributed.recv(), called from "
                                "recv_first_worker"), caught.value
        assert f'workers.py", line {line}: dist.recv(tensor, src=1 - rank)' in where


def test_a_deadlock_on_a_loaded_machine_is_located_on_every_rank():
    """The launcher's timeout ends a hang before the group's own (rank.group_timeout), which
    would end the rank that reached its call first and name no other."""
    _both_recv_located(timeout=3)


@pytest.mark.soak  # a minute: run()'s default timeout
@pytest.mark.starts_first  # 50 s of it waiting: others fill the cores
def test_a_deadlock_with_the_default_timeout_on_a_loaded_machine_is_located_on_every_rank():
    """Loaded from 10 s before the timeout: the ranks wait in recv until then, and the launcher
    locates them under load (the test above loads the machine from the start, the ranks' too)."""
    import inspect

    timeout = inspect.signature(run).parameters["timeout"].default
    _both_recv_located(timeout=timeout, loaded_after=timeout - 10)


def test_a_ranks_error_is_raised_with_no_launcher_frame_under_the_call():
    with pytest.raises(WorkerError) as caught:
        run(raise_on_rank, 2, args=(1,), show_output=False)
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert [(os.path.basename(frame.filename), frame.name) for frame in frames] == [
        ("test_launcher.py", "test_a_ranks_error_is_raised_with_no_launcher_frame_under_the_call"),
        ("launch.py", "run")]


def test_a_long_error_message_is_shown_once():
    with pytest.raises(WorkerError) as caught:
        run(long_error_worker, 2, show_output=False)
    text = str(caught.value)
    assert text.startswith("rank 1 raised RuntimeError: the first line of a long error (the "
                           "whole message is at the end of the traceback)\n"), text
    assert text.count("x" * 5000) == 1


@pytest.mark.soak  # a kernel of its own, its pool and ranks started and killed: 10 s and more
def test_ranks_end_with_a_kernel_killed_under_them():
    """A kernel killed (SIGKILL: no finally, no atexit) while its ranks sleep: its forkserver
    ends, and the ranks with it (rank.py's _die_with_the_pool), not at their timeout."""
    code = textwrap.dedent(
        """
        import time
        from helpers import run

        def sleeper(rank, world_size):
            time.sleep(600)

        run(sleeper, 2, timeout=600)
        """
    )
    kernel = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        ranks = []
        while time.monotonic() < deadline and len(ranks) < 2:  # the forkserver's children
            time.sleep(0.2)
            ranks = [child for child in psutil.Process(kernel.pid).children(recursive=True)
                     if child.ppid() != kernel.pid]
        assert len(ranks) >= 2, "the ranks did not start"
    finally:
        kernel.kill()
        kernel.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=20)
    assert alive == [], alive


def test_a_new_pool_removes_the_forkserver_folders_that_killed_kernels_left(tmp_path, monkeypatch):
    from helpers.launcher.pool import STALE_S, remove_stale_forkserver_folders

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folders = {name: tmp_path / f"pymp-{name}" for name in ("left", "live", "fresh", "empty",
                                                            "other")}
    for folder in folders.values():
        folder.mkdir()

    def dead_socket(path, age):  # bound, then closed: the file stays, held by no process
        held = socket.socket(socket.AF_UNIX)
        held.bind(str(path))
        held.close()
        os.utime(path, (time.time() - age, time.time() - age))

    dead_socket(folders["left"] / "listener-1", STALE_S + 60)  # a killed kernel's
    dead_socket(folders["fresh"] / "listener-2", 0)  # a pool binding its own, just now
    listening = socket.socket(socket.AF_UNIX)  # a live forkserver's, however old
    listening.bind(str(folders["live"] / "listener-3"))
    listening.listen()
    os.utime(folders["live"] / "listener-3", (0, 0))
    (folders["other"] / "notes").write_text("not a socket")
    try:
        assert remove_stale_forkserver_folders() == [str(folders["left"])]
        assert [name for name, folder in folders.items() if folder.exists()] == [
            "live", "fresh", "empty", "other"]
    finally:
        listening.close()


def test_timeout_in_plain_python_code_reports_the_line():
    with pytest.raises(WorkerTimeout) as caught:
        run(spin_worker, 2, timeout=2, show_output=False)
    first = spin_worker.__code__.co_firstlineno
    possible = {
        f'in spin_worker at "{spin_worker.__code__.co_filename}", line {first + 3}: while True:',
        f'in spin_worker at "{spin_worker.__code__.co_filename}", line {first + 4}: pass',
    }
    assert caught.value.where[1] in possible
    assert "  rank 0: finished" in str(caught.value)


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        ({"world_size": 0}, ValueError, "world_size must be between 1 and 64"),
        ({"world_size": 1000}, ValueError, "world_size must be between 1 and 64"),
        ({"world_size": 2.0}, TypeError, "world_size must be an int"),
        ({"world_size": 2, "args": (threading.Lock(),)}, TypeError, "must be picklable"),
        ({"world_size": 2, "timeout": 0}, ValueError, "timeout must be a positive number"),
        ({"world_size": 2, "backend": "mpi"}, ValueError, "backend must be one of"),
        ({"world_size": 2, "args": 5}, TypeError, "args must be a tuple"),
        ({"world_size": 2, "env": ["A=1"]}, TypeError, "env must be a dict"),
    ],
)
def test_bad_arguments_fail_before_anything_starts(arguments, error, message):
    before = _worker_processes()
    with pytest.raises(error, match=message):
        run(all_reduce_worker, **arguments)
    assert _worker_processes() == before


def test_env_reaches_the_ranks_and_the_kernel_environment_does_too(monkeypatch):
    monkeypatch.setenv("COURSE_SET_IN_KERNEL", "after the forkserver started")
    extra = run(environment_worker, 2, args=("COURSE_EXTRA",), env={"COURSE_EXTRA": 7},
                show_output=False)
    kernel = run(environment_worker, 2, args=("COURSE_SET_IN_KERNEL",), show_output=False)
    assert extra.results == ["7", "7"]
    assert kernel.results == ["after the forkserver started"] * 2
    assert "COURSE_EXTRA" not in os.environ


def test_not_a_function_is_refused():
    with pytest.raises(TypeError, match="needs a function"):
        run("all_reduce_worker", 2)


def test_spawn_start_method_gives_the_same_results():
    out = run(all_reduce_worker, 2, args=(1.0,), start_method="spawn", show_output=False)
    expected = torch.arange(4, dtype=torch.float64) * 3 + 2.0
    for rank in range(2):
        torch.testing.assert_close(out[rank], expected)


def _worker_processes():
    """Processes started for ranks: our descendants, less the two long-lived helpers that
    multiprocessing keeps per interpreter (the forkserver and the resource tracker)."""
    helpers = {forkserver_pid(), multiprocessing.resource_tracker._resource_tracker._pid}
    return {p.pid for p in psutil.Process().children(recursive=True) if p.pid not in helpers}


def _leftover_files():
    return set(os.listdir(tempfile.gettempdir()))


def _open_fds():
    """Each descriptor this process has open, and what it points at."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # listdir's own descriptor, closed by now
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return fds


@pytest.mark.soak  # repetition: a leak or a rare abort shows over 50 launches
def test_nothing_is_left_behind_after_50_launches_an_error_and_a_timeout(tmp_path, monkeypatch):
    run(all_reduce_worker, 2, args=(0.0,), show_output=False)  # forkserver is up
    # A private temp dir, so that other programs using /tmp meanwhile cannot confuse the count.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gc.collect()  # an earlier test's garbage closing its descriptors mid-count is not a leak
    fds, files = _open_fds(), _leftover_files()
    for _ in range(50):
        run(all_reduce_worker, 4, args=(0.0,), show_output=False)
    with pytest.raises(WorkerError):
        run(raise_on_rank, 4, args=(1,), show_output=False)
    with pytest.raises(WorkerTimeout):
        run(send_first_worker, 2, timeout=2, show_output=False)
    assert _worker_processes() == set()
    opened = _open_fds().items() - fds.items()  # closing one is fine; keeping a new one is a leak
    assert opened == set()
    assert _leftover_files() == files


def test_keyboard_interrupt_stops_every_worker():
    # Python turns SIGINT into KeyboardInterrupt only if SIGINT was not ignored when it started;
    # a non-interactive shell (a script) ignores it in the background jobs it starts. Ctrl-C
    # here, whatever started pytest.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run(send_first_worker, 2, timeout=30, show_output=False)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert _worker_processes() == set()


SCRIPT = textwrap.dedent(
    """
    import dataclasses, sys
    import torch, torch.distributed as dist
    from helpers import run

    @dataclasses.dataclass
    class Message:
        rank: int
        total: float

    class Doubler(torch.nn.Module):
        def forward(self, x):
            return 2 * x

    def make_offset(value):
        return lambda: value  # a closure over value, shipped by value

    def worker(rank, world_size, model, offset):
        value = model(torch.tensor([float(rank)])) + offset()
        dist.all_reduce(value)
        return Message(rank, value.item())

    if __name__ == "__main__":
        out = run(worker, int(sys.argv[1]), args=(Doubler(), make_offset(1.0)), show_output=False)
        assert all(isinstance(message, Message) for message in out)
        print(repr([dataclasses.astuple(message) for message in out.results]))
    """
)


def _run_script(tmp_path, name, world_size):
    script = tmp_path / name
    script.write_text(SCRIPT)
    return subprocess.Popen(
        [sys.executable, str(script), str(world_size)], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _expected_script_output(world_size):
    total = float(sum(2 * r + 1 for r in range(world_size)))
    return repr([(rank, total) for rank in range(world_size)])


def test_worker_defined_in_main_script_runs(tmp_path):
    stdout, stderr = _run_script(tmp_path, "cell_like.py", 3).communicate(timeout=120)
    assert stdout.strip() == _expected_script_output(3), stderr


@pytest.mark.soak  # a race between two kernels, in fresh interpreters
def test_two_processes_launching_at_once_both_succeed(tmp_path):
    first = _run_script(tmp_path, "first.py", 2)
    second = _run_script(tmp_path, "second.py", 4)
    for process, world_size in ((first, 2), (second, 4)):
        stdout, stderr = process.communicate(timeout=120)
        assert stdout.strip() == _expected_script_output(world_size), stderr


def test_runresult_repr_shows_every_rank():
    out = run(kwargs_worker, 2, kwargs={"scale": 1}, show_output=False)
    assert repr(out) == (
        "RunResult: 2 ranks, gloo\n"
        "  rank 0: {'rank': 0, 'world_size': 2, 'value': 0}\n"
        "  rank 1: {'rank': 1, 'world_size': 2, 'value': 1}"
    )
    assert "<td style='text-align:right'>rank 1</td>" in out._repr_html_()


def test_results_pickle_round_trip():
    out = run(kwargs_worker, 2, kwargs={"scale": 2}, show_output=False)
    assert pickle.loads(pickle.dumps(out.results)) == out.results


def test_torchrun_runs_the_same_worker(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    completed = subprocess.run(
        # --log-dir: the agent's own files stay in tmp_path, not in a new /tmp/torchelastic_*
        [torchrun, "--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
         "-m", "helpers.launcher.torchrun",
         "helpers.processes_and_groups.workers:halves_worker"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert completed.returncode == 0, completed.stderr
    lines = sorted(line for line in completed.stdout.splitlines() if line.startswith("[rank"))
    assert lines[0].startswith("[rank 0] device=cpu result=")
    assert "'group_sum': 0" in lines[0] and "'group_sum': 1" in lines[1]


def test_every_documented_torchrun_target_exists():
    """The `-m helpers.launcher.torchrun module:function` lines of the docstring, README and
    lesson 01 name a worker that imports."""
    root = pathlib.Path(__file__).resolve().parent.parent
    texts = [(root / path).read_text() for path in (
        "helpers/launcher/torchrun.py", "helpers/launcher/README.md",
        "notebooks/01_processes_and_groups.ipynb")]
    targets = {target for text in texts
               for target in re.findall(r"-m helpers\.launcher\.torchrun (helpers[\w.]*:\w+)",
                                        text)}
    assert targets  # the pattern still finds them
    for target in targets:
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target


@pytest.mark.soak  # two real torchrun agents
def test_two_torchrun_nodes_meet_through_c10d_rendezvous(tmp_path):
    """Two torchrun processes on this machine act as two nodes of 2 processes each; the c10d
    rendezvous gives them different node ranks, so the four processes are global ranks 0-3."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-id", "course-test", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "-m", "helpers.launcher.torchrun",
               "helpers.processes_and_groups.workers:halves_worker"]
    nodes = [subprocess.Popen(command[:1] + ["--log-dir", str(tmp_path / f"logs{node}")]
                              + command[1:], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in range(2)]
    lines = []
    for node in nodes:
        stdout, stderr = node.communicate(timeout=180)
        assert node.returncode == 0, stderr
        node_lines = [line for line in stdout.splitlines() if line.startswith("[rank")]
        assert len(node_lines) == 2, stdout  # each node ran two of the four ranks
        lines += node_lines
    halves = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    for rank in range(4):
        line = next(line for line in lines if line.startswith(f"[rank {rank}] "))
        assert f"'group_ranks': {halves[rank]}" in line
        assert f"'group_sum': {sum(halves[rank])}" in line


def test_root_cause_skips_errors_that_echo_a_peer_failure():
    from helpers.launcher.rank import ExceptionReport

    echo = ExceptionReport("RuntimeError", "Connection closed by peer [127.0.0.1]:4242", [], 1.0)
    cause = ExceptionReport("ValueError", "bad shape", [], 2.0)
    later = ExceptionReport("KeyError", "'x'", [], 3.0)
    error = WorkerError.from_reports({0: echo, 1: cause, 2: later}, {}, [3], ["", "", "", ""], 4)
    assert (error.rank, error.type_name) == (1, "ValueError")
    assert error.others == {0: "RuntimeError: Connection closed by peer [127.0.0.1]",
                            2: "KeyError: 'x'"}
    assert str(error).endswith("ranks 0, 2 stopped or failed after rank 1 (what they reported is "
                               "in this error's .others).\nrank 3 had finished.")


def test_simultaneous_root_causes_name_the_lowest_rank():
    from helpers.launcher.rank import ExceptionReport

    errors = {rank: ExceptionReport("RuntimeError", f"mismatch seen by {rank}", [],
                                    5.0 - rank * 1e-3)
              for rank in range(3)}
    assert WorkerError.from_reports(errors, {}, [], ["", "", ""], 3).rank == 0
    # a loaded machine: rank 2 raised 0.4 s before rank 0, the same bug all the same
    errors = {rank: ExceptionReport("RuntimeError", f"mismatch seen by {rank}", [],
                                    5.0 - rank * 0.2)
              for rank in range(3)}
    assert WorkerError.from_reports(errors, {}, [], ["", "", ""], 3).rank == 0
    # another type of error soon after is another bug: the earliest is named
    errors = {0: ExceptionReport("ValueError", "a check of rank 0's", [], 5.1),
              2: ExceptionReport("KeyError", "'x'", [], 5.0)}
    assert WorkerError.from_reports(errors, {}, [], ["", "", ""], 3).rank == 2


def test_a_worker_without_source_file_is_still_located_on_timeout():
    code = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from helpers import WorkerTimeout, run
        def both_send_first(rank, world_size):
            dist.send(torch.zeros(1), dst=1 - rank)
        try:
            run(both_send_first, 2, timeout=2, show_output=False)
        except WorkerTimeout as timeout:
            print(timeout.where[0])
        """
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=120, cwd=REPO)
    where = 'blocked in torch.distributed.send(), called from both_send_first at "<string>", line 5'
    # Python 3.13 keeps the source of `python -c` for tracebacks, so the line itself is shown;
    # before 3.13 it is gone, and the report says so
    expected = (f"{where}: dist.send(torch.zeros(1), dst=1 - rank)" if sys.version_info >= (3, 13)
                else f"{where} (its source is not available)")
    assert completed.stdout.strip() == expected, completed.stdout + completed.stderr


def test_run_under_torchrun_warns_about_the_arguments_it_ignores(tmp_path):
    code = textwrap.dedent(
        """
        import warnings
        from helpers import run
        def rank_and_size(rank, world_size):
            return rank, world_size
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = run(rank_and_size, world_size=4, show_output=False, env={"A": "1"})
        print(out.results)
        print(caught[0].message)
        """
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torchrun_environment = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=120, cwd=REPO, env={**os.environ, **torchrun_environment})
    results, warning = completed.stdout.strip().splitlines()
    assert results == "[(0, 1)]", completed.stderr
    assert warning == ("run() under torchrun ignores world_size=4 (torchrun started 1 processes); "
                       "show_output=False (each process prints straight to torchrun's output); "
                       "env (set variables before torchrun starts, e.g. in the shell)")


UNGUARDED_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from helpers import run
    def total(rank, world_size):
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value)
        return value.item()
    print(run(total, 3, show_output=False).results)
    """
)


# Each starts a fresh interpreter (seconds): one way in make test, the others in the soak tier.
@pytest.mark.parametrize("how", [pytest.param("python - < script", marks=pytest.mark.soak),
                                 "python script.py",
                                 pytest.param("python -m script", marks=pytest.mark.soak)])
def test_a_script_without_a_main_guard_runs_once(how, tmp_path):
    """The ranks do not re-run the main module, however python was given it."""
    (tmp_path / "script.py").write_text(UNGUARDED_SCRIPT)
    command = {"python - < script": [sys.executable, "-"],
               "python script.py": [sys.executable, "script.py"],
               "python -m script": [sys.executable, "-m", "script"]}[how]
    completed = subprocess.run(
        command, input=UNGUARDED_SCRIPT if how.endswith("< script") else None,
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": REPO})
    assert completed.stdout.strip() == "[6.0, 6.0, 6.0]", completed.stderr
    assert "Traceback" not in completed.stderr, completed.stderr


INTERRUPTED = textwrap.dedent(
    """
    import os, signal, sys, tempfile, threading, time
    import torch, torch.distributed as dist
    import helpers
    from helpers import WorkerInterrupted, run
    from helpers.launcher import launch

    FLAGS = tempfile.mkdtemp()  # each rank leaves a file as it reaches the line it hangs at

    def deadlock(rank, world_size):
        open(os.path.join(FLAGS, f"deadlock{rank}"), "w").close()
        dist.recv(torch.zeros(1), src=1 - rank)

    def spins(rank, world_size):
        open(os.path.join(FLAGS, f"spins{rank}"), "w").close()
        # (one line: a sample of a two-line loop lands on its test or on its body)
        while rank == 1: pass

    def interrupt_the_group(name, ranks):
        while not all(os.path.exists(os.path.join(FLAGS, f"{name}{rank}")) for rank in ranks):
            time.sleep(0.1)
        time.sleep(0.5)  # from the file to the line
        print("waiting:", launch.waiting(), flush=True)
        os.killpg(os.getpgid(0), signal.SIGINT)  # as Jupyter does (the ranks have groups of
        # their own: it reaches the launcher and the pool)

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel, whoever started
    # us (a shell's background job inherits SIGINT ignored: CI's runs did)
    helpers.warm_up()
    for worker, ranks in ((deadlock, (0, 1)), (spins, (1,))):
        threading.Thread(target=interrupt_the_group, args=(worker.__name__, ranks),
                         daemon=True).start()
        try:
            run(worker, 2, timeout=100, show_output=False)
        except WorkerInterrupted as interrupted:
            print(f"{worker.__name__}:", interrupted.where)
        except BaseException as other:  # for the test's message
            print(f"{worker.__name__}: {type(other).__name__}: {other}")
        print("after:", launch.waiting(), flush=True)
    """
)


def test_an_interrupted_launch_says_where_each_rank_was(tmp_path):
    """Esc, I, I in Jupyter (SIGINT to the kernel's process group) or Ctrl-C in a shell, while the
    ranks hang: WorkerInterrupted, a KeyboardInterrupt, names each unfinished rank's line, blocked
    in a call or running its own Python; while it waited, `waiting()` said for what."""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    completed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                               timeout=180, cwd=REPO, start_new_session=True)
    lines = completed.stdout.splitlines() + [""] * 6  # (short of lines: the asserts say what)
    said = completed.stdout + completed.stderr
    source = INTERRUPTED.splitlines()
    recv, spin = (source.index(line) + 1 for line in (
        "    dist.recv(torch.zeros(1), src=1 - rank)",
        "    while rank == 1: pass"))
    assert lines[0].startswith("waiting: ranks 0 and 1 of 2 have not returned; the timeout "
                               "stops them in "), said
    where = {"deadlock": {
        rank: f'blocked in torch.distributed.recv(), called from deadlock at "{script}", line '
              f"{recv}: dist.recv(torch.zeros(1), src=1 - rank)" for rank in (0, 1)},
        "spins": {1: f'in spins at "{script}", line {spin}: while rank == 1: pass'}}
    assert lines[1] == f"deadlock: {where['deadlock']}", said
    assert lines[2] == "after: None", said
    assert lines[3].startswith("waiting: rank 1 of 2 has not returned; the timeout stops it in "
                               ), said
    assert lines[4] == f"spins: {where['spins']}", said
    assert lines[5] == "after: None", said
    assert issubclass(helpers_interrupted(), KeyboardInterrupt)


def helpers_interrupted():
    from helpers import WorkerInterrupted

    return WorkerInterrupted


def test_a_rank_takes_nccl_when_each_rank_of_its_own_node_has_a_gpu(monkeypatch):
    """Two nodes of two GPUs, four ranks: torchrun's LOCAL_WORLD_SIZE, not WORLD_SIZE, says
    whether this node's ranks each have a GPU (lesson 15's gpu.sbatch on a GPU cluster)."""
    from helpers.launcher.result import GLOO_AND_NCCL, node_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert node_backend() == "gloo"  # four ranks on a machine of two GPUs: not one each
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert node_backend() == GLOO_AND_NCCL
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert node_backend() == "gloo"
