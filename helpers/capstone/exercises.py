"""Lesson 14's exercise, checked by `helpers.exercises.check(name, your_function)`."""

from __future__ import annotations

import math
import os
import signal
import tempfile
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from helpers import reference
from helpers.exercises import Exercise
from helpers.instrument import saved_activations
from helpers.launcher import run
from helpers.launcher.report import WorkerError
from helpers.rules import CallSizes, Only

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
    max_norm: float = 0.5  # small enough that clipping acts: the norms here are 0.6 to 0.7
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


def _run(function, job, directory, recompute, which):
    """One launch of the learner's loop; a rank's error says which of the checker's runs it
    was (`which`)."""
    try:
        return run(_kept_and_result(function), WORLD, args=(job, directory, recompute),
                   timeout=90, show_output=False)
    except WorkerError as error:
        if error.type_name == "NotImplementedError":
            raise NotImplementedError from None  # not started: the engine says so kindly
        if error.type_name == "died" and which == FIRST:
            raise
        raise RankError(f"in {which}, {error}") from None


class RankError(Exception):
    """A rank raised in one of the checker's runs; the message says which run."""


FIRST = "the first run (recompute=True, rank 3 killed)"


def _interrupted(function, kill_after):
    """Run the learner's loop with recomputation on 4 ranks, rank 3 killed after step
    `kill_after`; then again in new processes on the same directory, as torchrun would; then once
    more, whole, without recomputation. Returns the second run's steps, losses and final weights,
    whether recomputation kept fewer bytes a step than the whole run without it, and whether
    that run kept fewer than one process does for half the batch."""
    with tempfile.TemporaryDirectory(prefix="helpers-capstone-") as directory:
        try:
            _run(function, replace(JOB, kill_after=kill_after), directory, True, FIRST)
        except WorkerError:  # rank 3 died, as it should
            pass
        else:
            return "the first run finished: did it load each step's batch with job.batch(step)?"
        resumed = _run(function, JOB, directory, True,
                       "the second run (recompute=True, resumed after the kill)")
    with tempfile.TemporaryDirectory(prefix="helpers-capstone-") as directory:
        plain = _run(function, JOB, directory, False, "the whole run with recompute=False")
    result = resumed[0][0]
    if not (isinstance(result, (tuple, list)) and len(result) == 2
            and isinstance(result[0], dict) and isinstance(result[1], dict)):
        return (f"your function returned {type(result).__name__} {str(result)[:60]}; the task "
                "asks for a tuple (losses, weights)")
    losses, weights = result
    # bytes a step, on the rank that kept the most
    with_recompute = max(kept for _, kept in resumed) / max(1, len(losses))
    without = max(kept for _, kept in plain) / JOB.steps
    return (sorted(losses), losses, weights, with_recompute < without,
            without < _half_batch_bytes())


def _half_batch_bytes() -> float:
    """The bytes one process keeps for backward in a step on half of each batch (a copy of it),
    with no recomputation: what data parallelism alone would leave each rank."""
    model, batches = JOB.model(), JOB.batches()
    optimizer = JOB.optimizer(model.parameters())
    with saved_activations() as saved:
        for batch in batches:
            half = batch.shard(0, 2)
            optimizer.zero_grad()
            reference.lm_loss(model(half.inputs.clone()), half.targets.clone()).backward()
            optimizer.step()
    return sum(size for _, size, _ in saved) / len(batches)


def _uninterrupted(kill_after):
    """One process, no layout: reference.train on the whole batches, clipped as the job says."""
    model, batches = JOB.model(), JOB.batches()
    trained = reference.train(model, batches, reference.lm_loss, max_grad_norm=JOB.max_norm)
    resumed_after = kill_after // JOB.save_every * JOB.save_every
    steps = list(range(resumed_after + 1, JOB.steps + 1))
    return (steps, {step: trained.losses[step - 1] for step in steps}, trained.parameters, True,
            True)


