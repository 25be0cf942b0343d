"""A real Slurm cluster of two nodes on this machine: two compute nodes and a login node, each a
network host of its own (helpers.on_a_cluster.network), with munge, one controller and a node
daemon on each compute node.

    cluster = Cluster.start()      # a few seconds; raises ClusterUnavailable where it cannot
    cluster.run("sinfo")           # any Slurm command, typed on the login node
    cluster.stop()                 # every process, namespace and folder it made

The hosts (NETWORK's addresses, each in a network namespace with its own host name, loopback and
/tmp; the compute nodes' links shaped to LINK_MBIT):

    n1     10.77.0.1   slurmd, and the ranks of the jobs it runs
    n2     10.77.0.2   slurmd
    login  10.77.0.3   slurmctld; the Slurm commands that `run` types

Each daemon binds its host's address alone (CommunicationParameters), on Slurm's default ports,
6817 and 6818: every host has its own. Everything else lives in one folder (`cluster.directory`,
under runs/ by default), which every node sees at the same path as on a shared file system:
slurm.conf, the munge key and socket (munged runs on this machine; its socket is a file, which
every namespace reaches), gres.conf and the GPUs' device files (dev/nvidia0, dev/nvidia1: each
node declares GPUS_PER_NODE), the daemons' logs, the controller's state and the finished jobs'
record (jobcomp/filetxt: `sacct -c` reads it; full accounting needs slurmdbd and a database).
Slurm tracks a job's processes through /proc (proctrack/linuxproc) and binds no CPUs (task/none).

One cluster a process: a second `start` while one is up is refused, saying which (`running()`
finds it); clusters of two processes (two kernels, two test workers) each have namespaces of
their own, and do not meet. The daemons run as this process's children, and Linux ends them when
the thread that started them ends, with the process or without it (PR_SET_PDEATHSIG); `stop`
cancels every job first, then ends the daemons by the ids it started, checks /proc that no process
of this cluster's is left, and removes the namespaces and folders.

`python -m helpers.on_a_cluster.cluster up` starts one and waits (Ctrl-C stops it): `make cluster`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from helpers.on_a_cluster import network as network_module
from helpers.on_a_cluster.network import Network, NetworkUnavailable
from helpers.timing import timestamp

NODES = ("n1", "n2")
LOGIN = "login"  # where slurmctld runs, and Slurm's commands are typed
CPUS_PER_NODE = 4  # what each node offers Slurm (both share this machine's cores)
# Each compute node's link, megabits a second each way; a node's loopback, within it, is many
# times faster (benchmarks/topology.py measures both).
LINK_MBIT = 800
# GPUs each node declares to Slurm (GRES): device files the cluster makes in its folder, dev/,
# with NVIDIA's major number (195), the first GPU's minor 0. Nothing opens them: the ranks compute
# on the CPU. Slurm hands them out as on a GPU cluster: --gpus-per-node, --gres=gpu:N,
# CUDA_VISIBLE_DEVICES a task.
GPUS_PER_NODE = 2
NVIDIA_MAJOR = 195
DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = ("slurm-wlm", "munge")
# Seconds between the SIGTERM a cancelled or requeued job's processes get and the SIGKILL.
KILL_WAIT = 10
# Seconds a requeued job waits before it may start again: a job step's credential lifetime
# (AuthInfo's cred_expire, slurm.conf(5): "This also controls how long a requeued job must wait
# before starting again. The default value is 120 seconds."). Short here, so that a lesson waits
# seconds, not minutes.
CRED_EXPIRE = 5


OWNER = "owner.pid"  # in a cluster's folder: the process that started it
_running = []  # this process's cluster, while it is up


class ClusterUnavailable(RuntimeError):
    """This machine cannot run the lesson's cluster (not Linux, not root, no Slurm): the reason."""


class SlurmCommandFailed(subprocess.CalledProcessError):
    """A Slurm command that failed, saying what it printed."""

    def __str__(self) -> str:
        said = (self.stderr or self.stdout or "").strip()
        return f"{' '.join(map(str, self.cmd))} exited with {self.returncode}: {said}"


