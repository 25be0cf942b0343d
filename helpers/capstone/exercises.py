"""Lesson 14's exercises, checked by `helpers.exercises.check(name, your_function)`."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pathlib
import re
import signal
import tempfile
import weakref
from dataclasses import dataclass, replace

import cloudpickle
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from helpers import reference
from helpers import rules as rules_module
from helpers.capstone import train
from helpers.capstone.corpus import python_source
from helpers.capstone.train import Config
from helpers.exercises import Exercise, _compare
from helpers.instrument import Observer, saved_activations
from helpers.launcher import run
from helpers.launcher.report import WorkerError
from helpers.launcher.result import get_device
from helpers.layouts import make_mesh
from helpers.rules import CallRecorder, CallSizes, Only
from helpers.tensor_parallelism.megatron import plan_style
from helpers.training import mean_over

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
# float64 against one process: rounding ~1e-16 of each sum (helpers.tolerance), and AdamW's
# amplification of it over 8 steps, stay far below 1e-9 (a right run is ~1e-14 from the
# reference); a typical mistake moves a loss by 2e-9 (gradients twice the batch's, which clipping
# and AdamW all but cancel) to 1e-2
REL_TOL = 1e-9

WHOLE = "the whole run (recompute=False, never killed)"
KILLED = "the killed run (recompute=True, rank 3 killed while it loads a batch)"
RESUMED = "the resumed run (recompute=True, new processes on the killed run's directory)"
NAMES = (f"{WHOLE}: its losses, by step",
         f"{WHOLE}: its weights at the end",
         f"{WHOLE}: fewer bytes kept for backward than one process keeps for half the batch",
         f"{RESUMED}: the steps it trained",
         f"{RESUMED}: its losses, by step",
         f"{RESUMED}: its weights at the end",
         f"{RESUMED}: fewer bytes kept for backward a step than {WHOLE.split(' (')[0]} keeps")
NOT_RUN = "not run: the whole run differed already"


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


class RankError(Exception):
    """A rank raised in one of the checker's runs; the message says which run."""


def _run(function, job, directory, recompute, which):
    """One launch of the learner's loop; a rank's error says which of the checker's runs it
    was (`which`)."""
    try:
        return run(_kept_and_result(function), WORLD, args=(job, directory, recompute),
                   timeout=90, show_output=False)
    except WorkerError as error:
        if error.type_name == "NotImplementedError":
            raise NotImplementedError from None  # not started: the engine says so kindly
        if error.type_name == "died" and which == KILLED:
            raise
        raise RankError(f"in {which}, {error}") from None


def _returned(result, which) -> str | None:
    """What is wrong with the shape of rank 0's result, or None."""
    if (isinstance(result, (tuple, list)) and len(result) == 2
            and isinstance(result[0], dict) and isinstance(result[1], dict)):
        return None
    return (f"in {which}, your function returned {type(result).__name__} {str(result)[:60]}; "
            "the task asks for a tuple (losses, weights)")


# the learner's function -> its whole run, made in the first case and reused in the next (the
# same function, in the same check: the first case always runs it again)
_WHOLE_RUNS = weakref.WeakKeyDictionary()


def _whole_run(function):
    """The learner's loop on 4 ranks, whole, without recomputation, in a directory of its own:
    (losses, weights, the most bytes a rank kept for backward a step), or a message."""
    with tempfile.TemporaryDirectory(prefix="helpers-capstone-") as directory:
        plain = _run(function, JOB, directory, False, WHOLE)
    problem = _returned(plain[0][0], WHOLE)
    if problem:
        return problem
    losses, weights = plain[0][0]
    return losses, weights, max(kept for _, kept in plain) / JOB.steps


def _interrupted(function, kill_after):
    """First the learner's loop whole, without recomputation (made once per check: the first
    case runs it), compared with one process step by step: a mistake in every step shows there,
    before any kill. Then, where it matched, with recomputation on 4 ranks, rank 3 killed after
    step `kill_after`; then again in new processes on the same directory, as torchrun would.
    Returns the whole run's losses, weights and whether it kept fewer bytes a step than one
    process does for half the batch; the resumed run's steps, losses and final weights, and
    whether it kept fewer bytes a step than the whole run without recomputation."""
    if kill_after == KILL_CASES[0][0] or function not in _WHOLE_RUNS:
        _WHOLE_RUNS[function] = _whole_run(function)
    whole = _WHOLE_RUNS[function]
    if isinstance(whole, str):
        return whole
    losses, weights, without = whole
    first = (losses, weights, without < _half_batch_bytes())
    if _compare(first, _uninterrupted(kill_after)[:3], NAMES[:3], REL_TOL):
        return (*first, NOT_RUN, NOT_RUN, NOT_RUN, NOT_RUN)
    with tempfile.TemporaryDirectory(prefix="helpers-capstone-") as directory:
        try:
            _run(function, replace(JOB, kill_after=kill_after), directory, True, KILLED)
        except WorkerError:  # rank 3 died, as it should
            pass
        else:
            return (f"{KILLED.split(' (')[0]} finished: did it load each step's batch with "
                    "job.batch(step)?")
        resumed = _run(function, JOB, directory, True, RESUMED)
    problem = _returned(resumed[0][0], RESUMED)
    if problem:
        return problem
    losses, weights = resumed[0][0]
    # bytes a step, on the rank that kept the most
    with_recompute = max(kept for _, kept in resumed) / max(1, len(losses))
    return (*first, sorted(losses), losses, weights, with_recompute < without)


@functools.cache
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


@functools.cache
def _reference_run() -> reference.TrainingRun:
    """One process, no layout: reference.train on the whole batches, clipped as the job says."""
    return reference.train(JOB.model(), JOB.batches(), reference.lm_loss,
                           max_grad_norm=JOB.max_norm)


