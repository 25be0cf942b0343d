"""Lesson 13's exercises, checked by `helpers.exercises.check(name, your_function)`."""

from __future__ import annotations

import reprlib

import torch

from helpers.at_scale import fits as fits_module
from helpers.exercises import Exercise
from helpers.launcher import run
from helpers.launcher.report import WorkerError
from helpers.layouts import Plan
from helpers.llama import Llama, Shape

EXERCISES = {}

# --- the fastest layout a GPU can hold (design) -------------------------------------------------

GiB = 2**30
QUESTIONS = {"8 GPUs": fits_module.QUESTION, "16 GPUs": fits_module.QUESTION_16}
# (question, memory per GPU in GiB): an H100's 80 GiB (ml-engineering's "80GiB H100-SXM", lesson
# 10), and other sizes (no particular models), which the task does not list: at 54 GiB the
# lesson's recipe would reserve too much by 0.8 GiB, at 24 no layout of its question can be held.
# The second question (two hosts) is in no cell.
CASES = [("8 GPUs", 80), ("8 GPUs", 54), ("8 GPUs", 24), ("16 GPUs", 60), ("16 GPUs", 40)]
NO_LAYOUT = "raised ValueError"
_RAISED = {}  # (question, memory_gib) -> the message the learner's function raised, for a hint


def held(verdict) -> bool:
    """Whether a GPU holds the layout: what it would reserve for the fake peak (fits.reserved)
    within its memory."""
    return fits_module.reserved(verdict.peak) <= verdict.memory


def best_in_sweep(memory_gib: float, question: str = "8 GPUs"):
    """The Verdict of the committed sweep's fastest layout that a GPU of `memory_gib` holds, or
    None."""
    holding = [verdict for verdict in fits_module.sweep_verdicts(memory_gib, QUESTIONS[question])
               if held(verdict)]
    return max(holding, key=lambda verdict: verdict.step.tokens_per_second, default=None)


def _expected_plan(question, memory_gib):
    if best_in_sweep(memory_gib, question) is None:
        return NO_LAYOUT, "-", "-"
    return "a Plan of the question", "yes", "yes"


def _judge(function, question, memory_gib):
    """Judge the learner's plan by the committed sweep's fake run of it (every layout of the
    question is one of the sweep's; the tests run some again), against the sweep's best."""
    from helpers.composing.strategy import MODELS

    asked = QUESTIONS[question]
    layouts = fits_module.candidates(asked["gpus"], asked["sequences"], asked["seq_len"])
    _RAISED.pop((question, memory_gib), None)
    try:
        plan = function(MODELS[asked["model"]], asked["gpus"], memory_gib * GiB,
                        asked["sequences"], asked["seq_len"])
    except ValueError as error:
        _RAISED[question, memory_gib] = f"ValueError: {error}"
        return NO_LAYOUT, "-", "-"
    except Exception as error:  # noqa: BLE001 - another error, where none fits, is named
        if best_in_sweep(memory_gib, question) is None:
            _RAISED[question, memory_gib] = f"{type(error).__name__}: {error}"
            return f"raised {type(error).__name__}", "-", "-"
        raise
    if not isinstance(plan, Plan):
        return (f"your function returned {type(plan).__name__}; the task asks for a Plan",
                "-", "-")
    if plan not in layouts:
        return (f"{plan} is not a layout of the question (fits.candidates(gpus, sequences, "
                f"seq_len) lists them): {asked['gpus']} GPUs = dp x tp with tp a power of two "
                f"up to 8, {asked['sequences']} sequences of {asked['seq_len']} tokens a step "
                "(dp x micro_batch of them), in bfloat16, no replicas", "-", "-")
    (verdict,) = [verdict for verdict in fits_module.sweep_verdicts(memory_gib, asked)
                  if verdict.plan == plan]  # (every candidate is one: tests/test_at_scale.py)
    holds = ("yes" if held(verdict) else
             f"no: its fake peak, {verdict.peak / GiB:.1f} GiB, would reserve "
             f"{fits_module.reserved(verdict.peak) / GiB:.1f} GiB, more than {memory_gib}")
    best = best_in_sweep(memory_gib, question)
    speed = verdict.step.tokens_per_second
    fastest = ("yes" if best is None or speed >= best.step.tokens_per_second * (1 - 1e-9) else
               f"no: {speed:,.0f} tokens/s a GPU, where another layout that a GPU holds runs "
               f"{best.step.tokens_per_second:,.0f}")
    return "a Plan of the question", holds, fastest


