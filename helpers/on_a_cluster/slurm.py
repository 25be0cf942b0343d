"""Submitting to the lesson's cluster and reading back what happened: the commands a learner
types (sbatch, squeue, scontrol, sacct -c), called from the kernel.

- `submit(cluster, script, directory, *arguments, **options)`: `sbatch` a batch script (a file's
  path or its text) with the job's folder and its arguments; returns the job id. `options` are
  sbatch's (`nodes=1`, `array="0-3"`), given on the command line over the script's #SBATCH lines.
- `follow(cluster, job, until=...)`: squeue every half second; the job's states as they changed.
- `requeue(cluster, job)`: `scontrol requeue`, as an administrator or a preemption would.
- `warn_of_time_limit(cluster, job)`: the signal a time limit's warning sends the batch shell.
- `finished(cluster)`: every finished job, as Slurm recorded it (`sacct -c`).
- `node_logs(directory, job)`: what each node's torchrun printed, by node.
- `ranks(directory)`: every rank's "started" events: which node, which attempt, which step.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import time
from dataclasses import dataclass

from helpers.checkpoints_and_failures.elastic import torchrun_environment
from helpers.on_a_cluster.cluster import Cluster
from helpers.timing import timestamp

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "capstone.sbatch")


def job_environment(cluster: Cluster, **extra) -> dict:
    """What a job submitted from here sees (sbatch hands on the submitter's environment):
    torchrun's settings (lesson 12's) but the interface it pins to this machine's loopback, and
    this Python's torchrun first on PATH."""
    environment = torchrun_environment()
    environment.pop("GLOO_SOCKET_IFNAME")  # lesson 12's `lo`: no other node is reached by it
    environment["PATH"] = os.pathsep.join([os.path.dirname(sys.executable),
                                           environment.get("PATH", "")])
    return cluster.environment(**environment, **{key: str(value) for key, value in extra.items()})


# What job_environment adds to this kernel's environment, and what each would do on two real
# machines: (why it is here, on two real nodes). tests/test_on_a_cluster.py checks that every
# variable added has its line.
ADDED = {
    "SLURM_CONF": ("points Slurm's commands at this cluster's slurm.conf",
                   "breaks them where that file is not: a real cluster's nodes have their own"),
    "PATH": ("this Python's folder first: the course's torchrun and python",
             "needs the same environment at the same path on every node (a shared file system "
             "or one image)"),
    "PYTHONPATH": ("the repository, so that `helpers` is found",
                   "the same: the repository at the same path on every node"),
    "OMP_NUM_THREADS": ("one thread a rank (torchrun's own default, where unset, for more "
                        "than one rank a node)",
                        "right for this script (2 CPUs, 2 ranks); with more CPUs a task, "
                        "SLURM_CPUS_PER_TASK / --nproc-per-node"),
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": ("each torchrun restart a store of its own (lesson 12)",
                                           "harmless"),
    "RES_OPTIONS": ("one DNS query a name, given 1 s (helpers/launcher/README.md: this "
                    "machine's DNS leaves some queries unanswered)",
                    "can fail a rendezvous whose node names a slow DNS answers late: remove it"),
    "LOGLEVEL": ("torchrun's agent says what it does", "harmless"),
}


def added_environment(cluster: Cluster) -> dict:
    """{name: value} of what a job submitted from here sees that this kernel's environment does
    not hold (or holds with another value)."""
    return {name: value for name, value in job_environment(cluster).items()
            if os.environ.get(name) != value}


def show_added_environment(cluster: Cluster, part: int | None = None) -> None:
    """What slurm.submit adds to this kernel's environment for a job, variable by variable: why it
    is here, and what it would do on two real machines. Paths are shown by what they name.
    `part` 1 or 2: the first half of the variables, or the rest (a slide holds half)."""
    from helpers.notebook import half_of

    shown = {"PATH": "<this Python's folder>:$PATH", "PYTHONPATH": "<the repository>:$PYTHONPATH",
             "SLURM_CONF": "<the cluster's folder>/slurm.conf"}
    job = job_environment(cluster)
    for name, (why, real) in half_of(list(ADDED.items()), part):
        print(f"{name}={shown.get(name, job[name])}\n    here: {why}\n"
              f"    on two real nodes: {real}")


