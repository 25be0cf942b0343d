"""A job that survives a killed rank: resumable_worker under torchrun's restarts (lesson 12).

torchrun's agent watches its worker processes. When one dies it stops the others, and, if
--max-restarts allows, starts every worker again (TORCHELASTIC_RESTART_COUNT counts the
restarts); the new workers find the newest complete checkpoint and go on from there. What each
worker runs, from a shell:

    torchrun --standalone --nnodes 1 --nproc-per-node 4 --max-restarts 1 \\
        -m helpers.checkpoints_and_failures.elastic DIRECTORY --kill-rank 3 --kill-after 7

Each worker appends what it does to DIRECTORY/events.rank<r>.jsonl (started, every step and
save, killed), with the wall-clock time; rank 0 of the last attempt writes the whole final state
to DIRECTORY/final.pt. From the kernel, `torchrun_job` starts that command, reads the agent's own
log lines as they come, and returns everything for drawing.

The agent's rendezvous hands the workers a key-value store (a TCP server) through which they find
each other. In torch 2.13 that is a second store the rendezvous handler creates once and shares with
the workers of every attempt (`_shared_tcp_store_server`, torch/distributed/elastic/
rendezvous/dynamic_rendezvous.py), with no per-attempt prefix: the restarted gloo workers can read
the first attempt's addresses from it, and hang or fail in init_process_group (the stale-key problem
of pytorch/pytorch#135712; the comment "We create a new TCPStore for every retry" in
torch/distributed/rendezvous.py no longer holds). With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 each
attempt gets a store of its own; torchrun_job sets it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers.checkpoints_and_failures.resume import Experiment, resumable_worker
from helpers.timing import timestamp

FINAL_FILE = "final.pt"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--steps", type=int, default=Experiment.steps)
    parser.add_argument("--save-every", type=int, default=Experiment.save_every)
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-after", type=int, default=None, help="the step after which the "
                        "rank is killed (SIGKILL), in the first attempt only")
    options = parser.parse_args(argv)
    experiment = Experiment(steps=options.steps, save_every=options.save_every)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.makedirs(options.directory, exist_ok=True)  # (every rank: it may be the first here)
    log_path = os.path.join(options.directory, f"events.rank{rank}.jsonl")
    with open(log_path, "a") as log:
        def on_event(what, step):
            log.write(json.dumps({"time": timestamp(), "rank": rank, "attempt": attempt,
                                  "event": what, "step": step}) + "\n")
            log.flush()
            if (what == "step" and attempt == 0 and rank == options.kill_rank
                    and step == options.kill_after):
                on_event("killed", step)
                os.kill(os.getpid(), signal.SIGKILL)

        result = resumable_worker(rank, world_size, experiment, options.directory,
                                  on_event=on_event)
    if rank == 0:
        torch.save({**result, "attempt": attempt}, os.path.join(options.directory, FINAL_FILE))
    dist.barrier()
    # Leave without running torch's C++ destructors, which can abort at exit after a backward
    # (as the course's launcher does: helpers/launcher/README.md, "Leaving").
    sys.stdout.flush()
    os._exit(0)


@dataclass
class Job:
    """What torchrun_job saw: torchrun's exit code, the agent's log lines [(time, line)], every
    worker's events (dicts: time, rank, attempt, event, step), the final losses and state
    (rank 0's result), and the times as seconds from the job's start."""

    returncode: int
    agent: list
    events: list
    result: dict | None
    started: float

    def seconds(self, moment: float) -> float:
        return moment - self.started


def torchrun_job(directory, nproc: int = 4, max_restarts: int = 1, kill=None,
                 experiment: Experiment = None, timeout: float = 120) -> Job:
    """Run `python -m helpers.checkpoints_and_failures.elastic` under torchrun on this machine:
    `nproc` workers, `max_restarts` restarts, `kill` = (rank, step) or None. Returns a Job."""
    experiment = experiment or Experiment()
    if experiment != Experiment(steps=experiment.steps, save_every=experiment.save_every):
        raise ValueError("the torchrun script takes an Experiment's steps and save_every only; "
                         f"{experiment} sets more")
    arguments = [str(directory), "--steps", str(experiment.steps),
                 "--save-every", str(experiment.save_every)]
    if kill is not None:
        arguments += ["--kill-rank", str(kill[0]), "--kill-after", str(kill[1])]
    return run_torchrun("helpers.checkpoints_and_failures.elastic", arguments, directory,
                        nproc=nproc, max_restarts=max_restarts, timeout=timeout)


def run_torchrun(module: str, arguments: list, directory, *, nproc: int, max_restarts: int,
                 timeout: float) -> Job:
    """`torchrun ... -m module *arguments` on this machine, its workers writing their events
    (events.rank<r>.jsonl) and the final result (final.pt) to `directory`. Returns a Job."""
    command = torchrun_command(module, arguments, directory, nproc=nproc,
                               max_restarts=max_restarts)
    environment = torchrun_environment()
    agent, started = [], timestamp()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=environment, start_new_session=True)
    reader = threading.Thread(target=_read_lines, args=(process.stdout, agent), daemon=True)
    reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_with_its_workers(process)
        raise TimeoutError(f"torchrun did not finish within {timeout:g} s; its output:\n"
                           + "\n".join(line for _, line in agent[-20:])) from None
    reader.join()
    events = []
    for rank in range(nproc):
        path = os.path.join(directory, f"events.rank{rank}.jsonl")
        if os.path.exists(path):
            with open(path) as lines:
                events += [json.loads(line) for line in lines]
    final = os.path.join(directory, FINAL_FILE)
    result = torch.load(final, weights_only=False) if os.path.exists(final) else None
    return Job(process.returncode, agent, sorted(events, key=lambda event: event["time"]),
               result, started)


def kill_with_its_workers(process: subprocess.Popen) -> None:
    """SIGKILL torchrun (started in a session of its own) and every process under it, and reap
    it. Its workers are not in its process group: torch's subprocess handler starts each in a
    new session, so killing torchrun's group alone would leave them running, orphaned."""
    import psutil

    try:
        under = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        under = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for child in under:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)  # a worker leads its session's group
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    process.wait()
    psutil.wait_procs(under, timeout=10)


