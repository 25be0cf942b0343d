"""The checker's torchrun script for lesson 14's entry-point exercise: every rank runs the
learner's `entry_point(job)` under torchrun, and `job.train(stop)` trains as the capstone's job
does, a signal landing on one rank mid-run.

    torchrun ... -m helpers.capstone.entry DIRECTORY

DIRECTORY/entry.pkl holds (entry_point, job), cloudpickled by the checker (a function written in
a notebook travels by value). Each rank appends its events to DIRECTORY/events.rank<r>.jsonl, as
helpers.capstone.job's ranks do; rank 0 writes the History of the run, with the whole weights, to
DIRECTORY/final.pt.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass

import cloudpickle
import torch
import torch.distributed as dist

from helpers.capstone.train import Config, History, train_worker
from helpers.checkpoints_and_failures.elastic import FINAL_FILE
from helpers.timing import timestamp

PAYLOAD = "entry.pkl"


@dataclass(frozen=True)
class StopJob:
    """A capstone run for an entry point to drive: `train(stop)` trains `config` in `directory`
    on the group the entry point joined, resuming from the newest checkpoint there; `stop(step)`
    is asked after every step, and True saves a checkpoint and ends the run (every rank must
    answer alike). With `signal_rank`, that rank is sent `signal_number` as it ends step
    `signal_after`, after the update and before `stop` is asked: a scheduler's SIGTERM, or a
    Ctrl-C, landing on one rank alone."""

    config: Config
    directory: str
    signal_rank: int | None = None
    signal_after: int = 0
    signal_number: int = signal.SIGTERM

    def train(self, stop) -> History:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        with open(os.path.join(self.directory, f"events.rank{rank}.jsonl"), "a") as log:

            def on_event(what, step, history):
                record = history.steps.get(step, {}) if what == "step" else {}
                log.write(json.dumps({"time": timestamp(), "rank": rank, "attempt": 0,
                                      "event": what, "step": step,
                                      "loss": record.get("loss")}) + "\n")
                log.flush()
                if what == "step" and rank == self.signal_rank and step == self.signal_after:
                    os.kill(os.getpid(), self.signal_number)

            history = train_worker(rank, world_size, self.config, self.directory,
                                   on_event=on_event, stop=stop, weights=True)
            log.write(json.dumps({"time": timestamp(), "rank": rank, "attempt": 0,
                                  "event": "returned", "step": max(history.steps, default=0)})
                      + "\n")
        if rank == 0:
            torch.save(history, os.path.join(self.directory, FINAL_FILE))
        return history


def main(argv=None) -> None:
    directory = (argv or sys.argv[1:])[0]
    with open(os.path.join(directory, PAYLOAD), "rb") as payload:
        entry_point, job = cloudpickle.load(payload)
    entry_point(job)


if __name__ == "__main__":
    main()
