"""What goes wrong on a first cluster, made to happen: each mistake a one-line change of the
lesson's batch script (capstone.sbatch), submitted to the cluster, and what a learner then sees.

- `MISTAKES`: name -> Mistake (what was done, how the script changes, the fix).
- `TakenPort(cluster)`: a program that is no rendezvous holding the rendezvous port (29400) on the
  first node, n1, until `close()`.
- `submit_mistakes(cluster, directory, arguments, taken)`: every mistake at once, one job each,
  with one CPU a rank-group so that all run side by side; returns {name: job id}.
- `diagnose(cluster, directory, jobs)`: waits for them; a job whose torchruns started but no rank,
  and whose logs then stay unchanged for 10 s, is cancelled (it would wait for ever). Returns
  {name: Outcome}: how it ended, after how long, and the lines that say why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

from helpers.on_a_cluster import slurm
from helpers.on_a_cluster.cluster import Cluster
from helpers.timing import timestamp

JOIN_TIMEOUT = 6  # seconds the nodes of a broken job wait for each other (the script's: 20)
SRUN = 'srun --cpus-per-task="$SLURM_CPUS_PER_TASK" --output=%x-%j.node%n.out --kill-on-bad-exit=1'
LAUNCH = SRUN + ' \\\n    torchrun'  # capstone.sbatch's job step, up to its command
ENDPOINT = '--rdzv-endpoint "$head_address:$port"'
PORT = "port=29400"  # capstone.sbatch's rendezvous port, c10d's default


@dataclass(frozen=True)
class Mistake:
    what: str  # what the script did wrong
    old: str  # the text of capstone.sbatch it changes ...
    new: str  # ... into this
    fix: str
    sbatch: tuple = ()  # sbatch's options on the command line: (("nodes", 1),)


MISTAKES = {
    "own endpoint": Mistake(
        "each node names itself as the rendezvous endpoint ($(hostname) inside srun's command)",
        ENDPOINT,  # `own_endpoint` makes the change: torchrun's command evaluated on each node
        "srun ... bash -c '... --rdzv-endpoint \"$(hostname):$port\" ...'",
        "compute the endpoint once, in the batch script (it runs on the first node), and hand "
        "the same one to every node"),
    "port taken": Mistake(
        "the rendezvous port, 29400, is already taken on the first node, by a program that is "
        "no rendezvous and never answers the store's handshake (here Python's http.server, "
        "which ss names python)",
        PORT, PORT,  # the script is right; the node is not as it assumed
        "pick a port that is free on the first node: the batch script runs there, so it can "
        "ask the kernel for one (python -c 'import socket; s = socket.socket(); "
        "s.bind((\"\", 0)); print(s.getsockname()[1])')"),
    "ranks and mesh": Mistake(
        "one rank a node: 2 ranks for a mesh of dp 2 x tp 2",
        "--nproc-per-node 2", "--nproc-per-node 1",
        "nodes x --nproc-per-node must equal dp x tp"),
    "node never joins": Mistake(
        "--nnodes 2 written into the script, the job submitted on one node (sbatch --nodes=1)",
        '--nnodes "$SLURM_JOB_NUM_NODES"', "--nnodes 2",
        "take the node count from Slurm ($SLURM_JOB_NUM_NODES), never write it twice",
        sbatch=(("nodes", 1),)),
}


def script_with(name: str, script: str | None = None, port: int = 29400) -> str:
    """capstone.sbatch with mistake `name` made, a short join_timeout (JOIN_TIMEOUT s, not the
    script's 20), and the rendezvous on `port`."""
    if script is None:
        with open(slurm.SCRIPT) as file:
            script = file.read()
    mistake = MISTAKES[name]
    if name == "own endpoint":
        changed = own_endpoint(script)
    else:
        if mistake.old not in script:
            raise ValueError(f"capstone.sbatch no longer holds {mistake.old!r}")
        changed = script.replace(mistake.old, mistake.new)
    return changed.replace("join_timeout=20", f"join_timeout={JOIN_TIMEOUT}").replace(
        PORT, f"port={port}")


def own_endpoint(script: str) -> str:
    """Every node its own endpoint: torchrun's command evaluated on each node (srun bash -c),
    with the node's own host name."""
    start = script.index(LAUNCH)
    end = script.index(" &\n", start)  # the step runs in the background; the script waits
    command = script[start + len(SRUN + " \\\n    "):end]
    command = command.replace(ENDPOINT, '--rdzv-endpoint "$(hostname):$port"')
    return (script[:start].replace(PORT, f"export {PORT}")
            + SRUN + " bash -c 'exec \\\n    "
            + command.replace('"$@"', '"$@"\' bash "$@"') + script[end:])


class TakenPort:
    """A program that holds the rendezvous port, 29400, on the cluster's first node and is no
    rendezvous: an HTTP server on n1's address, until `close()`. `program`: its name, as `ss`
    shows it."""

    port, node = 29400, "n1"

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.server = subprocess.Popen(
            cluster.network.command(self.node, [
                sys.executable, "-m", "http.server", str(self.port),
                "--bind", cluster.network.address(self.node)]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = timestamp() + 10
        while not self.holders():
            if self.server.poll() is not None or timestamp() > deadline:
                raise RuntimeError(f"the HTTP server on {self.node} did not start")
            time.sleep(0.1)

    def holders(self) -> list:
        """The programs that listen on the port on its node, as `ss -ltnp` names them: the
        check that finds a taken port."""
        return who_listens(self.cluster, self.node, self.port)

    def close(self) -> None:
        self.server.terminate()
        self.server.wait()


def submit_mistakes(cluster: Cluster, directory: str, arguments: list,
                    taken: TakenPort) -> dict:
    """Every mistake as a job of its own (each rank group on one CPU, so that all four run at
    once); returns {name: job id}. The port taken is `taken`'s; each other job has a port of its
    own, so that the four, run at once, do not meet (two jobs on one port fail each other)."""
    jobs = {}
    for index, (name, mistake) in enumerate(MISTAKES.items()):
        folder = _folder(directory, name)
        port = taken.port if name == "port taken" else taken.port + 1 + index
        jobs[name] = slurm.submit(cluster, script_with(name, port=port), folder, *arguments,
                                  cpus_per_task=1, **dict(mistake.sbatch))
    return jobs


@dataclass
class Outcome:
    state: str  # Slurm's: FAILED, or CANCELLED by `diagnose`
    seconds: float  # from submission to its end
    said: list  # the lines that say what went wrong


def diagnose(cluster: Cluster, directory: str, jobs: dict, quiet: float = 10,
             timeout: float = 120) -> dict:
    """Wait for every job in `jobs` ({name: id}). One that is stuck is cancelled: every node's
    torchrun has started (it printed its configuration, after importing torch, which takes a
    loaded machine long), no rank has, and its logs have not changed for `quiet` seconds (a
    timing-out rendezvous logs its progress at least every join_timeout, JOIN_TIMEOUT s).
    Returns {name: Outcome}."""
    started, ended = timestamp(), {}
    while len(ended) < len(jobs):
        queued = cluster.run(["squeue", "-h", "-o", "%i"], check=False).split()
        for name, job in jobs.items():
            folder = _folder(directory, name)
            if name in ended:
                continue
            if job not in queued:
                ended[name] = timestamp() - started
            elif (_stuck(folder, job) and timestamp() - _last_written(folder) > quiet) \
                    or timestamp() - started > timeout:
                cluster.run(["scancel", job])
        time.sleep(0.5)
    states = {row["JobID"]: row["State"] for row in slurm.finished(cluster)}
    return {name: Outcome(states.get(job, "?"), ended[name],
                          what_it_said(_folder(directory, name), job))
            for name, job in jobs.items()}


def _folder(directory: str, name: str) -> str:
    return os.path.join(directory, name.replace(" ", "-"))


def _stuck(folder: str, job: str) -> bool:
    """Every node's torchrun printed its configuration, none has got past the rendezvous to start
    its ranks, and no rank has started. (A job whose agents started their ranks is not stuck in
    the rendezvous, however long its ranks take to import torch on a loaded machine.)"""
    logs = slurm.node_logs(folder, job, everything=True)
    return (bool(logs) and all("rdzv_configs" in text for text in logs.values())
            and not any("Starting worker group" in text for text in logs.values())
            and not slurm.ranks(folder))


def _last_written(folder: str) -> float:
    """When any file of the job's folder last changed (its submission, before it wrote any)."""
    paths = [os.path.join(folder, name) for name in os.listdir(folder)]
    return max(map(os.path.getmtime, paths), default=timestamp())


ERROR = re.compile(r"^(?:\[rank\d+\]: )?([\w.]*(?:Error|Exception)\b.*)$")
# The header of c10's C++ backtrace ("Exception raised from ping at .../TCPStore.cpp:427"), which
# follows the error it belongs to, and only when a failing call got that far before the job was
# cancelled: no error of its own.
BACKTRACE = re.compile(r"Exception raised from \S+ at ")


def what_it_said(folder: str, job: str) -> list:
    """The lines a learner reads first, each said once: the errors the ranks raised, else the
    error torchrun raised on some node; "no rank started" where no node printed one (still
    waiting when it was cancelled)."""
    return (errors_in([text for text in slurm.node_logs(folder, job).values()])
            or ["no rank started, and no node printed an error"])


def errors_in(logs: list) -> list:
    """The distinct errors in these logs' texts, sorted: those a rank raised ("[rank<r>]: ..."),
    else those torchrun's agents raised; torch's module paths cut to the class name."""
    raised, agents = [], []
    for text in logs:
        for line in text.splitlines():
            match = ERROR.match(line.strip())
            if match and not BACKTRACE.match(match.group(1)):
                (raised if line.startswith("[rank") else agents).append(_short(match.group(1)))
    return sorted(set(raised)) or sorted(set(agents))


def _short(line: str) -> str:
    """torch's long module paths cut to the class name."""
    return re.sub(r"\b(?:torch\.[\w.]+\.)(\w+(?:Error|Exception))", r"\1", line)


def who_listens(cluster: Cluster, node: str, port: int) -> list:
    """The programs that listen on `port` on `node`, as `ss -ltnp` run there names them."""
    done = subprocess.run(cluster.network.command(node, ["ss", "-Hltnp", f"sport = :{port}"]),
                          capture_output=True, text=True)
    return sorted(set(re.findall(r'\(\("([^"]+)"', done.stdout)))


def show(outcomes: dict, part: int | None = None, width: int = 100) -> None:
    """Each mistake: what was done, the line that changed, how the job ended, what it said, and
    the fix; lines wrapped at `width` characters (a slide's). `part` 1 or 2: the first half of
    the mistakes, or the rest (a slide holds half)."""
    from helpers.notebook import half_of

    outcomes = dict(half_of(list(outcomes.items()), part))

    def say(label: str, text: str) -> None:
        print(textwrap.fill(text, width, initial_indent=f"    {label:<18}",
                            subsequent_indent=" " * 22, break_on_hyphens=False))

    for name, outcome in outcomes.items():
        mistake = MISTAKES[name]
        print(textwrap.fill(f"{name}: {mistake.what}", width, subsequent_indent="    "))
        if mistake.new == mistake.old:
            say("the script said", f"{mistake.new}, as it should")
        else:
            say("the script said", f"{mistake.new}   instead of   {mistake.old}")
        for option, value in mistake.sbatch:
            say("submitted with", f"sbatch --{option}={value}")
        say("the job:", "cancelled: no rank had started, it would have waited for ever"
            if outcome.state == "CANCELLED" else f"{outcome.state}, by itself")
        for line in outcome.said:
            say("it said:", line)
        say("the fix:", mistake.fix)
        print()