def torchrun_command(module: str, arguments: list, directory, *, nproc: int,
                     max_restarts: int) -> list:
    """The command line: `nproc` workers on this machine running `python -m module *arguments`,
    started again up to `max_restarts` times."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
            # the agent's own files go with the job's, not to a new folder in /tmp
            "--log-dir", os.path.join(directory, "torchelastic"),
            "-m", module, *arguments]


def torchrun_environment() -> dict:
    """This process's environment, and what torchrun's workers need on this machine."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
            "LOGLEVEL": "INFO",  # the agent says what it does
            # each attempt a store of its own (the module docstring says why)
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            # rendezvous through a TCP store: one DNS query, given 1 s (launcher README)
            "RES_OPTIONS": os.environ.get("RES_OPTIONS", "timeout:1 attempts:1"),
            "PYTHONPATH": os.pathsep.join(filter(None, [_repository(),
                                                        os.environ.get("PYTHONPATH")]))}


def agent_story(job: Job) -> list:
    """What the agent did, from its own log lines: [(seconds, what)], `what` in a few words
    ("starts the workers", "rank 3 exited with -9", "group failed: restarts it", "finished")."""
    story = []
    for moment, line in job.agent:
        exited = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", line)
        if exited:
            what = f"rank {exited.group(2)} exited with {exited.group(1)}"
        elif "Starting worker group" in line:
            what = "starts the workers"
        elif "Worker group FAILED" in line:
            what = "group failed: restarts it" if "will restart" in line else "group failed"
        elif "worker group successfully finished" in line:
            what = "finished"
        else:
            continue
        story.append((job.seconds(moment), what))
    return story


def _read_lines(stream, into: list) -> None:
    for line in stream:
        into.append((timestamp(), line.rstrip("\n")))


def _repository() -> str:
    """The folder that holds `helpers`: torchrun's workers import it from there."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


if __name__ == "__main__":
    main()