@dataclass(eq=False)
class Cluster:
    directory: str
    network: Network | None = None
    processes: dict = field(default_factory=dict)
    owns_directory: bool = True

    # ---- starting --------------------------------------------------------------------------
    @classmethod
    def start(cls, directory: str | None = None, install: bool = False,
              timeout: float = 30) -> Cluster:
        """Make the hosts, then start munge, slurmctld on the login node and a slurmd on each of
        NODES; return when both nodes are idle. `install`: apt-get the packages first where they
        are missing (as root). Refused while this process has a cluster up (`running()`)."""
        problem = unavailable(install)
        if problem:
            raise ClusterUnavailable(problem)
        up = cls.running()
        if up is not None:
            raise ClusterUnavailable(
                f"a cluster is up in this process already, in {up.directory}: use it "
                "(Cluster.running() returns it), or stop it first (its stop())")
        owns = directory is None
        if owns:
            os.makedirs(RUNS, exist_ok=True)
            remove_abandoned()
            directory = tempfile.mkdtemp(prefix="cluster-", dir=RUNS)
        cluster = cls(os.path.abspath(directory), owns_directory=owns)
        _running.append(cluster)
        atexit.register(cluster.stop)
        try:
            # every node sees the repository, this Python and the cluster's folder where they are,
            # even within this machine's /tmp, which each node has its own of
            cluster.network = Network.start(
                (*NODES, LOGIN), link_mbit=LINK_MBIT, scratch=True,
                shared=(os.path.dirname(RUNS), cluster.directory, sys.prefix, sys.base_prefix))
            cluster._write_files()
            cluster._spawn("munged", None, [
                "munged", "--foreground", "--force", "--socket", cluster.path("munge.socket"),
                "--key-file", cluster.path("munge.key"), "--pid-file", cluster.path("munged.pid"),
                "--seed-file", cluster.path("munged.seed"),
                "--log-file", cluster.path("munged.log")])
            cluster._wait_for(lambda: os.path.exists(cluster.path("munge.socket")), 10,
                              "munged made no socket")
            cluster._spawn("slurmctld", LOGIN, ["slurmctld", "-D", "-i", "-f", cluster.conf])
            for node in NODES:  # each finds its node name in its host's name
                cluster._spawn(node, node, ["slurmd", "-D", "-f", cluster.conf])
            cluster.wait_until_idle(timeout)
        except NetworkUnavailable as error:
            cluster.stop()
            raise ClusterUnavailable(f"no network for the cluster: {error}") from error
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @classmethod
    def running(cls) -> Cluster | None:
        """This process's cluster, if one is up."""
        return _running[0] if _running else None

    @property
    def conf(self) -> str:
        return self.path("slurm.conf")

    @property
    def name(self) -> str:
        return f"course{os.getpid()}"

    def path(self, *names: str) -> str:
        return os.path.join(self.directory, *names)

    def environment(self, **extra) -> dict:
        """This process's environment, with Slurm's commands pointed at this cluster."""
        return {**os.environ, "SLURM_CONF": self.conf, **extra}

    def run(self, command: str | list, check: bool = True, timeout: float = 30,
            env: dict | None = None) -> str:
        """A Slurm command (`sinfo`, `squeue`, `sbatch ...`) typed on the login node; its output.
        `env`: the whole environment it runs in (else this process's, pointed at the cluster)."""
        args = command.split() if isinstance(command, str) else list(command)
        done = subprocess.run(self.network.command(LOGIN, args), capture_output=True, text=True,
                              timeout=timeout,
                              env=env or self.environment(), cwd=self.directory)
        if check and done.returncode != 0:
            raise SlurmCommandFailed(done.returncode, args, done.stdout, done.stderr)
        return done.stdout + done.stderr

    def _write_files(self) -> None:
        with open(self.path(OWNER), "w") as owner:
            owner.write(str(os.getpid()))
        for folder in ("state", *(os.path.join("spool", node) for node in NODES)):
            os.makedirs(self.path(folder), exist_ok=True)
        with open(self.path("munge.key"), "wb") as key:
            key.write(os.urandom(1024))
        os.chmod(self.path("munge.key"), 0o400)
        os.chmod(self.directory, 0o755)  # munged refuses a key or socket in a group-writable folder
        with open(self.conf, "w") as conf:
            conf.write(slurm_conf(self))
        os.makedirs(self.path("dev"), exist_ok=True)  # as /dev/nvidia0, ... on a GPU node
        for index in range(GPUS_PER_NODE):
            os.mknod(self.path("dev", f"nvidia{index}"), 0o666 | stat.S_IFCHR,
                     os.makedev(NVIDIA_MAJOR, index))
        with open(self.path("gres.conf"), "w") as gres:
            gres.write(f"Name=gpu File={self.path('dev', 'nvidia')}[0-{GPUS_PER_NODE - 1}]\n")

    def _spawn(self, name: str, host: str | None, args: list) -> None:
        """Start a daemon on `host` (None: this machine itself)."""
        if host is not None:
            args = self.network.command(host, args)
        with open(self.path(f"{name}.out"), "w") as out:
            self.processes[name] = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.environment(), cwd=self.directory, preexec_fn=_die_with_parent)

    def _wait_for(self, ready, timeout: float, failure: str) -> None:
        deadline = timestamp() + timeout
        while not ready():
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise ClusterUnavailable(f"{name} exited with {process.returncode}:\n"
                                             + self.log_tail(name))
            if timestamp() > deadline:
                raise ClusterUnavailable(f"{failure} within {timeout:g} s:\n"
                                         + self.log_tail("slurmctld"))
            time.sleep(0.2)

    def wait_until_idle(self, timeout: float = 30) -> None:
        """Return once every node is idle (no job holds any of it); ClusterUnavailable, with the
        controller's last log lines, after `timeout` seconds."""
        self._wait_for(self._nodes_idle, timeout, "the nodes did not become idle")

    def _nodes_idle(self) -> bool:
        try:
            states = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=5).split()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            return False
        return states[1::2] == ["idle"] * len(NODES)

    def log_tail(self, name: str, lines: int = 15) -> str:
        """The last lines a daemon wrote (its log file, else what it printed)."""
        for candidate in (f"{name}.log", f"slurmd.{name}.log", f"{name}.out"):
            if os.path.exists(self.path(candidate)):
                with open(self.path(candidate), errors="replace") as log:
                    return "".join(log.readlines()[-lines:])
        return "(nothing written)"

    # ---- when something went wrong ---------------------------------------------------------
    def slurms_view(self) -> list:
        """What Slurm says now of its jobs and nodes, a line each: a job's state and why it waits,
        a node's state and why it is drained or down (squeue, sinfo)."""
        jobs = self.run(["squeue", "-h", "-o", "%i|%T|%r|%N"], check=False, timeout=10)
        nodes = self.run(["sinfo", "-h", "-N", "-o", "%N|%T|%E"], check=False, timeout=10)
        lines = []
        for job, state, reason, where in (line.split("|") for line in jobs.splitlines()
                                          if line.count("|") == 3):
            lines.append(f"job {job} {state}" + (f" ({reason})" if reason != "None" else "")
                         + (f" on {where}" if where else ""))
        for node, state, reason in (line.split("|") for line in nodes.splitlines()
                                    if line.count("|") == 2):
            lines.append(f"node {node} {state}" + (f" ({reason})" if reason != "none" else ""))
        return lines

    def report(self, lines: int = 8) -> str:
        """For a failure's message: Slurm's view (slurms_view), then the last lines of the
        controller's and the nodes' logs, and of the newest jobs' output files in this cluster's
        folder."""
        parts = ["Slurm now:", *("  " + line for line in self.slurms_view())]
        outputs = sorted(glob.glob(self.path("*", "*.out")), key=os.path.getmtime)[-4:]
        for path in [self.path("slurmctld.log"), *map(self.path, (f"slurmd.{node}.log"
                                                                   for node in NODES)), *outputs]:
            if os.path.exists(path):
                with open(path, errors="replace") as file:
                    tail = file.read().splitlines()[-lines:]
                parts += [f"{os.path.relpath(path, self.directory)}, last lines:",
                          *("  " + line for line in tail)]
        return "\n".join(parts)

    # ---- stopping --------------------------------------------------------------------------
    def stop(self) -> list:
        """Cancel every job, end every daemon this cluster started (by process id), remove its
        network (namespaces, links, scratch) and its directory if it made it. Returns the ids of
        any job process that had to be killed."""
        if not self.processes:  # never started, or stopped already
            self._remove()
            return []
        if self.processes.get("slurmctld") and self.processes["slurmctld"].poll() is None:
            try:
                self.run(["scancel", "--full", "--quiet", "--user", str(os.getuid())],
                         check=False, timeout=10)
                self._wait_for_no_jobs(KILL_WAIT + 5)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(list(self.processes)):  # nodes, controller, then munge
            process = self.processes[name]
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        left = self.leftover_processes()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._remove()
        return left

    def _remove(self) -> None:
        """The namespaces, links, scratch folders and, if this cluster made it, its folder."""
        if self.network is not None:
            self.network.stop()
        if self.owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self in _running:
            _running.remove(self)
        atexit.unregister(self.stop)

    def _wait_for_no_jobs(self, timeout: float) -> None:
        deadline = timestamp() + timeout
        while timestamp() < deadline:
            if not self.run(["squeue", "-h"], check=False, timeout=5).strip():
                return
            time.sleep(0.3)

    def leftover_processes(self) -> list:
        """Process ids whose environment names this cluster's slurm.conf: a job's processes that
        outlived their node daemon (slurmstepd hands them to init). Linux only."""
        mine, marker = os.getpid(), f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == mine:
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if marker in environ.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
        return found

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if isinstance(error, Exception) and self.processes:  # say what Slurm saw, then stop
            with contextlib.suppress(Exception):
                error.add_note(self.report())
        self.stop()