EXERCISES["capstone"] = Exercise(
    "capstone(rank, world_size, job, directory, recompute) trains job.model() (a float64 "
    "TinyLM) on 4 ranks laid out as 2 data-parallel x 2 tensor-parallel, for job.steps steps: "
    "step s (counted from 0) on job.batch(s), the whole batch, each data-parallel rank on its "
    "half (.shard(dp_rank, 2)); the whole batch's next-token loss (reference.lm_loss), which is "
    "the mean of the two halves'; gradients clipped as torch.nn.utils.clip_grad_norm_ clips "
    "them, to a global norm of job.max_norm (the norm of every gradient of the whole model, "
    "scaled by max_norm / (norm + 1e-6) where that is below 1); then an AdamW step "
    "(job.optimizer(parameters)). Without `recompute`, each rank keeps for backward fewer bytes "
    "a step than one process keeps for half the batch (what data parallelism alone would "
    "leave it: tensor parallelism must cut the blocks' share); with `recompute` fewer still, "
    "computing the same. It saves a checkpoint to `directory` after every job.save_every-th "
    "step, and resumes from the newest one there. It returns a tuple (losses, weights): {step: "
    "the whole batch's loss} for the steps this run trained (counted from 1, Python floats), "
    "and {name: whole weight} named as in job.model(); any rank may be any coordinate of the "
    "mesh. The checker runs it with `recompute` and kills rank 3 while it loads a batch (kill_"
    "after = k: step k + 1's; k = 4, then 6), starts it again in new processes on the same "
    "directory: that run must start after the newest checkpoint and end as one process trains "
    "(reference.train), loss for loss and weight for weight; then it runs it whole without "
    "`recompute`. It counts the bytes autograd keeps for backward on every rank, as they are "
    "saved (saved tensors hooks: a checkpointed region's are not seen)",
    KILL_CASES,
    _uninterrupted,
    distributed=False,
    harness=_interrupted,
    names=("the steps the second run trained", "the second run's losses, by step",
           "the weights at the end", "fewer bytes kept for backward with recompute",
           "without recompute, fewer bytes kept than one process keeps for half the batch"),
    rel_tol=1e-9,  # float64 against one process: rounding ~1e-16 of each sum (helpers.tolerance)
    timeout=300,
    hint="which steps did the second run train, and did it load the optimizer's state too? "
         "The loss and the gradients are the whole batch's: each data-parallel half's, "
         "averaged. The gradients' global norm takes every rank's pieces, once each (a model "
         "laid out in part has gradients on two meshes: lesson 13's accounting.clip_to_norm "
         "norms each mesh's apart).",
)


# --- one norm over two mesh dimensions ----------------------------------------------------------

NORM_CASES = [(4, (0,)), (4, (1,)), (8, (2,))]  # (world size, (seed,)): dp 2 or 4, tp 2


def _gradients(seed: int) -> dict:
    """A model's whole gradients: two blocks' weights, cut over dp (rows) and tp (columns); an
    embedding and a head cut over dp only, the same piece on both tp partners."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"blocks.0.weight": (8, 6), "blocks.1.weight": (8, 6), "embedding.weight": (16, 4),
              "head.weight": (8, 16)}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def _norm_pieces(rank, world_size, seed):
    """What a rank of the dp x tp mesh holds, rank = dp_rank x 2 + tp_rank."""
    dp, tp = world_size // 2, 2
    dp_rank, tp_rank = divmod(rank, tp)
    pieces = {}
    for name, whole in _gradients(seed).items():
        rows = whole.chunk(dp, dim=0)[dp_rank]
        pieces[name] = rows.chunk(tp, dim=1)[tp_rank] if name.startswith("blocks.") else rows
    return pieces, dp_rank, tp_rank


def _norm_expected(rank, world_size, seed):
    return math.sqrt(sum(float(whole.double().pow(2).sum()) for whole in _gradients(seed).values()))


EXERCISES["global_norm"] = Exercise(
    "global_norm(rank, world_size, pieces, dp_rank, tp_rank) returns, on every rank, the global "
    "norm of a model's whole gradients, as a Python float, from the pieces each rank of a dp x "
    "tp mesh holds (tp = 2, rank = dp_rank x 2 + tp_rank): `pieces` maps a name to this rank's "
    "piece; a name starting with \"blocks.\" is cut over both dp and tp (every rank holds a "
    "piece of its own), the others over dp only (both tp partners hold the same piece). It "
    "uses one all_reduce, of one number, and no other communication: the two mesh dimensions "
    "as one, which is what DTensor's \"2 sequential all_reduce\" warning asks for",
    NORM_CASES, _norm_expected,
    inputs=_norm_pieces,
    rules=(Only("all_reduce", text="use one all_reduce and no other communication"),
           CallSizes("all_reduce", lambda n, seed: [1], text="one all_reduce, of one number")),
    hint="does each piece count once? Both tp partners hold the same embedding and head.",
)