def submit(cluster: Cluster, script: str, directory: str, *arguments, environment=None,
           **options) -> str:
    """sbatch `script` (a path, or the text of a batch script) in `directory`, with `directory` and
    `arguments` as the script's arguments; `environment`: more variables the job sees. Returns
    the job id (for an array, the array's id)."""
    os.makedirs(directory, exist_ok=True)
    if not os.path.exists(script):
        path = os.path.join(directory, "job.sbatch")
        with open(path, "w") as file:
            file.write(script)
        script = path
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    output = cluster.run(["sbatch", "--parsable", f"--chdir={directory}", *flags,
                          os.path.abspath(script), directory, *map(str, arguments)],
                         env=job_environment(cluster, **(environment or {})))
    return output.strip().split(";")[0]


class StillQueued(TimeoutError):
    """`follow` gave up: the job is still in the queue. `state`: in which state, in words
    ("PENDING (BeginTime)", as `states` writes it)."""

    def __init__(self, job: str, state: str, timeout: float):
        super().__init__(f"job {job} still {state} after {timeout:g} s")
        self.state, self.timeout = state, timeout


@dataclass
class Moment:
    time: float  # helpers.timing.timestamp()
    state: str  # PENDING, RUNNING, COMPLETING, or gone from the queue: "done"
    reason: str  # why it waits (Resources, BeginTime, None)
    nodes: str


def follow(cluster: Cluster, job: str, until=None, timeout: float = 120,
           every: float = 0.5) -> list:
    """Poll `squeue` for `job` until it leaves the queue or `until()` is true; returns every
    Moment at which its state, reason or nodes changed."""
    started, moments = timestamp(), []
    while True:
        line = cluster.run(["squeue", "-h", "-j", job, "-o", "%T|%r|%N"], check=False).strip()
        state, reason, nodes = line.split("|") if "|" in line else ("done", "", "")
        if not moments or (state, reason, nodes) != (moments[-1].state, moments[-1].reason,
                                                     moments[-1].nodes):
            moments.append(Moment(timestamp(), state, reason, nodes))
        if state == "done" or (until is not None and until()):
            return moments
        if timestamp() - started > timeout:
            raise StillQueued(job, states(moments[-1:]) or state, timeout)
        time.sleep(every)


def requeue(cluster: Cluster, job: str) -> float:
    """`scontrol requeue job`: Slurm sends the job's processes SIGTERM (SIGKILL KillWait seconds
    later) and queues it again. Returns the moment it was asked."""
    moment = timestamp()
    cluster.run(["scontrol", "requeue", job])
    return moment


def warn_of_time_limit(cluster: Cluster, job: str) -> float:
    """`scancel --batch --signal=USR1 job`: USR1 to the batch shell alone, what capstone.sbatch's
    `#SBATCH --signal=B:USR1@120` has Slurm send 120 s (to 180) before a time limit; the script's
    trap then requeues the job. Returns the moment it was sent."""
    moment = timestamp()
    cluster.run(["scancel", "--batch", "--signal=USR1", job])
    return moment


def finished(cluster: Cluster) -> list:
    """Every finished job, from `sacct -c` (the job completion record, jobcomp/filetxt): dicts of
    JobID, JobName, NNodes, NodeList, State, ExitCode? (what sacct -c shows)."""
    output = cluster.run(["sacct", "-c", "-P", "-o",
                          "jobid,jobname,nnodes,nodelist,state,start,end"], check=False)
    lines = [line.split("|") for line in output.strip().splitlines()]
    if not lines:
        return []
    header, rows = lines[0], lines[1:]
    return [dict(zip(header, row)) for row in rows]


