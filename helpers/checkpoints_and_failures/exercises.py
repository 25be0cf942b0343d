"""Lesson 12's exercises, checked by `helpers.exercises.check(name, your_function)`."""

from __future__ import annotations

import os
import signal
import tempfile
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from helpers import reference
from helpers.checkpoints_and_failures.resume import Experiment, global_batches
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
# (kill_after,): mid-epoch, after the checkpoint of step 6 (an epoch is 4 steps on 2 ranks); just
# after the last checkpoint, in the last epoch
KILL_CASES = [(7,), (9,)]


def _resumed_after(kill_after: int) -> int:
    """The newest checkpoint when rank 1 dies: the last multiple of save_every it completed."""
    return kill_after // JOB.save_every * JOB.save_every


def _interrupted(function, kill_after):
    """Run `function(rank, world_size, job, directory)` on 2 ranks with rank 1 killed after step
    `kill_after`, then again in new processes on the same directory, as torchrun would. Returns,
    from the second run, the steps it trained, their losses, and the weights at the end."""
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
        result = run(function, 2, args=(JOB, directory), timeout=60, show_output=False)[0]
    if not (isinstance(result, (tuple, list)) and len(result) == 2
            and isinstance(result[0], dict) and isinstance(result[1], dict)):
        return (f"your function returned {type(result).__name__} {str(result)[:60]}; the task "
                "asks for a tuple (losses, state)")
    losses, state = result
    return sorted(losses), losses, state.get("model")


def _uninterrupted(kill_after):
    alone = reference.train(JOB.model(), global_batches(JOB, 2), reference.lm_loss,
                            scheduler=JOB.scheduler)
    losses = alone.losses_by_step()
    steps = list(range(_resumed_after(kill_after) + 1, JOB.steps + 1))
    return steps, {step: losses[step] for step in steps}, alone.parameters


EXERCISES["resumable"] = Exercise(
    "resumable(rank, world_size, job, directory) trains `job` (a WarmupJob: the lesson's "
    "Experiment with a warm-up scheduler, job.scheduler(optimizer)) under FSDP for job.steps "
    "steps, rank r drawing its noise from torch's global RNG seeded with job.seed + r (seed "
    "first, then load a checkpoint, whose RNG state replaces the seeded one) and its batches "
    "from job.batch(sampler, epoch, offset), sampler = job.sampler(rank, world_size), moving "
    "(epoch, offset) on after each step with job.steps_per_epoch(world_size) batches an epoch, "
    "as in the lesson's loop. It returns a tuple (losses, state): this run's losses, {step: "
    "loss averaged over the ranks} with the step an int counted from 1 and the loss a Python "
    "float, and sharded.full_state(model, optimizer). It saves a checkpoint to `directory` "
    "after every job.save_every-th step. The checker kills rank 1 while it loads a batch (the "
    "case's kill_after = k: step k + 1's) and starts the function again, in new processes, on "
    "the same directory: that run must start "
    "after the newest checkpoint and end exactly as a run that was never interrupted, with the "
    "same loss at every step it trains and the same weights at the end",
    KILL_CASES,
    _uninterrupted,
    distributed=False,
    harness=_interrupted,
    names=("the steps the second run trained", "the second run's losses, by step",
           "the weights at the end"),
    rel_tol=1e-12,  # float64, the same operations on the same data: "the same loss", to rounding
    hint="did the second run start after the newest checkpoint? What does step k + 1 depend on, "
         "besides the weights, and which of those differs from rank to rank? (A key of a DCP "
         "state that differs between ranks needs the rank in its name.)",
    points=3,
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


def _on_dumps(function, case):
    """Calls the learner's function on the case's dumps (named by the case, not printed)."""
    world_size, steps, odd_rank, change = OUT_OF_STEP[case]
    return function(_dumps(world_size, steps, odd_rank, change))


EXERCISES["fell_out_of_step"] = Exercise(
    "fell_out_of_step(dumps) returns the rank (an int) that fell out of step, given each rank's "
    "flight-recorder dump of one group (dumps[r] is rank r's, as "
    "pickle.loads(torch._C._distributed_c10d._dump_fr_trace()) returns it; at least 3 ranks, "
    "only the newest entries kept): the rank whose collective differs from what all the others "
    "called at the first sequence number where the ranks do not all agree (another collective, "
    "other input sizes, or none at all)",
    [(case,) for case in OUT_OF_STEP],
    lambda case: OUT_OF_STEP[case][2],
    harness=_on_dumps,
    distributed=False,
    hint="line the entries up by their 'collective_seq_id', not by their position in the list: "
         "a recorder keeps only its newest entries, and a rank that skipped one is one behind",
)