def _newest_checkpoint(kill_after: int) -> int:
    """The step of the newest checkpoint when rank 3 dies loading step kill_after + 1's batch."""
    return kill_after // JOB.save_every * JOB.save_every


def _uninterrupted(kill_after):
    trained = _reference_run()
    losses = {step: loss for step, loss in enumerate(trained.losses, start=1)}
    steps = list(range(_newest_checkpoint(kill_after) + 1, JOB.steps + 1))
    return (losses, trained.parameters, True,
            steps, {step: losses[step] for step in steps}, trained.parameters, True)


# --- what a typical mistake trains to: the job in one process, as the mistake computes it -------

def _over_tp(name: str) -> str:
    """How lesson 08's plan, which the reference solution lays out, holds parameter `name`
    (blocks.0.attention.q.weight) over tp: "cut" (a column layer's weight and bias, a row
    layer's weight), "whole in a layer" (a row layer's bias: both tp partners hold it, a
    DTensor replicated over tp in PyTorch's plan) or "untouched" (the norms, the embeddings,
    the head: both hold them, and under PyTorch's layout they are DTensors on the dp mesh
    alone, whose placements do not say so)."""
    layer, _, kind = name.rpartition(".")
    style = plan_style(layer) if name.startswith("blocks.") else None
    if style == "column" or (style == "row" and kind == "weight"):
        return "cut"
    return "whole in a layer" if style == "row" else "untouched"


def _cut_over_tp(name: str) -> bool:
    """Whether lesson 08's plan cuts parameter `name` over tp (`_over_tp`)."""
    return _over_tp(name) == "cut"


OVER_TP = ("cut", "whole in a layer", "untouched")


@functools.cache
def _simulated(copies: tuple | None = None, clipped: bool = True, gradient_scale: float = 1.0,
               fresh_optimizer_after: int | None = None, counted_from: int = 0) -> dict:
    """The job trained in one process as a typical mistake trains it (all defaults: as
    reference.train does, to the bit): the norm of `copies` = (how many times it counts a
    gradient of each kind of OVER_TP: cut over tp, whole in a tp layer, untouched by tensor
    parallelism), no clipping, gradients
    `gradient_scale` times the whole batch's, or AdamW started afresh after step
    `fresh_optimizer_after` (a checkpoint without its state), its moments zero and its step
    count `counted_from`. Returns {step: (the whole batch's loss, data-parallel half 0's, half
    1's)}: a tenth of a second."""
    model, batches = JOB.model(), JOB.batches()
    optimizer = JOB.optimizer(model.parameters())
    losses = {}
    for step, batch in enumerate(batches, start=1):
        if step - 1 == fresh_optimizer_after:
            optimizer = JOB.optimizer(model.parameters())
            for _ in range(counted_from):
                _zero_step(optimizer)
        with torch.no_grad():
            halves = [reference.lm_loss(model(half.inputs), half.targets).item()
                      for half in (batch.shard(0, 2), batch.shard(1, 2))]
        optimizer.zero_grad()
        loss = reference.lm_loss(model(batch.inputs), batch.targets)
        (loss * gradient_scale).backward()
        if copies is not None:
            norm = torch.linalg.vector_norm(torch.stack([
                parameter.grad.norm() * math.sqrt(copies[OVER_TP.index(_over_tp(name))])
                for name, parameter in model.named_parameters()]))
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), JOB.max_norm, norm)
        elif clipped:
            torch.nn.utils.clip_grad_norm_(model.parameters(), JOB.max_norm)
        optimizer.step()
        losses[step] = (loss.item(), *halves)
    return losses


def _zero_step(optimizer) -> None:
    """A step of zero gradients at a learning rate of 0: the moments stay zero, the step count
    goes up, the weights do not move. DCP's get_state_dict does this to a new optimizer, to make
    its state (torch/distributed/checkpoint/state_dict.py, _init_optim_state): a checkpoint that
    leaves the optimizer out but reads the model's state with get_state_dict resumes with it."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


def _matches(got: dict, simulated: dict, which: int = 0) -> bool:
    """Whether every loss in `got` is the simulation's (`which`: 0 the whole batch's, 1 and 2
    the halves'), as near as a right run is to one process."""
    return all(step in simulated and not _compare(loss, simulated[step][which], rel_tol=REL_TOL)
               for step, loss in got.items())


TWICE = ("the norm counts twice what both tp partners hold: the embeddings, the head, the norms "
         "and a row layer's bias are whole on both, and each adds its squares. Count a piece "
         "that is replicated over a mesh dimension on one rank of it (or let DTensor do it: "
         "clip_to_norm, lesson 13).")
