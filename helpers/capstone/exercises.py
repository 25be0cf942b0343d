"""Lesson 14's exercise, checked by `helpers.exercises.check(name, your_function)`."""

from __future__ import annotations

import os
import signal
import tempfile
from dataclasses import dataclass, replace

import torch.distributed as dist

from helpers import reference
from helpers.exercises import Exercise
from helpers.instrument import saved_activations
from helpers.launcher import run
from helpers.launcher.report import WorkerError

EXERCISES = {}

# --- the capstone (design) ----------------------------------------------------------------------

KILLED_RANK = 3
WORLD = 4


@dataclass(frozen=True)
class CapstoneJob:
    """A small float64 job for the capstone exercise: a TinyLM (lessons 06 and 08's model), the
    whole batch of each step (`batch(step)`: a reference.Batch of `batch_size` sequences; a
    data-parallel rank trains on its slice, `.shard(dp_rank, dp)`), AdamW (`optimizer(params)`)
    and a global gradient norm to clip to (`max_norm`). With `kill_after` = k, rank 3 is killed
    (SIGKILL) when it asks for the batch of step k + 1: the checker's way of pulling the plug."""

    steps: int = 8
    save_every: int = 3
    batch_size: int = 8
    seq_len: int = 16
    max_norm: float = 0.5  # small enough that clipping acts: the norms here start above 1
    seed: int = 0
    kill_after: int | None = None

    def model(self):
        return reference.make_lm(vocab=64, dim=32, heads=4, layers=2, max_seq_len=self.seq_len,
                                 seed=self.seed).double()

    def optimizer(self, parameters):
        return reference.make_optimizer("adamw", parameters)

    def batches(self) -> list:
        return reference.in_float64(self.model(), reference.lm_data(
            seed=self.seed + 1, batch_size=self.batch_size, seq_len=self.seq_len,
            steps=self.steps))[1]

    def batch(self, step: int) -> reference.Batch:
        if (self.kill_after is not None and dist.is_initialized()
                and dist.get_rank() == KILLED_RANK and step == self.kill_after):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.batches()[step]


JOB = CapstoneJob()
# (kill_after,): mid-way, after the checkpoint of step 3; just after the last checkpoint (6)
KILL_CASES = [(4,), (6,)]


def _kept_and_result(function):
    """The learner's function, run inside a hook that adds up the bytes autograd keeps for
    backward on this rank (each tensor saved by an operation, as it is saved; a checkpointed
    region's are not kept, and are saved again while backward recomputes them, inside
    torch.utils.checkpoint's own hooks, which this one does not see)."""

    def worker(rank, world_size, job, directory, recompute):
        with saved_activations() as saved:  # every save, as it is saved: (pointer, bytes, kind)
            result = function(rank, world_size, job, directory, recompute)
        return result, sum(size for _, size, _ in saved)

    return worker


def _run(function, job, directory, recompute):
    return run(_kept_and_result(function), WORLD, args=(job, directory, recompute), timeout=90,
               show_output=False)


def _interrupted(function, kill_after):
    """Run the learner's loop with recomputation on 4 ranks, rank 3 killed after step
    `kill_after`; then again in new processes on the same directory, as torchrun would; then once
    more, whole, without recomputation. Returns the second run's steps, losses and final weights,
    and whether recomputation kept fewer bytes a step."""
    with tempfile.TemporaryDirectory(prefix="helpers-capstone-") as directory:
        try:
            _run(function, replace(JOB, kill_after=kill_after), directory, True)
        except WorkerError as error:
            if error.type_name == "NotImplementedError":
                raise NotImplementedError from None  # not started: the engine says so kindly
            if error.type_name != "died":
                raise
        else:
            return "the first run finished: did it load each step's batch with job.batch(step)?"
        resumed = _run(function, JOB, directory, True)
    with tempfile.TemporaryDirectory(prefix="helpers-capstone-") as directory:
        plain = _run(function, JOB, directory, False)
    (result, kept_resumed), (_, kept_plain) = resumed[0], plain[0]
    if not (isinstance(result, (tuple, list)) and len(result) == 2
            and isinstance(result[0], dict) and isinstance(result[1], dict)):
        return (f"your function returned {type(result).__name__} {str(result)[:60]}; the task "
                "asks for a tuple (losses, weights)")
    losses, weights = result
    per_step = {True: kept_resumed / max(1, len(losses)),
                False: kept_plain / max(1, len(plain[0][0][0]))}
    return sorted(losses), losses, weights, per_step[True] < per_step[False]


def _uninterrupted(kill_after):
    """One process, no layout: reference.train on the whole batches, clipped as the job says."""
    model, batches = JOB.model(), JOB.batches()
    trained = reference.train(model, batches, reference.lm_loss, max_grad_norm=JOB.max_norm)
    resumed_after = kill_after // JOB.save_every * JOB.save_every
    steps = list(range(resumed_after + 1, JOB.steps + 1))
    return (steps, {step: trained.losses[step - 1] for step in steps}, trained.parameters, True)


EXERCISES["capstone"] = Exercise(
    "capstone(rank, world_size, job, directory, recompute) trains job.model() (a float64 "
    "TinyLM) on 4 ranks laid out as 2 data-parallel x 2 tensor-parallel, for job.steps steps: "
    "step s (counted from 0) on job.batch(s), the whole batch, each data-parallel rank on its "
    "half; the next-token loss (reference.lm_loss); gradients clipped to a global norm of "
    "job.max_norm (the norm of every gradient of the whole model); then an AdamW step "
    "(job.optimizer). With `recompute` it keeps fewer bytes for backward than without, and "
    "computes the same. It saves a checkpoint to `directory` after every job.save_every-th "
    "step, and resumes from the newest one there. It returns a tuple (losses, weights): {step: "
    "the whole batch's loss} for the steps this run trained (counted from 1, Python floats), "
    "and {name: whole weight} named as in job.model(). The checker kills rank 3 while it loads "
    "a batch (the case's kill_after = k: step k + 1's) and starts the function again, in new "
    "processes, on the same directory: that run must start after the newest checkpoint and end "
    "as one process trains (reference.train), loss for loss and weight for weight",
    KILL_CASES,
    _uninterrupted,
    distributed=False,
    harness=_interrupted,
    names=("the steps the second run trained", "the second run's losses, by step",
           "the weights at the end", "fewer bytes kept for backward with recompute"),
    rel_tol=1e-9,  # float64 against one process: rounding ~1e-16 of each sum (helpers.tolerance)
    timeout=300,
    hint="which steps did the second run train, and did it load the optimizer's state too? "
         "With tensor parallelism, the gradients' global norm takes every rank's pieces.",
)