def _plan_hint(got, expected, question, memory_gib):
    if not isinstance(got, tuple) or not isinstance(got[0], str):
        return None
    if got[0].startswith("your function returned Verdict"):
        return "a Verdict's .plan is the Plan it judged"
    raised = _RAISED.get((question, memory_gib))
    said = f" (your function raised {reprlib.repr(raised)})" if raised else ""
    if expected[0] == NO_LAYOUT and got[0] != NO_LAYOUT:
        return (f"on GPUs of {memory_gib} GiB, can any layout of the question be held? The task "
                f"asks for a ValueError when none can{said}")
    if got[0] == NO_LAYOUT:
        return (f"a layout of the question can be held on GPUs of {memory_gib} GiB: which did "
                f"your search leave out, or what raised{said}?")
    if got[1].startswith("no"):
        return ("a fake peak counts the tensors a step holds; what more did the published GPUs "
                "reserve, and does your plan leave room for it?")
    return None


EXERCISES["choose_plan"] = Exercise(
    "choose_plan(shape, gpus, memory, sequences, seq_len) returns the Plan (helpers."
    "layouts.Plan) that trains a Llama of `shape` fastest on `gpus` GPUs of `memory` bytes "
    "each, `sequences` sequences of `seq_len` tokens a step in bfloat16, among the layouts "
    "fits.candidates(gpus, sequences, seq_len) lists that a GPU can hold. Held: what a GPU "
    "would reserve for its peak on fake ranks, by the published runs (fits.reserved(peak)), is "
    "within `memory`. Fastest: the most tokens per second by the lesson's step-time estimate "
    "(a fits.Verdict's .step). Where no layout can be held, it raises ValueError. The checker "
    "asks about Llama 3 8B with 8 sequences of 8192 tokens on 8 GPUs, and with 16 on 16, each "
    "on GPUs of several memories, and judges your plan by its own sweeps' fake run of every "
    "layout",
    CASES,
    _expected_plan,
    distributed=False,
    harness=_judge,
    timeout=600,
    names=("the plan", "a GPU holds it", "the fastest that one holds"),
    hint_for=_plan_hint,
    hint="a Verdict of fits() has the step's estimated time as well as its peak: which choices "
         "make a step slower is for the estimate to say.",
    points=3,
)


# --- built on the meta device, the same weights as one process ----------------------------------

SHAPES = {"2 blocks": Shape(layers=2, dim=64, heads=4, kv_heads=2, ffn=192, vocab=256),
          "3 blocks, uneven shards": Shape(layers=3, dim=48, heads=4, kv_heads=2, ffn=144,
                                           vocab=250)}
WORLD_SIZES = (2, 3)


def _rank_view(rank, world_size, function, shape):
    """In each rank: the learner's model, and how it was built and laid out."""
    from torch.distributed.tensor import DTensor

    from helpers import llama

    built_on, allocated = [], []
    original, to_empty, init = Llama.__init__, torch.nn.Module.to_empty, llama.init_weights

    def recording(self, *args, **kwargs):
        built_on.append(torch.empty(0).device.type)  # the default device where it is made
        original(self, *args, **kwargs)

    def allocating(self, *args, **kwargs):  # what to_empty gives memory to: pieces, or wholes
        if isinstance(self, Llama):
            whole = [name for name, p in self.named_parameters() if not isinstance(p, DTensor)]
            allocated.append("this rank's pieces" if not whole else "the whole model"
                             if len(whole) == len(list(self.parameters())) else
                             f"pieces, but {', '.join(whole)} whole")
        return to_empty(self, *args, **kwargs)

    def initialising(model, *args, **kwargs):  # on the meta device, a copy_ writes nothing
        if any(p.is_meta for p in model.parameters()):
            allocated.append(f"nothing yet when init_weights ran ({WROTE_NOTHING})")
        return init(model, *args, **kwargs)

    # init_weights as the module has it, and as the learner's cell may have imported it
    scope = getattr(function, "__globals__", {})
    names = [name for name, value in scope.items() if value is init]
    Llama.__init__, torch.nn.Module.to_empty = recording, allocating
    llama.init_weights = initialising
    scope.update(dict.fromkeys(names, initialising))
    try:
        model = function(rank, world_size, shape)
    finally:
        Llama.__init__, torch.nn.Module.to_empty = original, to_empty
        llama.init_weights = init
        scope.update(dict.fromkeys(names, init))
    parameters = dict(model.named_parameters())
    sharded = all(isinstance(p, DTensor) and p.device_mesh.size() == world_size
                  for p in parameters.values())
    full = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            for name, p in parameters.items()}
    return built_on, allocated, sharded, full