# (the mistake, recognised by its losses in the whole run: a function of them; its hint)
WHOLE_RUN_MISTAKES = (
    (lambda got: _matches(got, _simulated(), 1) or _matches(got, _simulated(), 2),
     "the losses are one data-parallel half's alone, trained right: each step's loss is the "
     "whole batch's, the mean of the two halves' (an all_reduce with ReduceOp.AVG over dp)."),
    (lambda got: _matches({step: loss / 2 for step, loss in got.items()}, _simulated()),
     "the losses are twice the whole batch's: the two data-parallel halves' summed, where the "
     "batch's loss is their mean."),
    (lambda got: _matches(got, _simulated(copies=(1, 2, 2))), TWICE),
    (lambda got: _matches(got, _simulated(copies=(1, 1, 2))),
     "the norm counts twice the pieces tensor parallelism did not touch: the embeddings, the "
     "head and the norms. Both tp partners hold them whole; laid out by fully_shard over \"dp\" "
     "alone they are DTensors on the dp mesh, (Shard(0),), whose placements say nothing of tp. "
     "Count them on one tp rank (tp coordinate 0)."),
    (lambda got: _matches(got, _simulated(copies=(2, 2, 2))),
     "the norm counts every gradient once per data-parallel rank: each rank's pieces are cut "
     "over dp (FSDP) or, kept whole on both dp ranks, must count once."),
    (lambda got: _matches(got, _simulated(copies=(2, 4, 4))),
     "the norm counts every copy of every piece: both tp partners' and both dp ranks'. Count "
     "each element of the whole model's gradients once."),
    (lambda got: _matches(got, _simulated(clipped=False)),
     "these are the losses of a run that does not clip: step 1 matches (no update yet), then "
     "each step differs by what clipping to job.max_norm would have changed."),
    (lambda got: _matches(got, _simulated(gradient_scale=2.0)),
     "the gradients are twice the whole batch's: the two data-parallel halves' summed, where "
     "the batch's are their mean (a loss summed over dp, or an all_reduce without dividing). "
     "Clipping and AdamW all but cancel a factor, not quite: the last steps' losses are 1e-9 "
     "off."),
)


def _first_wrong(got: dict, expected: dict) -> int | None:
    """The first step whose loss differs (the steps in `expected`), or None."""
    return next((step for step in sorted(expected)
                 if _compare(got.get(step), expected[step], rel_tol=REL_TOL)), None)


def _whole_run_hint(losses, weights, expected_losses) -> str | None:
    if not isinstance(losses, dict) or set(losses) != set(expected_losses):
        return (f"a run's losses are {{step: loss}} for each step it trained, counted from 1: the "
                f"whole run trains steps 1 to {JOB.steps}.")
    for recognised, hint in WHOLE_RUN_MISTAKES:
        if recognised(losses):
            return f"{WHOLE.split(' (')[0]} differs from one process already: {hint}"
    step = _first_wrong(losses, expected_losses)
    if step == 1:
        return ("step 1's loss, computed before any update, already differs: is it the whole "
                "batch's next-token loss (reference.lm_loss), the mean of the two data-parallel "
                "halves', from job.batch(0)?")
    if step is not None:
        return (f"step 1's loss is right and step {step}'s differs: the update of step "
                f"{step - 1} differs from one process's. Are the gradients the whole batch's "
                "(the halves' averaged), clipped by the norm of every gradient of the whole "
                "model, each rank's pieces counted once, then an AdamW step "
                "(job.optimizer)?")
    return ("the losses are right but the weights are not: are they the weights after the last "
            "step, each whole (DTensor.full_tensor()) and named as in job.model()?")


def _resumed_hint(steps, losses, expected, kill_after) -> str | None:
    newest = _newest_checkpoint(kill_after)
    after = (f"the newest checkpoint was saved after step {newest} (rank 3 died loading step "
             f"{kill_after + 1}'s batch), so the resumed run trains steps {newest + 1} to "
             f"{JOB.steps}")
    if steps != expected[3]:
        first = steps[0] if steps else None
        if not steps:
            return f"the resumed run trained no step: {after}."
        if first == 1:
            if _matches(losses, _simulated()):
                return (f"the resumed run started again from step 1, from the first weights: "
                        f"did it find the newest checkpoint in `directory` and load it? {after}.")
            return (f"the resumed run counted from step 1 again, on weights that were already "
                    f"trained: {after}, on job.batch({newest}) first: the step to go on from "
                    f"is the checkpoint's.")
        if first == kill_after + 1 != newest + 1:
            return (f"the resumed run went on from step {first}, after the last step the killed "
                    f"run finished; but what that run did after its last checkpoint died with "
                    f"it: {after}.")
        if first == newest:
            return (f"the resumed run trained step {newest} again: the checkpoint of step "
                    f"{newest} holds the weights after that step's update; {after}.")
        if first == newest + 2:
            return (f"the resumed run skipped step {newest + 1}: {after}, step s on "
                    "job.batch(s - 1).")
        return f"the resumed run trained steps {steps[0]} to {steps[-1]}: {after}."
    if _compare(losses, expected[4], rel_tol=REL_TOL):
        if any(_matches(losses, _simulated(fresh_optimizer_after=newest, counted_from=count))
               for count in (0, 1)):
            return (f"these are the losses of a run that resumed step {newest}'s weights with a "
                    f"new AdamW (its moments zero): step {newest + 1} matches, then each "
                    "differs. The checkpoint must hold the optimizer's state too (its moments "
                    "and step count), saved and loaded with the model's.")
        step = _first_wrong(losses, expected[4])
        if step == newest + 1:
            return (f"the resumed run's first step, {step}, already differs, and the whole run's "
                    f"matched: its loss comes from the weights it loaded, before any update. "
                    f"Are they the weights after step {newest}, saved after its optimizer step?")
        return (f"the resumed run's first step matches and step {step} differs, while the whole "
                "run matched: what else does a step carry to the next? AdamW's state (its "
                "moments and step count) must be in the checkpoint, and loaded.")
    return ("the resumed run's losses are right but its weights are not: are they the weights "
            "after the last step, each whole (DTensor.full_tensor()), named as in job.model()?")


