"""The capstone as a torchrun job: every rank runs `main`, and a killed or interrupted run goes on
from its newest checkpoint. From a shell (4 ranks on this machine, one restart allowed):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 4 \\
        --max-restarts 1 -m helpers.capstone.job runs/capstone --steps 600 --progress

Every field of `train.Config` is a flag (`--save-every 50`, `--recompute full`, `--bf16 false`).
`--kill-rank R --kill-after S` kills rank R with SIGKILL after step S, in the first attempt only
(to see torchrun restart the group). Ctrl-C (or SIGTERM: a cluster's scheduler ending a job) is
noticed between steps: the ranks agree to stop, save a checkpoint, say where, and leave; the same
command resumes. (torchrun runs its workers in sessions of their own: a terminal's Ctrl-C reaches
torchrun, whose agent sends the signal on to every worker and kills those still alive 30 s later,
--shutdown-timeout.) Each rank appends its events to DIRECTORY/events.rank<r>.jsonl (as lesson 12's
job does: `elastic.Job` reads them), each step's with its loss, learning rate, gradient norm,
seconds and validation loss (`records` reads them back, every attempt's); rank 0 writes this
attempt's History to DIRECTORY/final.pt.
Why TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: helpers.checkpoints_and_failures.elastic's docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import sys

import torch
import torch.distributed as dist

from helpers.capstone.corpus import bits_per_byte
from helpers.capstone.train import Config, train_worker
from helpers.checkpoints_and_failures.elastic import FINAL_FILE, Job, run_torchrun
from helpers.launcher.result import get_device, node_backend
from helpers.timing import timestamp

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def main(argv=None) -> None:
    options = parse(argv)
    config = config_from(options)
    dist.init_process_group(node_backend())  # NCCL where each of this node's ranks has a GPU
    rank, world_size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.makedirs(options.directory, exist_ok=True)
    asked_to_stop = catch_stop_signals()
    with open(os.path.join(options.directory, f"events.rank{rank}.jsonl"), "a") as log:

        def on_event(what, step, history):
            event = {"time": timestamp(), "rank": rank, "attempt": attempt, "event": what,
                     "step": step}
            if what == "step" or (what == "started" and step == 0):  # the record, for a plot
                event.update(history.steps.get(step, {}),
                             validation=history.validation.get(step))
            if what == "started":  # where this rank runs: a cluster's node, torchrun's numbers
                event.update(where())
            log.write(json.dumps(event) + "\n")
            log.flush()
            if (what == "step" and attempt == 0 and rank == options.kill_rank
                    and step == options.kill_after):
                on_event("killed", step, history)
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 0 and options.progress:
                show_progress(what, step, history)

        def stop(step) -> bool:  # any rank asked: all stop, at the same step
            flag = torch.tensor([float(asked_to_stop())], device=get_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                log.write(json.dumps({"time": timestamp(), "rank": rank, "attempt": attempt,
                                      "event": "stopping", "step": step}) + "\n")
            return bool(flag.item())

        history = train_worker(rank, world_size, config, options.directory, on_event=on_event,
                               stop=stop, stop_after=options.stop_after)
    if rank == 0:
        torch.save(history, os.path.join(options.directory, FINAL_FILE))
        if options.progress:
            finished = max(history.steps, default=history.started_after)
            print(f"\n{'stopped' if finished < config.steps else 'finished'} after step "
                  f"{finished} of {config.steps}; checkpoints in {options.directory}"
                  + ("; run the same command again to go on" if finished < config.steps else ""))
    dist.barrier()
    # Leave without torch's C++ destructors, which can abort at exit after a backward (the
    # course's launcher does the same: helpers/launcher/README.md, "Leaving").
    sys.stdout.flush()
    os._exit(0)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where the checkpoints, events and result go")
    for item in dataclasses.fields(Config):
        kind = type(item.default)
        parser.add_argument("--" + item.name.replace("_", "-"), default=item.default,
                            type=yes_or_no if kind is bool else kind)
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-after", type=int, default=None,
                        help="the step after which --kill-rank dies (SIGKILL), first attempt only")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="end this run after that step (the schedule stays config.steps')")
    parser.add_argument("--progress", action="store_true", help="rank 0 shows a progress line")
    return parser.parse_args(argv)


def yes_or_no(text: str) -> bool:
    if text.lower() not in ("true", "false", "yes", "no", "1", "0"):
        raise argparse.ArgumentTypeError(f"true or false, not {text!r}")
    return text.lower() in ("true", "yes", "1")


def config_from(options: argparse.Namespace) -> Config:
    return Config(**{item.name: getattr(options, item.name)
                     for item in dataclasses.fields(Config)})


def arguments_for(config: Config) -> list:
    """The flags that give `config` (those that differ from Config's defaults)."""
    default = Config()
    flags = []
    for item in dataclasses.fields(Config):
        value = getattr(config, item.name)
        if value != getattr(default, item.name):
            flags += ["--" + item.name.replace("_", "-"), str(value)]
    return flags


def records(directory) -> tuple:
    """({step: {"loss", "lr", "norm", "seconds"}}, {step: validation bits per byte}) of every
    attempt of the job in `directory`, from rank 0's events (a step trained twice, before and
    after a restart, as it was trained last)."""
    steps, validation = {}, {}
    path = os.path.join(directory, "events.rank0.jsonl")
    with open(path) as lines:
        for event in map(json.loads, lines):
            if event["event"] == "step":
                steps[event["step"]] = {key: event[key]
                                        for key in ("loss", "lr", "norm", "seconds")}
            if event["event"] in ("step", "started") and event.get("validation") is not None:
                validation[event["step"]] = event["validation"]
    return steps, validation


def torchrun_job(directory, config: Config, *, kill=None, stop_after=None,
                 max_restarts: int = 1, timeout: float = 120) -> Job:
    """Run this script under torchrun on this machine, on config.ranks workers: `kill` = (rank,
    step) or None; `stop_after`: the last step. Returns lesson 12's Job (exit code, the agent's
    lines, every event, the History rank 0 wrote)."""
    arguments = [str(directory), *arguments_for(config)]
    if stop_after is not None:
        arguments += ["--stop-after", str(stop_after)]
    if kill is not None:
        arguments += ["--kill-rank", str(kill[0]), "--kill-after", str(kill[1])]
    return run_torchrun("helpers.capstone.job", arguments, directory, nproc=config.ranks,
                        max_restarts=max_restarts, timeout=timeout)


def where() -> dict:
    """Who started this rank and where: the host; under Slurm its node, the job's restart and
    the task's number (SLURM_PROCID); under torchrun (TORCHELASTIC_RUN_ID set) the node's rank
    in the rendezvous (GROUP_RANK); the rank on its node (LOCAL_RANK)."""
    return {"host": socket.gethostname(), "node": os.environ.get("SLURMD_NODENAME"),
            "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            "task": os.environ.get("SLURM_PROCID"),
            "torchrun": "TORCHELASTIC_RUN_ID" in os.environ,
            "group_rank": os.environ.get("GROUP_RANK"),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}


def catch_stop_signals():
    """From now on SIGINT and SIGTERM only raise a flag; returns a function that reads it."""
    raised = []
    for number in STOP_SIGNALS:
        signal.signal(number, lambda number, frame: raised.append(number))
    return lambda: bool(raised)


def show_progress(what: str, step: int, history) -> None:
    """One line, redrawn in place: the step, a bar, the loss, the validation loss, the pace."""
    config = history.config
    if what == "started":
        print(f"training {config.layers} blocks of width {config.dim} on dp {config.dp} x tp "
              f"{config.tp} ranks, {config.steps} steps"
              + (f", from the checkpoint of step {step}" if step else ""), flush=True)
        return
    if what != "step":
        return
    done = step / config.steps
    bar = "#" * round(30 * done) + "." * (30 - round(30 * done))
    recent = [history.steps[s]["seconds"] for s in sorted(history.steps)[-20:]]
    per_step = sum(recent) / len(recent)
    validation = (f", validation {history.validation[max(history.validation)]:.2f} bits/byte"
                  if history.validation else "")
    print(f"\rstep {step:5d}/{config.steps} [{bar}] loss "
          f"{bits_per_byte(history.steps[step]['loss']):.2f} bits/byte{validation}, "
          f"{config.tokens_per_step / per_step:,.0f} tokens/s, "
          f"{(config.steps - step) * per_step / 60:.1f} min left ", end="", flush=True)


if __name__ == "__main__":
    main()
