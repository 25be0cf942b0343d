"""One answer, checked in a sandbox: untrusted code that costs only its own points.

`check_in_sandbox(job)` runs `python -m helpers.grading.sandbox` under util-linux's `unshare`, in
new namespaces of its own, and reads back one verdict. What the answer's code meets there:

- **its own processes** (a PID namespace): it sees no other process; when the sandbox's first
  process ends, the kernel ends every process left in it, ranks that never end included, and a
  signal it sends reaches only its own;
- **no network but loopback** (a network namespace with `lo` alone, up: the ranks' rendezvous);
- **a read-only file system** (its mounts made read-only, recursively), but for a fresh
  `/tmp` and `/dev/shm` of its own, which vanish with it; it starts in `/tmp/work`;
- **nothing to find**: the submissions folder (every student's notebooks, the grades), every
  `solutions.py`, its compiled bytecode and the course's git history are covered by empty mounts;
- **another user**: as root, the sandbox becomes `nobody`; otherwise it runs in a user namespace
  nested in the one that made its mounts, so that it can undo none of them;
- **limits**: memory per process (RLIMIT_AS), the size of a file it writes, processes (as
  `nobody`), and the wall clock, after which the whole sandbox is killed; of what it prints, the
  first 64 KiB are kept and the rest read and dropped.

Inside, the needed cells and the answer cell run in order as a kernel would run them, with
`check` recording the function it is handed; then the exercise's own checker judges that
function, and its verdict goes back on a pipe as one JSON line.

What it does not protect: the checker runs in the same process as the student's code (as a test
run in the student's kernel does), so a student who sets out to patch the checker can forge their
own verdict. Every other student's grade, the solutions and the machine stay out of reach.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

KEPT_OUTPUT = 64 * 1024  # bytes of what a sandbox prints that are kept (the rest is dropped)
NOBODY = 65534
STATUSES = ("passed", "failed", "error", "timeout")


@dataclass(frozen=True)
class Limits:
    seconds: float = 300  # wall clock for the whole answer: its cells, then every case
    memory: int = 6 << 30  # bytes of address space per process (RLIMIT_AS)
    file_size: int = 64 << 20  # bytes of any one file written (RLIMIT_FSIZE)
    processes: int = 256  # as nobody (root's sandbox): processes at once (RLIMIT_NPROC)


@dataclass(frozen=True)
class Verdict:
    status: str  # one of STATUSES
    message: str  # what the learner would read in the notebook, or what happened
    seconds: float


def check_in_sandbox(answers, hide=(), limits: Limits | None = None,
                     user_namespace: bool | None = None) -> dict:
    """Run each answer, `(exercise, cells)` with `cells` ((index, source), ..., the answer cell
    last), and its exercise's checker on the function the cells hand to check(), all in one
    sandbox (one submission's), each in a process of its own, isolated as the module says.
    `hide`: paths the sandbox must not see. `user_namespace`: make it in a user namespace (the
    way without root; the default where this process is not root). Returns exercise -> Verdict."""
    limits = limits or Limits()
    results_read, results_write = os.pipe()
    job = {"answers": [[exercise, [list(cell) for cell in cells]] for exercise, cells in answers],
           "hide": list(hide), "results": results_write, "limits": limits.__dict__,
           "course": os.path.dirname(os.path.dirname(os.path.dirname(__file__)))}
    if user_namespace is None:
        user_namespace = os.geteuid() != 0
    command = ["unshare", *(["--user", "--map-root-user"] if user_namespace else []),
               "--net", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child",
               sys.executable, "-m", "helpers.grading.sandbox"]
    start = time.monotonic()
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, pass_fds=(results_write,),
                               start_new_session=True, cwd="/")
    os.close(results_write)
    printed, said = _Drain(process.stdout), _Drain(os.fdopen(results_read, "rb"))
    try:
        process.stdin.write(json.dumps(job).encode())
        process.stdin.close()
    except BrokenPipeError:
        pass
    try:  # each answer has its time inside; this bounds the sandbox's own start and end
        process.wait(timeout=limits.seconds * len(answers) + 120)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _kill(process)
    printed.join(), said.join()
    verdicts = {}
    for line in said.text().splitlines():
        try:
            one = json.loads(line)
            if one["exercise"] in dict(answers) and one["status"] in STATUSES:
                verdicts.setdefault(one["exercise"], Verdict(
                    one["status"], str(one["message"])[:4000], float(one["seconds"])))
        except (ValueError, KeyError, TypeError):
            continue
    lost = Verdict("error", "The sandbox ended before this answer's check said anything (the "
                   f"submission's processes were killed, exit status {process.returncode}). "
                   f"What it printed last:\n{printed.text()[-1500:]}",
                   time.monotonic() - start)
    return {exercise: verdicts.get(exercise, lost) for exercise, _ in answers}


class _Drain(threading.Thread):
    """Reads a stream to its end, keeping the first KEPT_OUTPUT bytes: a sandbox that prints
    without end neither blocks on a full pipe nor fills the grader's memory."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.kept, self.dropped = stream, bytearray(), 0
        self.start()

    def run(self):
        while chunk := self.stream.read1(65536):  # a buffered reader, both streams
            room = KEPT_OUTPUT - len(self.kept)
            self.kept += chunk[:max(room, 0)]
            self.dropped += max(len(chunk) - max(room, 0), 0)
        self.stream.close()

    def text(self) -> str:
        text = self.kept.decode(errors="replace")
        return text + (f"\n[... {self.dropped} more bytes dropped]" if self.dropped else "")


def _kill(process):
    """End the sandbox: killing `unshare` kills the namespace's first process (--kill-child), and
    with it, by the kernel, every process in the namespace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


# ---- inside the namespaces ---------------------------------------------------------------------

AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and arm64 (the generic table)
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_BIND, MS_REC, MS_RDONLY, MS_NOSUID, MS_NODEV = 4096, 16384, 1, 2, 4
_libc = ctypes.CDLL(None, use_errno=True)


def _sys(result, what):
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def _mount(source, target, kind, flags, data=""):
    _sys(_libc.mount(source.encode(), target.encode(), kind.encode() if kind else None,
                     ctypes.c_ulong(flags), data.encode()), f"mount {target}")


def _read_only(path, recursive=True, clear=False):
    attr = (ctypes.c_uint64 * 4)(0 if clear else MOUNT_ATTR_RDONLY,
                                 MOUNT_ATTR_RDONLY if clear else 0, 0, 0)
    _sys(_libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(),
                       AT_RECURSIVE if recursive else 0, attr, ctypes.sizeof(attr)),
         f"mount_setattr {path}")


def _loopback_up():
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(sock, 0x8913, request))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH14s", b"lo", flags | 0x1, b""))  # IFF_UP


def _isolate(job):
    """As the namespaces' root: loopback up, everything read-only, a fresh /tmp and /dev/shm, the
    hidden paths covered; then give up the power to undo any of it."""
    os.setsid()  # its own session: a signal to "my process group" stays inside
    _loopback_up()
    with open("/proc/self/uid_map") as uid_map:  # the first user namespace's: all ids, as they are
        really_root = uid_map.read().split() == ["0", "0", "4294967295"]
    needed = [sys.base_prefix, sys.prefix, job["course"]]  # Python and the course
    _read_only("/")
    for path, size in (("/tmp", "1g"), ("/dev/shm", "1g")):
        _cover(path, "tmpfs", f"size={size},mode=1777", keep=needed)
    if really_root:
        _open_the_way(needed)
    _read_only("/proc", recursive=False, clear=True)  # the nested user namespace's maps
    for path in job["hide"]:
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
        elif os.path.exists(path):
            _mount("/dev/null", path, None, MS_BIND)
    os.makedirs("/tmp/work", mode=0o777)
    os.environ.update(HOME="/tmp/work", TMPDIR="/tmp", MPLBACKEND="Agg",
                      MPLCONFIGDIR="/tmp/work/.matplotlib", PYTHONDONTWRITEBYTECODE="1")
    os.chdir("/tmp/work")
    return really_root


def _cover(folder, kind, options, keep):
    """Mount a fresh `kind` file system on `folder`, and bind back, read-only, the paths of `keep`
    that lie inside it (a course cloned under /tmp), each by a handle opened before the cover hid
    it."""
    inside = [path for path in keep if os.path.commonpath([path, folder]) == folder != path]
    inside = [path for path in inside  # a path inside another comes back with it
              if not any(os.path.commonpath([path, other]) == other != path for other in inside)]
    handles = {path: os.open(path, os.O_PATH) for path in inside}
    _mount(kind, folder, kind, MS_NOSUID | MS_NODEV, options)
    for path, handle in handles.items():
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{handle}", path, None, MS_BIND | MS_REC)
        _read_only(path)
        os.close(handle)


def _open_the_way(paths):
    """Where a folder that others may not enter (root's home, 0700) lies on the way to a path the
    sandbox needs as `nobody` (Python, the course), cover it with an empty folder they may enter,
    holding just the path's next step, bound from the original; until each path is open all the
    way. What else the closed folder holds stays out of sight."""
    import pathlib

    while True:
        closed = {}
        for path in map(pathlib.Path, paths):
            for ancestor in list(reversed(path.parents))[1:]:
                if not os.stat(ancestor).st_mode & 0o001:
                    closed.setdefault(str(ancestor), set()).add(
                        str(ancestor / path.relative_to(ancestor).parts[0]))
                    break
        if not closed:
            break
        for ancestor, steps in closed.items():
            _cover(ancestor, "tmpfs", "size=4k,mode=0755", keep=steps)
            _read_only(ancestor)
    for path in paths:
        if not os.stat(path).st_mode & 0o005 == 0o005:
            raise OSError(13, f"{path} is not open to other users (o+rx), and the sandbox runs "
                          "as nobody: open it, or grade as a user without root")


def _run(exercise, cells) -> dict:
    """The cells, then the checker on the function the answer cell handed to check()."""
    import linecache
    import traceback

    import matplotlib

    matplotlib.use("Agg")
    from helpers import exercises

    handed = {}

    def recording_check(name, function, timeout=None):
        handed[name] = function

    real_check = exercises.check
    exercises.check = recording_check  # `from helpers.exercises import check` in a cell gets it
    namespace = {"__name__": "__main__", "__builtins__": __builtins__,
                 "check": recording_check}  # as the lesson's earlier cells would have it
    for index, source in cells:
        filename = f"<cell {index}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            code = compile(source, filename, "exec")
        except SyntaxError as error:
            return {"status": "error", "message": f"Cell {index} is not valid Python: "
                    f"{error.msg}, at line {error.lineno}:\n    {(error.text or '').strip()}"}
        try:
            exec(code, namespace)  # noqa: S102 - the sandbox's job
        except BaseException as error:  # noqa: BLE001 - whatever the learner's cell raises
            frames = [frame for frame in traceback.extract_tb(error.__traceback__)
                      if frame.filename.startswith("<cell")]
            text = "".join(traceback.format_list(frames))
            return {"status": "error", "message": f"Cell {index} raised "
                    f"{type(error).__name__}: {error}\nTraceback (most recent call last):\n"
                    f"{text}".rstrip()}
    name = exercise
    if name not in handed:
        return {"status": "failed", "message": f'The answer cell never called check("{name}", '
                "your_function): nothing was handed in to check."}
    result = real_check(name, handed[name])
    text = repr(result)
    if result.passed:
        return {"status": "passed", "message": text}
    return {"status": "timeout" if "did not finish within" in text else "failed",
            "message": text}


def _answer(exercise, cells, limits, really_root) -> dict:
    """One answer, in the process forked for it: give up root, take the limits, run it."""
    if really_root:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    else:  # a user namespace inside ours: its mounts, copied from ours, are locked
        _sys(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
        for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
    for limit, value in ((resource.RLIMIT_AS, limits["memory"]),
                         (resource.RLIMIT_FSIZE, limits["file_size"]),
                         (resource.RLIMIT_CORE, 0),
                         *([(resource.RLIMIT_NPROC, limits["processes"])] if really_root else [])):
        resource.setrlimit(limit, (value, value))
    return _run(exercise, cells)


def _end_all_but_me():
    """Kill every process of the namespace but its first: what an answer left running."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def main():
    job = json.loads(sys.stdin.read())
    results = os.fdopen(job["results"], "w")
    try:
        really_root = _isolate(job)
    except OSError as error:
        for exercise, _ in job["answers"]:
            results.write(json.dumps({"exercise": exercise, "status": "error", "seconds": 0,
                                      "message": f"The sandbox could not be made ({error}): "
                                                 "nothing of the answer ran."}) + "\n")
        return 1
    sys.path.insert(0, job["course"])
    import torch  # noqa: F401 - imported once here, for every answer's process

    import helpers.exercises  # noqa: F401

    limits = job["limits"]
    for exercise, cells in job["answers"]:
        start = time.monotonic()
        verdict_read, verdict_write = os.pipe()
        child = os.fork()
        if child == 0:  # the answer's process
            os.close(verdict_read)
            os.close(job["results"])
            try:
                verdict = _answer(exercise, cells, limits, really_root)
            except BaseException as error:  # noqa: BLE001 - the checker, or a student's rank
                verdict = {"status": "error", "message": f"{type(error).__name__}: {error}"}
            with os.fdopen(verdict_write, "w") as out:
                out.write(json.dumps(verdict) + "\n")
            os._exit(0)
        os.close(verdict_write)
        said = _Drain(os.fdopen(verdict_read, "rb"))
        while time.monotonic() < start + limits["seconds"] and not os.waitpid(
                child, os.WNOHANG)[0]:
            time.sleep(0.05)
        _end_all_but_me()  # the answer's process if it still runs, and all it left behind
        said.join()
        seconds = time.monotonic() - start
        try:
            verdict = json.loads(said.text().splitlines()[0])
            verdict = {"status": verdict["status"], "message": str(verdict["message"])}
        except (IndexError, ValueError, KeyError, TypeError):
            verdict = ({"status": "timeout", "message": f"The answer did not finish within "
                        f"{limits['seconds']:g} s, and was stopped."}
                       if seconds >= limits["seconds"] else
                       {"status": "error", "message": "The answer's process ended before its "
                        "check said anything (it exited, or was killed)."})
        results.write(json.dumps({"exercise": exercise, "seconds": round(seconds, 1),
                                  **verdict}) + "\n")
        results.flush()
    os._exit(0)  # the namespace ends with this process: anything left in it with it


if __name__ == "__main__":
    sys.exit(main())