def _capstone_hint(got, expected, kill_after) -> str | None:
    """A hint for the first thing that differs: the whole run's (a mistake in every step,
    recognised by computing what it trains to in one process), then the resumed run's."""
    if not isinstance(got, tuple) or len(got) != len(expected):
        return None  # the harness's own message says what went wrong
    wrong = next((index for index, (one, want) in enumerate(zip(got, expected))
                  if _compare(one, want, rel_tol=REL_TOL)), None)
    if wrong in (0, 1):
        return _whole_run_hint(got[0], got[1], expected[0])
    if wrong == 2:
        return ("without recomputation a rank keeps as many bytes as one process keeps for half "
                "the batch, or more: that is data parallelism alone. Tensor parallelism must cut "
                "what the blocks keep too (lesson 08: each tp rank holds half of the heads and "
                "half of the MLP's hidden units).")
    if wrong in (3, 4, 5):
        return _resumed_hint(got[3], got[4], expected, kill_after)
    if wrong == 6:
        return ("with `recompute`, the blocks' activations must be recomputed in backward "
                "(torch.utils.checkpoint, lesson 11), so that autograd keeps less than the run "
                "without it.")
    return None


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
    "mesh. The checker first runs it whole without `recompute`, which must train as one "
    "process does (reference.train), loss for loss and weight for weight; then with "
    "`recompute`, killing rank 3 while it loads a batch (kill_after = k: step k + 1's; k = 4, "
    "then 6), and again in new processes on the same directory: that run must start after the "
    "newest checkpoint and end as one process does. It counts the bytes autograd keeps for "
    "backward on every rank, as they are saved (saved tensors hooks: a checkpointed region's "
    "are not seen)",
    KILL_CASES,
    _uninterrupted,
    distributed=False,
    harness=_interrupted,
    names=NAMES,
    rel_tol=REL_TOL,
    timeout=300,
    hint="each run is compared with one process: the whole run step by step, then the run "
         "resumed after the kill. The loss and the gradients are the whole batch's: each "
         "data-parallel half's, averaged. The gradients' global norm takes every rank's "
         "pieces, once each. A checkpoint holds the weights and AdamW's state, and the resumed "
         "run goes on from the step after it.",
    hint_for=_capstone_hint, points=3,
)


# --- one step of the recipe (design) ------------------------------------------------------------

# The recipe of helpers.capstone.train at a checker's size: 2 blocks of width 32 on the 2 x 2 mesh,
# 8 windows of 33 bytes a step (32 predictions each), 4 on each dp rank; 3 steps, the first two
# warming up
RECIPE = Config(layers=2, dim=32, heads=4, kv_heads=2, seq_len=32, batch=8, micro_batches=1,
                steps=3, warmup=2, lr=1e-2, recompute="none", bf16=False, float64=True,
                save_every=0, eval_every=0)
# (how a dp rank's 4 sequences are cut into micro-batches, the precision)
RECIPE_CASES = [((3, 1), "float64"), ((1, 2, 1), "float64"), ((2, 2), "bfloat16")]
# what each step must get right, the causes first: a wrong rate, reduction or precision shows in
# the losses too, and is named before them
RECIPE_NAMES = ("the learning rate each step ran at",
                "reduce-scatters a step (FSDP2's: once a unit, whatever the micro-batches)",
                "the logits each loss was taken on",
                "the whole batch's loss, by step", "the gradient norm before clipping, by step",
                "the weights at the end")
NOT_IN_BF16 = "not compared in bfloat16: no single process computes as FSDP2's policy does"
LOSS_FUNCTIONS = ("cross_entropy", "log_softmax", "nll_loss")
WIDE_ENOUGH = "float32 or wider"


