"""Lesson 13's exercises, checked by `helpers.exercises.check(name, your_function)`."""

from __future__ import annotations

from helpers.at_scale import fits as fits_module
from helpers.at_scale.accounting import Plan
from helpers.exercises import Exercise
from helpers.launcher import run
from helpers.launcher.report import WorkerError
from helpers.llama import Llama, Shape

EXERCISES = {}

# --- a layout that fits, sending the least (design) ---------------------------------------------

GiB = 2**30
SPARE = 0.10  # the share of the memory a layout must leave free at its peak
# (memory per GPU in GiB,): an H100's 80 GiB (ml-engineering's "80GiB H100-SXM", lesson 10), and
# 48 GiB, a smaller GPU (no particular model: GPUs sold as "48 GB" hold 44.7 GiB), for the
# lesson's question (fits.QUESTION)
MEMORIES = [(80,), (48,)]


def best_in_sweep(memory_gib: float) -> tuple:
    """(plan, peak, sent) of the committed sweep's layout that leaves SPARE of the memory free and
    sends the fewest bytes (on a tie, the least memory)."""
    rows = fits_module.load_sweep()
    fitting = [row for row in rows if row[1] <= (1 - SPARE) * memory_gib * GiB]
    return min(fitting, key=lambda row: (row[2], row[1]))


def _judge(function, memory_gib):
    """Run the learner's plan on fake ranks and judge it against the best of the sweep."""
    from helpers.composing.strategy import MODELS

    question = fits_module.QUESTION
    plan = function(MODELS[question["model"]], question["gpus"], memory_gib * GiB,
                    question["sequences"], question["seq_len"])
    if not isinstance(plan, Plan):
        return (f"your function returned {type(plan).__name__}; the task asks for a Plan",
                "-", "-")
    if plan not in fits_module.candidates():
        return (f"{plan} is not a layout of the question (fits.candidates() lists them): "
                f"{question['gpus']} GPUs = dp x tp with tp a power of two up to 8, "
                f"{question['sequences']} sequences of {question['seq_len']} tokens a step "
                "(dp x micro_batch of them), in bfloat16, no replicas", "-", "-")
    verdict = fits_module.fits(MODELS[question["model"]], plan, memory_gib * GiB)
    _, best_peak, best_sent = best_in_sweep(memory_gib)
    spare = ("yes" if verdict.spare >= SPARE else
             f"no: {verdict}; at least {SPARE:.0%} must stay free")
    fewest = ("yes" if verdict.sent <= best_sent else
              f"no: it sends {verdict.sent / GiB:.2f} GiB a step where another layout sends "
              f"{best_sent / GiB:.2f} GiB and leaves {1 - best_peak / (memory_gib * GiB):.0%} "
              "free")
    return "a Plan of the question", spare, fewest


EXERCISES["choose_plan"] = Exercise(
    "choose_plan(shape, gpus, memory, sequences, seq_len) returns a Plan (helpers.at_scale."
    "accounting.Plan) for training a Llama of `shape` on `gpus` GPUs of `memory` bytes each, "
    "`sequences` sequences of `seq_len` tokens a step in bfloat16 (Plan's bf16=True; "
    "dp x micro_batch = sequences, one micro-batch a step; the layouts fits.candidates() lists): "
    f"one whose peak, measured on fake ranks, leaves at least {SPARE:.0%} of the memory free, "
    "and which sends no more bytes a step than any other of those layouts that does. The "
    "checker runs your plan on fake ranks, for Llama 3 8B "
    "with 8 sequences of 8192 tokens on 8 GPUs of 80 and of 48 GiB, and compares it with the "
    "best layout its own sweep of them found",
    MEMORIES,
    lambda memory_gib: ("a Plan of the question", "yes", "yes"),
    distributed=False,
    harness=_judge,
    timeout=600,
    names=("the plan", "fits with 10% to spare", "sends no more than the best"),
    hint="fits() says what a layout sends as well as its peak (a Verdict's .sent and .peak): "
         "which choices change the bytes on the wire is for the runs to say. A fake step of a "
         "block or two takes a second or so.",
)


# --- built on the meta device, the same weights as one process ----------------------------------

SHAPES = {"2 blocks": Shape(layers=2, dim=64, heads=4, kv_heads=2, ffn=192, vocab=256),
          "3 blocks, uneven shards": Shape(layers=3, dim=48, heads=4, kv_heads=2, ffn=144,
                                           vocab=250)}
WORLD_SIZES = (2, 3)


def _rank_view(rank, world_size, function, shape):
    """In each rank: the learner's model, and how it was built and laid out."""
    import torch
    from torch.distributed.tensor import DTensor

    built_on, allocated = [], []
    original, to_empty = Llama.__init__, torch.nn.Module.to_empty

    def recording(self, *args, **kwargs):
        built_on.append(torch.empty(0).device.type)  # the default device where it is made
        original(self, *args, **kwargs)

    def allocating(self, *args, **kwargs):  # what to_empty gives memory to: pieces, or wholes
        if isinstance(self, Llama):
            allocated.append("this rank's pieces" if all(
                isinstance(p, DTensor) for p in self.parameters()) else "the whole model")
        return to_empty(self, *args, **kwargs)

    Llama.__init__, torch.nn.Module.to_empty = recording, allocating
    try:
        model = function(rank, world_size, shape)
    finally:
        Llama.__init__, torch.nn.Module.to_empty = original, to_empty
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
    from helpers.at_scale.meta_init import init_weights

    model = init_weights(Llama(SHAPES[case]))
    return ("the meta device", "this rank's pieces", True,
            {name: p.detach() for name, p in model.named_parameters()})


def _meta_hint(got, expected, case):
    if not isinstance(got, tuple) or len(got) != 4 or not isinstance(got[3], dict):
        return None
    if got[0] != expected[0] or got[1] != expected[1]:
        return ("where is memory allocated for the weights, and for how much of them? A rank "
                "should only ever hold its own pieces")
    weights = got[3]
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
    "Its weights, gathered, must equal those of init_weights(Llama(shape)) (helpers.at_scale."
    "meta_init) made in one process, exactly",
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
