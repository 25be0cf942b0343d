"""Lesson 09's exercises, checked by `helpers.exercises.check(name, your_function)`.

The pipeline cases: rank r holds one layer, x -> GeLU(x W_r) with W_r (d x d) drawn from a seed;
rank 0 holds the batch, cut into m micro-batches of equal size; the loss is the mean square of
the last rank's outputs over the whole batch. The expected results come from the same layers in
one process, with autograd, here in the kernel.
"""

import torch.nn.functional as F

from helpers.exercises import Exercise
from helpers.pipeline_parallelism.schedule import schedule_order
from helpers.reference import seeded_randn
from helpers.rules import POINT_TO_POINT, Only, SendsTo

PIPELINE_CASES = [(2, (0, 4, 2, 3)), (3, (1, 6, 3, 4)), (4, (2, 8, 2, 5)), (4, (3, 4, 4, 2))]
# (seed, batch, micro-batches m, width d)


def _weights(seed, world_size, width):
    return [seeded_randn(seed * 100 + r, width, width) / width ** 0.5 for r in range(world_size)]


def _batch(seed, batch, width):
    return seeded_randn(seed * 100 + 99, batch, width)


def _inputs(rank, world_size, seed, batch, m, width):
    micro_batches = list(_batch(seed, batch, width).chunk(m)) if rank == 0 else None
    return _weights(seed, world_size, width)[rank], micro_batches, m, (batch // m, width)


def _dense(world_size, seed, batch, m, width):
    """The last outputs of every micro-batch, and every layer's gradient."""
    weights = [w.clone().requires_grad_() for w in _weights(seed, world_size, width)]
    x = _batch(seed, batch, width)
    for weight in weights:
        x = F.gelu(x @ weight)
    x.square().mean().backward()
    return list(x.detach().chunk(m)), [w.grad for w in weights]


def _forward_expected(rank, world_size, seed, batch, m, width):
    return _dense(world_size, seed, batch, m, width)[0] if rank == world_size - 1 else None


def _backward_expected(rank, world_size, seed, batch, m, width):
    return _dense(world_size, seed, batch, m, width)[1][rank]


ORDER_CASES = [(0, 4, 8), (3, 4, 8), (1, 4, 8), (0, 4, 2), (2, 4, 2), (0, 2, 1), (1, 3, 5),
               (0, 1, 3)]


def _one_f_one_b_sends(rank, world_size, seed, batch, m, width):
    """Where a rank's sends go, in 1F1B's order: each F sends forward, each B back."""
    peers = []
    for kind, _ in schedule_order("1f1b", rank, world_size, m):
        if kind == "F" and rank < world_size - 1:
            peers.append(rank + 1)
        elif kind == "B" and rank > 0:
            peers.append(rank - 1)
    return peers


ONE_F_ONE_B_CASES = PIPELINE_CASES + [(4, (4, 12, 6, 3)), (3, (5, 10, 5, 2))]


EXERCISES = {
    "one_f_one_b_order": Exercise(
        "return the order in which rank `rank` of `num_stages` runs its forwards and backwards "
        "under 1F1B, as a list of ('F', i) and ('B', i): p - rank - 1 forwards to fill the "
        "pipeline (but never more than the m micro-batches), then one forward and one backward "
        "in turn while forwards remain, then the remaining backwards; micro-batches in order",
        ORDER_CASES,
        lambda rank, p, m: schedule_order("1f1b", rank, p, m),
        distributed=False),
    "pipeline_forward": Exercise(
        "the lecture's pipeline forward, micro-batch by micro-batch: you hold `weight`, your "
        "layer's W (x -> GeLU(x W)), `num_micro_batches` and `shape`, every micro-batch's shape "
        "(your activations have the same); rank 0 also gets `micro_batches`, the list of them "
        "(the others get None and receive each from rank - 1); each rank "
        "computes its layer and sends the result to rank + 1; the last rank returns the list "
        "of its outputs, one per micro-batch, and the others return None",
        PIPELINE_CASES, _forward_expected,
        inputs=lambda rank, n, *case: _inputs(rank, n, *case),
        rules=(Only(*POINT_TO_POINT, text="use point-to-point calls only (no collectives)"),
               SendsTo(lambda rank, n, seed, batch, m, width: [rank + 1] * m if rank < n - 1
                       else [],
                       text="each rank but the last sends each micro-batch's activations to "
                            "rank + 1, once",
                       who="the pipeline"))),
    "pipeline_backward": Exercise(
        "the homework the lecture leaves: the same forward, keeping what each micro-batch's "
        "backward needs, then the backward of the loss, the mean square of the last rank's "
        "outputs over the whole batch (so each micro-batch's mean over m): micro-batch by "
        "micro-batch, the last rank starts from its loss, every other rank receives the "
        "gradient of its outputs from rank + 1, and every rank but the first sends the "
        "gradient of its inputs to rank - 1; return the gradient of your `weight`",
        PIPELINE_CASES, _backward_expected,
        inputs=lambda rank, n, *case: _inputs(rank, n, *case),
        rules=(Only(*POINT_TO_POINT, text="use point-to-point calls only (no collectives)"),
               SendsTo(lambda rank, n, seed, batch, m, width:
                       ([rank + 1] * m if rank < n - 1 else [])
                       + ([rank - 1] * m if rank > 0 else []),
                       text="each rank sends each micro-batch's activations forward once (all "
                            "forwards first), then each gradient back once",
                       who="the pipeline"))),
    "one_f_one_b_step": Exercise(
        "the same forward and backward, in 1F1B's order instead of GPipe's: rank r runs "
        "min(p - r - 1, m) forwards, then one forward and one backward in turn while forwards "
        "remain, then the remaining backwards (the order one_f_one_b_order returns); a forward "
        "of micro-batch i receives from rank - 1 and sends to rank + 1, a backward of i "
        "receives its outputs' gradient from rank + 1 (the last rank starts from its loss) and "
        "sends its inputs' gradient to rank - 1; return the gradient of your `weight`. In the "
        "steady phase neighbours send to each other at the same moment: a send that waits for "
        "its receive can deadlock, so send with isend and wait for it later",
        ONE_F_ONE_B_CASES, _backward_expected,
        inputs=lambda rank, n, *case: _inputs(rank, n, *case),
        timeout=20,
        rules=(Only(*POINT_TO_POINT, text="use point-to-point calls only (no collectives)"),
               SendsTo(_one_f_one_b_sends,
                       text="send in 1F1B's order: each forward's activations to rank + 1, "
                            "each backward's gradient to rank - 1",
                       who="1F1B")), points=2),
}


def _order(rank, world_size, m, kind):
    """A rank's order: GPipe's, 1F1B's, or every forward and then the backwards, oldest first on
    an even rank and newest first on an odd one ("opposite"): each rank then receives its
    outputs' gradients in another order than it takes them, which only a step that matches each
    message to its micro-batch gets right."""
    if kind == "opposite":
        backwards = range(m) if rank % 2 == 0 else reversed(range(m))
        return [("F", i) for i in range(m)] + [("B", i) for i in backwards]
    return schedule_order(kind, rank, world_size, m)


def _order_sends(rank, world_size, seed, batch, m, width, kind):
    return [rank + 1 if step == "F" else rank - 1 for step, _ in _order(rank, world_size, m, kind)
            if (step == "F" and rank < world_size - 1) or (step == "B" and rank > 0)]


EXERCISES["pipeline_by_order"] = Exercise(
    "a pipeline step that runs any schedule: you get what one_f_one_b_step got and `order`, "
    "this rank's list of ('F', i) and ('B', i) (GPipe's, 1F1B's, or another order in which "
    "every forward of a micro-batch comes before its backward on every rank; neighbours may "
    "take their backwards in different orders). Run your layer's forwards and backwards in "
    "that order and return the gradient of your `weight`, equal to one process's; the step "
    "must finish for each order given, and each activation goes once to rank + 1, each "
    "gradient once to rank - 1",
    [(2, (0, 4, 2, 3, "gpipe")), (3, (1, 6, 3, 4, "1f1b")), (4, (2, 8, 4, 5, "1f1b")),
     (3, (5, 6, 3, 2, "opposite"))],
    lambda rank, n, seed, batch, m, width, kind: _backward_expected(rank, n, seed, batch, m,
                                                                     width),
    inputs=lambda rank, n, seed, batch, m, width, kind: (
        *_inputs(rank, n, seed, batch, m, width), _order(rank, n, m, kind)),
    timeout=20,
    rules=(Only(*POINT_TO_POINT, text="use point-to-point calls only (no collectives)"),
           SendsTo(_order_sends, text="each activation once to rank + 1 and each gradient once "
                                      "to rank - 1, in your order", who="the order")), points=3)