class LossInputs(torch.overrides.TorchFunctionMode):
    """While active, records the dtype of the first argument of every cross_entropy,
    log_softmax and nll_loss called (torch.nn.functional's, torch's or a tensor's method)."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in LOSS_FUNCTIONS and args and hasattr(args[0], "dtype"):
            self.dtypes.add(str(args[0].dtype).replace("torch.", ""))
        return func(*args, **(kwargs or {}))


def _recipe_config(precision: str) -> Config:
    return replace(RECIPE, float64=precision == "float64", bf16=precision == "bfloat16")


def _recipe_worker(rank, world_size, function, sizes, precision):
    """The course's loop (train.train_worker) with the learner's step in place of its own, each
    step watched: the communication torch.distributed carries (instrument.Observer) and the
    dtypes the loss functions are given (LossInputs)."""
    config = _recipe_config(precision)
    mesh = make_mesh(config.plan)
    model = train.build(config, mesh)
    optimizer, scheduler = train.make_optimizer(model, config)
    corpus = python_source()
    found = {"loss": {}, "norm": {}, "lr": {}, "reduce_scatters": set(), "dtypes": set()}
    for step in range(1, config.steps + 1):
        batch = corpus.batch("train", step - 1, config.batch, config.seq_len, seed=config.seed)
        mine = batch.chunk(config.dp)[train.dp_rank(mesh)].to(get_device())
        found["lr"][step] = scheduler.get_last_lr()[0]
        with Observer() as observed, LossInputs() as seen:
            loss, norm = function(model, optimizer, scheduler, list(mine.split(sizes)), config)
        found["loss"][step] = mean_over(float(loss), train.dp_group(mesh))
        found["norm"][step] = float(norm)
        found["reduce_scatters"].add(observed.calls().get("reduce_scatter_single", 0))
        found["dtypes"] |= seen.dtypes
    if precision != "float64" and found["dtypes"] and found["dtypes"] <= {"float32", "float64"}:
        found["dtypes"] = {WIDE_ENOUGH}
    found["weights"] = train.whole_weights(model)
    return found


def _recipe_run(function, sizes, precision):
    try:
        found = run(_recipe_worker, WORLD, args=(function, sizes, precision), timeout=120,
                    show_output=False)[0]
    except WorkerError as error:
        if error.type_name == "NotImplementedError":
            raise NotImplementedError from None  # not started: the engine says so kindly
        raise
    scattered = found["reduce_scatters"]
    per_step = scattered.pop() if len(scattered) == 1 else f"one of {sorted(scattered)}"
    causes = (found["lr"], per_step, ", ".join(sorted(found["dtypes"])) or "none seen")
    if precision != "float64":
        return (*causes, NOT_IN_BF16, NOT_IN_BF16, NOT_IN_BF16)
    return (*causes, found["loss"], found["norm"], found["weights"])


@functools.cache
def _recipe_expected(sizes, precision):
    """One process (train.one_process, PyTorch's own clip_grad_norm_, LambdaLR and AdamW) on the
    whole batch; the learning rates from the schedule's formula; one reduce-scatter per FSDP2
    unit (each block, and the root's) a step; the loss on float32 logits, float64 in float64."""
    config = _recipe_config(precision)
    rates = {step: config.lr * train.lr_factor(config, step - 1)
             for step in range(1, config.steps + 1)}
    dtypes = "float64" if precision == "float64" else WIDE_ENOUGH
    causes = (rates, config.layers + 1, dtypes)
    if precision != "float64":
        return (*causes, NOT_IN_BF16, NOT_IN_BF16, NOT_IN_BF16)
    alone = train.one_process(config)
    return (*causes, alone.losses(), {step: record["norm"] for step, record in alone.steps.items()},
            alone.weights)


@functools.cache
def _first_loss(sizes, weighting: str) -> float:
    """Step 1's loss in one process, from the first weights, as a rank that weights its
    micro-batches' losses so computes it: "parts" (each micro-batch's mean alike, divided by
    their number), "sum" (the micro-batches' means added up)."""
    config = _recipe_config("float64")
    model = train.init_weights(train.Llama(config.shape, max_seq_len=config.seq_len).double(),
                               seed=config.seed)
    batch = python_source().batch("train", 0, config.batch, config.seq_len, seed=config.seed)
    per_rank = []
    with torch.no_grad():
        for mine in batch.chunk(config.dp):
            means = [train.next_token_loss(model, part).item() for part in mine.split(sizes)]
            per_rank.append(sum(means) / (len(means) if weighting == "parts" else 1))
    return sum(per_rank) / len(per_rank)


def _recipe_hint(got, expected, sizes, precision) -> str | None:
    if not isinstance(got, tuple) or len(got) != len(expected):
        return None
    rates, scattered, dtypes, losses, norms = got[:5]
    units, parts = expected[1], len(sizes)
    if isinstance(rates, dict) and rates != expected[0]:
        if len(set(rates.values())) == 1:
            return ("every step ran at the first step's rate: scheduler.step() once a step, "
                    "after optimizer.step(), moves the schedule on.")
        return ("the rate moved more than once a step: scheduler.step() once a step, not once "
                "a micro-batch.")
    if dtypes == "none seen":
        return ("no cross_entropy, log_softmax or nll_loss was called: take the loss with "
                "torch.nn.functional.cross_entropy, which the checker watches.")
    if precision == "float64" and "float32" in dtypes:
        return ("in a float64 run the logits are float64 already: take the loss on them as they "
                "are (.float() rounds them to float32); upcast bfloat16 logits only.")
    if dtypes != expected[2]:
        return ("the loss must be taken on logits of float32 at least: the model computes in "
                "bfloat16, whose 8 significant bits put a loss near 5.5 on a grid of 1/32. "
                "Upcast the logits first (.float()), as torchtitan does.")
    if scattered != units:
        if scattered == units * parts:
            return ("FSDP2 reduce-scattered after every micro-batch: set "
                    "model.set_requires_gradient_sync(False) before all but the last, so that "
                    "the gradients add up unsharded and cross the dp group once a step.")
        if scattered == 0:
            return ("nothing was reduce-scattered: the last micro-batch's backward must run "
                    "with model.set_requires_gradient_sync(True), or the dp ranks never share "
                    "their gradients.")
        return None
    if precision == "float64" and isinstance(losses, dict) and 1 in losses:
        for weighting, hint in (
                ("parts", "every micro-batch's mean counted alike, but they hold different "
                          "numbers of sequences: weight each by its share of the rank's "
                          "sequences (a micro-batch of 3 sequences weighs three times one of 1)."),
                ("sum", "the micro-batches' losses were added up: the step's loss (and its "
                        "gradient) is their mean, each weighted by its share of the sequences.")):
            if math.isclose(losses[1], _first_loss(sizes, weighting), rel_tol=1e-9):
                return hint
        if isinstance(norms, dict) and 1 in norms and math.isclose(
                norms[1], RECIPE.clip, rel_tol=1e-6):
            return ("the norm returned is the clipped one: return the norm before clipping "
                    "(what clip_to_norm and clip_grad_norm_ return).")
    return None


EXERCISES["recipe_step"] = Exercise(
    "recipe_step(model, optimizer, scheduler, parts, config) makes one step of the capstone's "
    "recipe on this rank's sequences and returns (loss, norm) as Python floats: the mean "
    "next-byte loss of this rank's sequences (the loop averages it over dp) and the global "
    "gradient norm before clipping. `parts` is a list of micro-batches, token tensors shaped as "
    "train.train_step's `tokens` (whole sequences of config.seq_len + 1 bytes), of unequal "
    "sizes. `model` is laid out as train.build lays it out (tensor parallelism over \"tp\", "
    "FSDP2 over \"dp\"; in bfloat16 or float64 as config says), `optimizer` and `scheduler` are "
    "train.make_optimizer's; train.next_token_loss, train.parallel_loss, train.whole and "
    "train.clip_to_norm are yours to use. What must hold: in float64, each step equals one "
    "process on the whole batch (train.one_process: the dp mean of your loss, and your norm, "
    "to a relative 1e-9; the weights at the end within 1e-5); the step runs at the rate the "
    "schedule gives it; FSDP2 reduce-scatters each unit once a step, whatever the number of "
    "micro-batches; the loss is taken on logits of float32 at least (bfloat16 ones upcast, "
    "float64 ones as they are). The checker runs the course's loop with your step in place of "
    "train.train_step, on 4 ranks, 3 steps, and watches each step's communication and the "
    "dtype given to the loss functions (cross_entropy, log_softmax, nll_loss)",
    RECIPE_CASES,
    _recipe_expected,
    distributed=False,
    harness=_recipe_run,
    names=RECIPE_NAMES,
    rel_tol=REL_TOL,
    timeout=120,
    hint="each step is the whole batch's: the micro-batches' losses weighted by their share of "
         "the sequences, the gradients reduced over dp once, clipped by the global norm, then "
         "the optimizer's step and the schedule's.",
    hint_for=_recipe_hint, points=3,
)


# --- the torchrun entry point (design) ----------------------------------------------------------

# A float64 run of 6 steps on the 2 x 2 mesh, no checkpoint but the one a stop makes
ENTRY = replace(RECIPE, steps=6, save_every=0)
# (the rank the signal lands on, the step it ends when it does, the signal)
ENTRY_CASES = [(1, 2, "SIGTERM"), (3, 4, "SIGINT")]
ENTRY_NAMES = ("how the signalled run ended", "the step each rank stopped after",
               "the step of the newest checkpoint", "how the run started again ended",
               "the step the run started again resumed after",
               "its losses, by step", "its weights at the end")
ENTRY_TIMEOUT = 90  # seconds for one torchrun: about 15 on a 2-core laptop


def _ended(job) -> str:
    """How a torchrun job ended, in a few words: its exit code, then which ranks exited how
    (the agent's lines, with the signal's name), then the first exception a worker printed."""
    from helpers.checkpoints_and_failures.elastic import agent_story

    if job.returncode == 0:
        return "exit code 0"
    exits = []
    for _, what in agent_story(job):
        code = re.fullmatch(r"rank \d+ exited with (-?\d+)", what)
        if code:
            number = -int(code.group(1))
            exits.append(f"{what} ({signal.Signals(number).name})" if number in
                         signal.valid_signals() else what)
    # a worker's exception, as its traceback's last line says it: "ValueError: ..."
    errors = [text for text in (line.split("]:", 1)[-1].strip() for _, line in job.agent)
              if re.match(r"[\w.]*(Error|Exception|Interrupt)\b(:|$)", text)
              and "ChildFailedError" not in text]
    # the first: the rank that failed first says why; the others then lose their connections
    return "; ".join([f"exit code {job.returncode}", *exits, *errors[:1]])


def _torchrun(function, job):
    """One torchrun of 4 ranks, each running function(job) (helpers.capstone.entry): the Job,
    or a sentence if it did not end in time."""
    from helpers.capstone.entry import PAYLOAD
    from helpers.checkpoints_and_failures.elastic import FINAL_FILE, run_torchrun

    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(job.directory, FINAL_FILE))
    with open(os.path.join(job.directory, PAYLOAD), "wb") as payload:
        cloudpickle.dump((function, job), payload)
    try:
        ran = run_torchrun("helpers.capstone.entry", [job.directory], job.directory,
                           nproc=WORLD, max_restarts=0, timeout=ENTRY_TIMEOUT)
    except TimeoutError:
        which = "the signalled run" if job.signal_rank is not None else "the run started again"
        return (f"{which} did not end within {ENTRY_TIMEOUT} s and was killed: some rank "
                f"waited for the others: {_last_events(job.directory)}")
    if any("NotImplementedError" in line for _, line in ran.agent):
        raise NotImplementedError  # not started: the engine says so kindly
    return ran


LAST_EVENT = {"started": "had started after step", "step": "had ended step",
              "saved": "had saved step", "returned": "had returned after step"}


def _last_events(directory) -> str:
    """Each rank's last event (its events.rank<r>.jsonl): "rank 0 had ended step 3, rank 1 had
    saved step 2"."""
    found = []
    for rank in range(WORLD):
        path = os.path.join(directory, f"events.rank{rank}.jsonl")
        lines = pathlib.Path(path).read_text().splitlines() if os.path.exists(path) else []
        event = json.loads(lines[-1]) if lines else None
        what = LAST_EVENT.get(event["event"], event["event"]) if event else "had not started"
        found.append(f"rank {rank} {what}" + (f" {event['step']}" if event else ""))
    return ", ".join(found)


def _stopped_after(job) -> list:
    """The last step each rank trained, from its events ([] if none trained)."""
    last = {}
    for event in job.events:
        if event["event"] == "step":
            last[event["rank"]] = max(event["step"], last.get(event["rank"], 0))
    return sorted(set(last.values()))


def _entry_run(function, rank, after, signal_name):
    """The learner's entry point under torchrun, twice in one directory: rank `rank` signalled
    as it ends step `after`, then started again with no signal. Returns how each run ended, the
    steps the ranks stopped after, the newest checkpoint's step, and the second run's first
    step, losses and weights."""
    from helpers.capstone.entry import StopJob
    from helpers.checkpoints_and_failures.resume import latest_checkpoint

    with tempfile.TemporaryDirectory(prefix="helpers-entry-") as directory:
        job = StopJob(ENTRY, directory, rank, after, getattr(signal, signal_name))
        signalled = _torchrun(function, job)
        if isinstance(signalled, str):
            return signalled
        first = (_ended(signalled), _stopped_after(signalled), latest_checkpoint(directory)[1])
        again = _torchrun(function, replace(job, signal_rank=None))
        if isinstance(again, str):
            return again
        history = again.result
        if history is None:
            return (*first, _ended(again), "no History: the run started again did not finish",
                    None, None)
        return (*first, _ended(again), history.started_after, history.losses(),
                history.weights)


@functools.cache
def _entry_expected(rank, after, signal_name):
    """Every rank stops after step `after`, its checkpoint the newest; the run started again
    goes on from there and trains as one process does (train.one_process)."""
    alone = train.one_process(ENTRY)
    losses = {step: loss for step, loss in alone.losses().items() if step > after}
    return ("exit code 0", [after], after, "exit code 0", after, losses, alone.weights)


def _entry_hint(got, expected, rank, after, signal_name) -> str | None:
    if isinstance(got, str):
        if "did not end" in got:
            return ("when one rank stops and the others go on, the stopping rank's checkpoint "
                    "(a collective) and the others' next step wait for each other: every rank "
                    "must answer stop(step) alike. An all_reduce of the flag (MAX) makes one "
                    "answer of every rank's.")
        return None
    if not isinstance(got, tuple) or len(got) != len(expected):
        return None
    ended, stopped = got[0], got[1]
    if ended != "exit code 0":
        if f"rank {rank} exited with -{getattr(signal, signal_name).value}" not in ended:
            return None
        if signal_name == "SIGINT":
            return (f"Python turns SIGINT into KeyboardInterrupt, which ended rank {rank} in "
                    "the middle of its work: handle SIGINT as SIGTERM, with a flag.")
        return (f"{signal_name} ended rank {rank} at once: by default it ends a process. "
                "Install a handler (signal.signal) that only raises a flag, before training "
                "starts.")
    if stopped != expected[1]:
        if stopped == [ENTRY.steps]:
            return ("the run went on to the end: stop(step) must return True once a signal "
                    "has come, to any rank.")
        return None
    if got[2] != expected[2]:
        return ("no checkpoint was made where the run stopped: job.train saves one when "
                "stop(step) returns True.")
    if got[3] != "exit code 0":
        return ("the signalled run ended well, the one started after it did not: do the "
                "handlers, the flag or the exit depend on a signal having come?")
    return None


EXERCISES["entry_point"] = Exercise(
    "entry_point(job) is what each of 4 ranks runs under torchrun (torchrun has set RANK, "
    "WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which init_process_group() reads): it joins the "
    "process group, makes its signal handlers, trains with job.train(stop), and leaves as "
    "job.main does. job.train asks stop(step) after every step; True makes it save a checkpoint "
    "and return; it resumes from the newest checkpoint by itself. What must hold: a SIGTERM or "
    "a SIGINT that lands on one rank alone, mid-run, stops every rank after the same step, the "
    "one that rank was ending, with a checkpoint of it; every rank exits with code 0, the "
    "signalled run and the run started again; the run started again resumes after that step "
    "and ends as one process trains (train.one_process: its losses to a relative 1e-9, its "
    "weights within 1e-5). The checker runs torchrun twice in one directory: first with rank r "
    "sent the signal as it ends step s (after the update, before stop(s) is asked), then with "
    "no signal",
    ENTRY_CASES,
    _entry_expected,
    distributed=False,
    harness=_entry_run,
    names=ENTRY_NAMES,
    rel_tol=REL_TOL,
    timeout=2 * ENTRY_TIMEOUT,
    hint="a signal must not end a rank: it raises a flag; after every step the ranks agree "
         "whether any flag is up, and all stop together.",
    hint_for=_entry_hint, points=3,
)

# --- one norm over two mesh dimensions ----------------------------------------------------------

NORM_CASES = [(4, (0,)), (4, (1,)), (8, (2,))]  # (world size, (seed,)): dp 2 or 4, tp 2
TP = 2

# name -> (the whole gradient's shape, its placements on the mesh ("dp", "tp")). Shard(0) over dp
# is FSDP's; over tp a row layer's weight is cut by columns (Shard(1)) and a column layer's by
# rows (Shard(0)), while a row layer's bias is whole on both tp partners; one layer is kept whole
# on every dp rank (as DDP keeps it), the final norm's weight on every rank. The names do not
# say which: a block's bias is replicated over tp, and a block's weight over dp.
NORM_LAYOUT = {
    "token_embedding.weight": ((16, 4), (Shard(0), Replicate())),
    "blocks.0.attention.out.weight": ((8, 6), (Shard(0), Shard(1))),
    "blocks.0.attention.out.bias": ((8,), (Shard(0), Replicate())),
    "blocks.0.feed_forward.up.weight": ((8, 6), (Replicate(), Shard(0))),
    "norm.weight": ((8,), (Replicate(), Replicate())),
    "head.weight": ((8, 16), (Shard(0), Replicate())),
}


def _gradients(seed: int) -> dict:
    """A model's whole gradients, float32, laid out as NORM_LAYOUT says."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator)
            for name, (shape, _) in NORM_LAYOUT.items()}


def _local(whole: torch.Tensor, placements, coordinate, mesh_shape) -> torch.Tensor:
    """What the rank at `coordinate` holds of `whole`: cut dimension by dimension of the mesh, as
    DTensor cuts it (Shard(d): the coordinate's equal chunk along d; Replicate(): all of it)."""
    local = whole
    for placement, where, size in zip(placements, coordinate, mesh_shape):
        if placement.is_shard():
            local = local.chunk(size, dim=placement.dim)[where]
    return local


def _norm_inputs(seed, mesh, device):
    """This rank's pieces: {name: a DTensor on `mesh`}, made from the whole gradients that every
    rank draws alike, without communication."""
    from torch.distributed.tensor import DTensor

    coordinate = mesh.get_coordinate()
    return {name: DTensor.from_local(
        _local(whole, NORM_LAYOUT[name][1], coordinate, mesh.shape).to(device), mesh,
        NORM_LAYOUT[name][1], run_check=False, shape=whole.shape, stride=whole.stride())
        for name, whole in _gradients(seed).items()}


def _norm_expected(rank, world_size, seed):
    return math.sqrt(sum(float(whole.double().pow(2).sum()) for whole in _gradients(seed).values()))


@dataclass
class MeshExercise(Exercise):
    """The ranks' inputs are DTensors on a ("dp", "tp") mesh of world_size // 2 x 2, which each
    rank builds (layouts.make_mesh, on the launcher's device) before the learner's function is
    watched: the mesh's groups are the checker's, not the learner's communication."""

    def worker(self, function, log_dir: str):
        task_rules = self.rules

        def build_then_call(rank, world_size, seed):
            from helpers.launcher.result import get_device
            from helpers.layouts import Plan

            device = get_device()
            mesh = make_mesh(Plan(dp=world_size // TP, tp=TP))  # ("dp", "tp")
            pieces = _norm_inputs(seed, mesh, device)
            with CallRecorder(task_rules, rules_module.log_path(log_dir, rank), function):
                return function(rank, world_size, pieces)

        return build_then_call


def _counted(world_size, seed, counts) -> float:
    """The norm a rule of counting gives: every rank's pieces that `counts(name, placements,
    coordinate)` takes, their squares summed over the mesh (float64), the square root."""
    mesh_shape = (world_size // TP, TP)
    total = 0.0
    for coordinate in ((dp, tp) for dp in range(mesh_shape[0]) for tp in range(TP)):
        for name, whole in _gradients(seed).items():
            placements = NORM_LAYOUT[name][1]
            if counts(name, placements, coordinate):
                local = _local(whole, placements, coordinate, mesh_shape)
                total += float(local.double().pow(2).sum())
    return math.sqrt(total)


def _first_along(dimensions):
    """A rule that counts a piece on the rank at coordinate 0 of each of `dimensions` (0: dp,
    1: tp) along which the piece is replicated."""
    return lambda name, placements, coordinate: all(
        coordinate[dim] == 0 for dim in dimensions if placements[dim].is_replicate())


# (a rule of counting a typical mistake follows, its hint)
NORM_MISTAKES = (
    (lambda name, placements, coordinate: True,
     "each piece counts once, however many ranks hold it: a piece whose placement along a mesh "
     "dimension is Replicate() is the same on every rank along it. Count it on one of them (at "
     "coordinate 0 there: piece.device_mesh.get_coordinate())."),
    (lambda name, placements, coordinate: name.startswith("blocks.") or coordinate[1] == 0,
     "a name does not say how a piece is laid out: blocks.0.attention.out.bias is a block's, "
     "yet both tp partners hold it whole, and a block's weight can be whole on every dp rank. "
     "Read each piece's placements."),
    (_first_along((1,)),
     "a piece can be replicated over dp too (Replicate() on \"dp\": a layer kept whole on every "
     "data-parallel rank, as DDP keeps it): count it at dp coordinate 0 as well."),
    (_first_along((0,)),
     "a piece both tp partners hold (Replicate() on \"tp\") counts twice: count it at tp "
     "coordinate 0 only."),
    (lambda name, placements, coordinate: (
        not any(placement.is_replicate() for placement in placements)
        or any(coordinate[dim] == 0 for dim in (0, 1) if placements[dim].is_replicate())),
     "a piece replicated over both dimensions is held by every rank: it counts on one rank, at "
     "coordinate 0 of both (all of its replicated dimensions, not any)."),
)


def _norm_hint(got, expected, world_size, seed) -> str | None:
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return None
    for counts, hint in NORM_MISTAKES:
        if math.isclose(got, _counted(world_size, seed, counts), rel_tol=1e-4):
            return hint
    if math.isclose(got, expected ** 2, rel_tol=1e-4):
        return "this is the sum of the squares: the norm is its square root."
    if math.isclose(got, expected / math.sqrt(world_size), rel_tol=1e-4):
        return ("this is the norm of the sum of squares averaged over the ranks: the pieces' "
                "squares add up (all_reduce's default, ReduceOp.SUM).")
    return None


EXERCISES["global_norm"] = MeshExercise(
    "global_norm(rank, world_size, pieces) returns, on every rank, the global norm of a "
    "model's whole gradients, as a Python float, from the pieces each rank of a dp x tp mesh "
    "holds (tp = 2): `pieces` maps a name to this rank's piece of one gradient, a DTensor on the "
    "2-D device mesh (\"dp\", \"tp\") whose placements say, dimension by dimension, whether the "
    "gradient is cut along it (Shard(dim): every rank along it holds a piece of its own) or "
    "held whole by every rank along it (Replicate(): the same piece on each). The names do not "
    "say which. Every element of the whole gradients counts once: piece.to_local() is what this "
    "rank holds, piece.placements how, piece.device_mesh.get_coordinate() where. It uses one "
    "dist.all_reduce, of one number, and no other communication (no DTensor reduction either): "
    "the two mesh dimensions as one, which is what DTensor's \"2 sequential all_reduce\" "
    "warning asks for",
    NORM_CASES, _norm_expected,
    rules=(Only("all_reduce", text="use one all_reduce and no other communication"),
           CallSizes("all_reduce", lambda n, seed: [1],
                     text="one dist.all_reduce, of one number, on what the ranks hold "
                          "(.to_local()); a DTensor's own reductions, full_tensor() and "
                          "redistribute() communicate by themselves, which this task rules "
                          "out")),
    hint="does each piece count once? Its placements say which ranks hold the same piece.",
    hint_for=_norm_hint,
)