def _meta_built(function, case):
    """The learner's function on every rank: where it built the model, whether every weight is
    FSDP's DTensor over all ranks, and the weights gathered whole (rank 0's)."""
    world_size = WORLD_SIZES[list(SHAPES).index(case)]
    try:
        results = run(_rank_view, world_size, args=(function, SHAPES[case]), timeout=60,
                      show_output=False)
    except WorkerError as error:
        if error.type_name == "NotImplementedError":
            raise NotImplementedError from None  # not started: the engine says so kindly
        raise
    built_on, allocated, sharded, full = results[0]
    where = ("the meta device" if built_on and all(d == "meta" for d in built_on)
             else f"{', '.join(sorted(set(built_on))) or 'no Llama(...)'}")
    return where, ", ".join(allocated) or "to_empty was not called", sharded, full


def _one_process(case):
    from helpers.llama import init_weights

    model = init_weights(Llama(SHAPES[case]))
    return ("the meta device", "this rank's pieces", True,
            {name: p.detach() for name, p in model.named_parameters()})


WROTE_NOTHING = "it wrote nothing: the weights were on the meta device"


def _meta_hint(got, expected, case):
    if not isinstance(got, tuple) or len(got) != 4 or not isinstance(got[3], dict):
        return None
    if WROTE_NOTHING in str(got[1]):
        return ("a weight on the meta device has no memory to write its value to, and to_empty "
                "then gives it memory that holds whatever was there. In which order must the "
                "two come?")
    if "pieces, but" in str(got[1]):
        return ("fully_shard(module) shards the parameters of `module` that no inner fully_shard "
                "took: which module holds the ones left whole?")
    if got[0] != expected[0] or got[1] != expected[1]:
        return ("where is memory allocated for the weights, and for how much of them? A rank "
                "should only ever hold its own pieces")
    weights = got[3]
    norm = weights.get("norm.weight")
    if norm is not None and not torch.equal(norm, torch.ones_like(norm)):
        return ("the final norm's weight is not all ones, as init_weights makes it: were the "
                "weights given their values after to_empty, which leaves whatever its memory "
                "held?")
    weight = weights.get("output.weight")
    world_size = WORLD_SIZES[list(SHAPES).index(case)]
    if weight is not None and weight.shape[0] % world_size == 0:
        pieces = weight.chunk(world_size)
        if all(piece.equal(pieces[0]) for piece in pieces[1:]):
            return ("every rank's piece of output.weight is the same: each rank drew its piece "
                    "as if it were the first. Which values belong to rank r's rows?")
    return None


EXERCISES["meta_built"] = Exercise(
    "meta_built(rank, world_size, shape) returns a Llama of `shape` (helpers.llama.Llama) laid out "
    "by FSDP2 over all the ranks (each parameter a DTensor on a mesh of world_size), which no rank "
    "ever held whole: made on the meta device, its memory allocated only for this rank's pieces. "
    "Its weights, gathered, must equal those of init_weights(Llama(shape)) (helpers."
    "llama) made in one process, exactly",
    [(case,) for case in SHAPES],
    _one_process,
    distributed=False,
    harness=_meta_built,
    names=("where Llama(...) was made", "what to_empty allocated",
           "every weight sharded over all ranks", "the weights, gathered"),
    hint_for=_meta_hint,
    hint="which of the model's values does a rank need to draw, and from which generator, for "
         "its pieces to be pieces of the one-process model?",
)