RUNS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "runs")


def remove_abandoned() -> list:
    """Remove the folders of clusters whose starting process is gone (a kernel killed before it
    could stop its cluster: Linux ended the daemons, the folder stayed). Returns them."""
    removed = []
    for name in os.listdir(RUNS):
        owner = os.path.join(RUNS, name, OWNER)
        if not name.startswith("cluster-") or not os.path.exists(owner):
            continue
        with open(owner) as file:
            pid = file.read().strip()
        if not (pid.isdigit() and os.path.exists(f"/proc/{pid}")):
            shutil.rmtree(os.path.dirname(owner), ignore_errors=True)
            removed.append(os.path.dirname(owner))
    return removed


def slurm_conf(cluster: Cluster) -> str:
    """The cluster's slurm.conf: every line a first cluster needs, and nothing else."""
    address = cluster.network.address
    nodes = "\n".join(f"NodeName={node} NodeAddr={address(node)} CPUs={CPUS_PER_NODE} "
                      f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN" for node in NODES)
    return f"""\
ClusterName={cluster.name}
SlurmctldHost={LOGIN}({address(LOGIN)})
SlurmctldPort=6817
SlurmdPort=6818
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
GresTypes=gpu
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={cluster.path('munge.socket')},cred_expire={CRED_EXPIRE}
StateSaveLocation={cluster.path('state')}
SlurmdSpoolDir={cluster.path('spool', '%n')}
SlurmctldPidFile={cluster.path('slurmctld.pid')}
SlurmdPidFile={cluster.path('slurmd.%n.pid')}
SlurmctldLogFile={cluster.path('slurmctld.log')}
SlurmdLogFile={cluster.path('slurmd.%n.log')}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={cluster.path('jobs.txt')}
KillWait={KILL_WAIT}
MinJobAge=600
SchedulerParameters=sched_interval=1
{nodes}
PartitionName=course Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def unavailable(install: bool = False) -> str | None:
    """Why this machine cannot start the cluster, or None where it can."""
    if not sys.platform.startswith("linux"):
        return f"Slurm's daemons run on Linux; this is {sys.platform}"
    if os.geteuid() != 0:
        return ("the lesson's cluster runs its daemons as root (one user on one machine), and "
                "makes its nodes' network as root; this kernel is not root")
    missing = _missing()
    if missing and install and shutil.which("apt-get"):
        apt = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=apt)
        subprocess.run(["apt-get", "install", "-y", "-qq", *PACKAGES], capture_output=True,
                       env=apt)
        missing = _missing()
    if missing:
        return (f"{', '.join(missing)} not installed: `apt-get install {' '.join(PACKAGES)}` "
                "as root (Debian, Ubuntu), or `make cluster`")
    return network_module.unavailable()


def _missing() -> list:
    return [name for name in DAEMONS if shutil.which(name, path=_sbin_path()) is None]


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _die_with_parent() -> None:  # runs in the child, before exec
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def main(argv=None) -> None:
    """`up`: start a cluster and wait for Ctrl-C (make cluster); `install`: install Slurm and
    munge where they are missing, and say whether a cluster can start here (make
    cluster-tests)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["install"]:
        had = not _missing()
        problem = unavailable(install=True)
        if problem and os.environ.get("REQUIRE_CLUSTER"):
            sys.exit(f"error: no cluster here: {problem}")
        if problem:
            print(f"no cluster here ({problem}): lesson 15's tests will be skipped")
            return
        print(f"Slurm and munge {'were' if had else 'are now'} installed")
        return
    if args[:1] != ["up"]:
        sys.exit("usage: python -m helpers.on_a_cluster.cluster up|install")
    with Cluster.start(install=True) as cluster:
        print(f"cluster {cluster.name} up: nodes {', '.join(NODES)}, in {cluster.directory}\n"
              "  a shell on the login node: "
              f"{shlex.join(cluster.network.command(LOGIN, ['bash']))}\n"
              f"  export SLURM_CONF={cluster.conf}   # then sinfo, sbatch, squeue, sacct -c\n"
              "Ctrl-C stops it.", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            print("\nstopping", flush=True)


if __name__ == "__main__":
    main()