def node_logs(directory: str, job: str, everything: bool = False) -> dict:
    """{node index: text} from the srun output files (%x-%j.node%n.out), without torchrun's
    INFO lines unless `everything`."""
    logs = {}
    for path in sorted(glob.glob(os.path.join(directory, f"*-{job}.node*.out"))):
        index = int(re.search(r"\.node(\d+)\.out$", path).group(1))
        with open(path, errors="replace") as file:
            logs[index] = "".join(line for line in file
                                  if everything or not re.match(r"I\d{4} ", line))
    return logs


def ranks(directory: str) -> list:
    """Every rank's "started" events (rank, restart, step, node, group_rank, local_rank, time),
    from lesson 14's events.rank<r>.jsonl."""
    started = [event for event in events(directory) if event["event"] == "started"]
    return sorted(started, key=lambda event: (event["restart"], event["rank"]))


def events(directory: str) -> list:
    """Every event of every rank, in time order."""
    found = []
    for path in sorted(glob.glob(os.path.join(directory, "events.rank*.jsonl"))):
        with open(path) as lines:
            found += list(map(json.loads, lines))
    return sorted(found, key=lambda event: event["time"])


def last_step(directory: str) -> int:
    """The newest step rank 0 finished (0 before the first)."""
    steps = [event["step"] for event in events(directory)
             if event["rank"] == 0 and event["event"] == "step"]
    return max(steps, default=0)


SWEEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sweep.sbatch")
GPU_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu.sbatch")


def show_script(path: str, part: int | None = None):
    """A batch script, highlighted, as the notebook shows it. One longer than a slide holds is
    shown in parts, a cell each: `show_script(path, part=1)`, then `part=2`, ... (cut at blank
    lines: helpers.notebook.paragraph_parts)."""
    from IPython.display import Code

    from helpers.notebook import paragraph_parts, part_of

    with open(path) as file:
        text = file.read()
    if part is not None:
        text = part_of(paragraph_parts(text), part, os.path.basename(path))
    return Code(text, language="bash")


def states(moments: list) -> str:
    """The states a job went through, in words: "PENDING (BeginTime) -> RUNNING on n[1-2] ->
    done". Left out: what can last less than a poll (PENDING without a reason, as a job waits for
    the scheduler's next pass; COMPLETING, as its processes end), so that the words are the same
    on a fast machine and a slow one."""
    words = []
    for moment in moments:
        if moment.state == "COMPLETING" or (moment.state == "PENDING"
                                            and moment.reason in ("None", "")):
            continue
        word = moment.state
        if moment.reason not in ("None", ""):
            word += f" ({moment.reason})"
        if moment.nodes and moment.state == "RUNNING":
            word += f" on {moment.nodes}"
        if not words or words[-1] != word:
            words.append(word)
    return " -> ".join(words)


def wait_all(cluster: Cluster, job: str, timeout: float = 120, every: float = 0.5) -> int:
    """Wait until `job` (an array: all its tasks) has left the queue; returns the most of its
    tasks seen running at once."""
    started, most = timestamp(), 0
    while True:
        lines = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).split()
        if not lines:
            return most
        most = max(most, lines.count("RUNNING"))
        if timestamp() - started > timeout:
            raise TimeoutError(f"job {job} still queued after {timeout:g} s")
        time.sleep(every)


def job_fields(cluster: Cluster, job: str, names: tuple) -> dict:
    """Fields of `scontrol show job` ({"Restarts": "1", "Requeue": "1"})."""
    text = cluster.run(["scontrol", "show", "job", job])
    found = dict(re.findall(r"(\w+)=(\S*)", text))
    return {name: found.get(name) for name in names}


def scontrol_hostnames(cluster: Cluster, nodelist: str) -> list:
    """Slurm's own expansion of a node list (`scontrol show hostnames`)."""
    return cluster.run(["scontrol", "show", "hostnames", nodelist]).split()
