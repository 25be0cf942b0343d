"""Lesson 12's exercises, checked by `helpers.exercises.check(name, your_function)`."""

from __future__ import annotations

import os
import signal
import tempfile
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from helpers.checkpoints_and_failures.resume import Experiment, one_process_losses
from helpers.exercises import Exercise
from helpers.launcher import run
from helpers.launcher.report import WorkerError

EXERCISES = {}

# --- a loop that survives a kill (design) -------------------------------------------------------

KILLED_RANK = 1
_batches_loaded = 0  # in each rank's process: how many batches WarmupJob.batch has given


@dataclass(frozen=True)
class WarmupJob(Experiment):
    """The lesson's Experiment with a learning rate that warms up over `warmup` steps
    (scheduler(optimizer): call its step() after each optimizer step). With `kill_after` = k,
    rank 1 is killed (SIGKILL) when it asks for the batch of step k + 1: the checker's way of
    pulling the plug."""

    steps: int = 10
    save_every: int = 3
    warmup: int = 5
    kill_after: int | None = None

    def scheduler(self, optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / self.warmup))

    def batch(self, sampler, epoch, offset):
        global _batches_loaded
        _batches_loaded += 1
        if (self.kill_after is not None and dist.get_rank() == KILLED_RANK
                and _batches_loaded == self.kill_after + 1):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().batch(sampler, epoch, offset)


JOB = WarmupJob()
# (kill_after,): before the first checkpoint; mid-epoch after one (an epoch is 4 steps on 2
# ranks); just after the last one, in the last epoch
KILL_CASES = [(2,), (7,), (9,)]


def _interrupted(function, kill_after):
    """Run `function(rank, world_size, job, directory)` on 2 ranks with rank 1 killed after step
    `kill_after`, then again in new processes on the same directory, as torchrun would. Returns
    the losses of the steps after the kill and the weights at the end, from the second run."""
    with tempfile.TemporaryDirectory(prefix="helpers-resume-") as directory:
        try:
            run(function, 2, args=(replace(JOB, kill_after=kill_after), directory), timeout=60,
                show_output=False)
        except WorkerError as error:
            if error.type_name == "NotImplementedError":
                raise NotImplementedError from None  # not started: the engine says so kindly
            if error.type_name != "died":
                raise
        else:
            return "the first run finished: did it load each step's batch with job.batch?"
        out = run(function, 2, args=(JOB, directory), timeout=60, show_output=False)
    losses, state = out[0]
    return ({step: losses.get(step) for step in range(kill_after + 1, JOB.steps + 1)},
            state["model"])


def _uninterrupted(kill_after):
    losses, parameters = one_process_losses(JOB, 2)
    return ({step: losses[step] for step in range(kill_after + 1, JOB.steps + 1)}, parameters)


EXERCISES["resumable"] = Exercise(
    "resumable(rank, world_size, job, directory) trains `job` (a WarmupJob: the lesson's "
    "Experiment with a warm-up scheduler) under FSDP for job.steps steps and returns (this run's "
    "losses, {step: loss averaged over ranks}, and sharded.full_state(model, optimizer)). It may "
    "be killed at any step; started again on the same directory, in new processes, it must end "
    "exactly as a run that was never interrupted: the same loss at every step after the kill and "
    "the same weights at the end. It saves at most every job.save_every steps",
    KILL_CASES,
    _uninterrupted,
    distributed=False,
    harness=_interrupted,
    names=("the losses after the kill, by step", "the weights at the end"),
    hint="what does step k + 1 depend on, besides the weights? Which of those changes from step "
         "to step, on each rank? (A key of a DCP state that differs between ranks needs the "
         "rank in its name.)",
)


# --- which rank fell out of step ----------------------------------------------------------------

def _entry(seq: int, name: str, size: int, line: int) -> dict:
    """One flight-recorder entry as torch 2.13 writes it for gloo (the fields the lesson reads,
    and the others with their gloo values)."""
    return {"frames": [{"name": "all_reduce", "filename": "/torch/distributed/distributed_c10d.py",
                        "line": 3245}, {"name": "worker", "filename": "train.py", "line": line}],
            "record_id": seq - 1, "pg_id": 1, "process_group": ("1", "undefined"),
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": f"gloo:{name}", "input_sizes": [[size]], "input_dtypes": ["Float"],
            "output_sizes": [[size]], "output_dtypes": ["Float"], "state": "scheduled",
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
            "retired": True, "timeout_ms": 2000, "is_p2p": False}


STEP = [("all_gather", 16, 10), ("all_reduce", 64, 11), ("all_reduce", 1, 12)]  # one step's


def _dumps(world_size: int, steps: int, odd_rank: int, change) -> list:
    """Every rank's dump after `steps` steps of STEP, with `change(calls)` applied to the odd
    rank's list of (name, size, line)."""
    dumps = []
    for rank in range(world_size):
        calls = STEP * steps
        if rank == odd_rank:
            calls = change(list(calls))
        entries = [_entry(seq, *call) for seq, call in enumerate(calls, start=1)]
        dumps.append({"version": "2.10", "pg_config": {}, "pg_status": {},
                      "entries": entries[-16:]})  # a recorder keeps only its last entries
    return dumps


def _skip(index):
    return lambda calls: calls[:index] + calls[index + 1:]


def _swap(index, name):
    return lambda calls: calls[:index] + [(name, *calls[index][1:])] + calls[index + 1:]


def _resize(index, size):
    return lambda calls: calls[:index] + [(calls[index][0], size, calls[index][2])] + calls[
        index + 1:]


# (world size, steps, odd rank, what it did): each a case of its own
OUT_OF_STEP = {
    "skipped a loss all-reduce": (4, 3, 2, _skip(5)),
    "broadcast for an all-reduce": (3, 4, 0, _swap(7, "broadcast")),
    "another size": (4, 2, 3, _resize(4, 32)),
    "stopped early": (5, 3, 4, lambda calls: calls[:-1]),
    "skipped in the first step": (3, 8, 1, _skip(2)),
}


def _out_of_step_inputs(case):
    world_size, steps, odd_rank, change = OUT_OF_STEP[case]
    return (_dumps(world_size, steps, odd_rank, change),)


EXERCISES["fell_out_of_step"] = Exercise(
    "fell_out_of_step(dumps) returns the rank (an int) that fell out of step, given each rank's "
    "flight-recorder dump of one group (dumps[r] is rank r's, as "
    "pickle.loads(torch._C._distributed_c10d._dump_fr_trace()) returns it; at least 3 ranks, "
    "only the newest entries kept): the rank whose collective differs from what all the others "
    "called at the first sequence number where the ranks do not all agree (another collective, "
    "other input sizes, or none at all)",
    [(case,) for case in OUT_OF_STEP],
    lambda case: OUT_OF_STEP[case][2],
    inputs=_out_of_step_inputs,
    distributed=False,
    hint="line the entries up by their 'collective_seq_id', not by their position in the list: "
         "a recorder keeps only its newest entries, and a rank that skipped one is one behind",
)
