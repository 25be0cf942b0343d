"""Lesson 07's exercises, checked by `helpers.exercises.check(name, your_function)`."""

import math

import torch

from helpers.exercises import Exercise
from helpers.reference import seeded_randn
from helpers.rules import CallSizes, Only
from helpers.zero_and_fsdp.memory import BYTES_PER_PARAMETER, PARTS, SHARDED_FROM
from helpers.zero_and_fsdp.sharding import shard_of

SHAPES = [(5, 3), (7,), (4, 4), (1,)]  # 15, 7, 16 and 1 elements: most do not divide


def _padded(numel, world_size):
    return math.ceil(numel / world_size) * world_size


def _bytes_per_rank(sizes, world_size, stage):
    """Mixed-precision bytes per element; a sharded part holds ceil(numel / n) of each tensor."""
    per = BYTES_PER_PARAMETER["mixed"]
    held = {}
    for part in PARTS:
        sharded = stage >= SHARDED_FROM[part]
        elements = sum(math.ceil(numel / world_size) if sharded else numel for numel in sizes)
        held[part] = per[part] * elements
    return held


def _layer(seed, shapes):
    return [seeded_randn(seed + index, *shape) for index, shape in enumerate(shapes)]


def _layer_piece(rank, world_size, seed, shapes):
    flat = torch.cat([tensor.flatten() for tensor in _layer(seed, shapes)])
    return shard_of(flat, rank, world_size)


def _parameters(seed):
    return [seeded_randn(seed + index, *shape) for index, shape in enumerate(SHAPES)]


def _gradients(rank, seed):
    return [seeded_randn(1000 * (rank + 1) + seed + index, *shape)
            for index, shape in enumerate(SHAPES)]


def _sgd_step(world_size, seed, lr):
    averaged = [sum(_gradients(r, seed)[i] for r in range(world_size)) / world_size
                for i in range(len(SHAPES))]
    return [param - lr * grad for param, grad in zip(_parameters(seed), averaged)]


def _linear_case(rank, seed, shape, batch):
    """This rank's inputs x (batch x in) and output gradient (batch x out)."""
    out_features, in_features = shape
    return (seeded_randn(seed + 100 * (rank + 1), batch, in_features),
            seeded_randn(seed + 100 * (rank + 1) + 50, batch, out_features))


def _linear_expected(rank, world_size, seed, shape, batch):
    weight = seeded_randn(seed, *shape)
    x, grad_output = _linear_case(rank, seed, shape, batch)
    grad_weight = sum(g.T @ xs for xs, g in (_linear_case(r, seed, shape, batch)
                                             for r in range(world_size))) / world_size
    return x @ weight.T, grad_output @ weight, shard_of(grad_weight, rank, world_size)


STEP_RULES = (
    Only("reduce_scatter_single", "all_gather_single",
         text="use only reduce_scatter_single and all_gather_single (no all_reduce)"),
    CallSizes("reduce_scatter_single",  # (a call's logged size is its first tensor's: the piece)
              lambda n, seed, lr: [_padded(math.prod(shape), n) // n for shape in SHAPES],
              text="one reduce_scatter_single per parameter, into a piece of ceil(numel / n) "
                   "elements"),
    CallSizes("all_gather_single",
              lambda n, seed, lr: [_padded(math.prod(shape), n) for shape in SHAPES],
              text="one all_gather_single per parameter, into a buffer of its padded size"),
)

EXERCISES = {
    "zero_bytes_per_rank": Exercise(
        "given `sizes`, the number of elements of each of a model's tensors, the number of "
        "ranks and the ZeRO stage (0 for plain data parallelism, then 1, 2, 3), return the "
        "model-state bytes one rank holds in the ZeRO paper's mixed-precision accounting, as "
        "{'weights': ..., 'gradients': ..., 'optimizer': ...}: 2, 2 and 12 bytes per element; a "
        "part that the stage shards (optimizer from stage 1, gradients from 2, weights from 3) "
        "holds, of each tensor, a piece of ceil(numel / n) elements, padding included",
        [([1000, 10], 4, 0), ([1000, 10], 4, 1), ([1000, 10], 4, 2), ([1000, 10], 4, 3),
         ([7, 5, 3], 3, 3), ([7, 5, 3], 1, 3), ([6, 1], 8, 2), ([12], 5, 1)],
        _bytes_per_rank,
        distributed=False),
    "gather_layer": Exercise(
        "you get `piece`, your rank's piece of a layer whose tensors (their shapes in `shapes`, "
        "e.g. a weight and a bias) were flattened, concatenated, zero-padded to a multiple of "
        "the world size and cut into equal pieces; return the layer's tensors, a list in their "
        "shapes, with one all_gather_single",
        [(2, (0, [(5, 3), (5,)])), (3, (1, [(4, 4), (4,)])), (4, (2, [(3, 2)])),
         (4, (3, [(1,)])), (3, (4, [(2, 2, 2), (3,), (1, 1)]))],
        lambda rank, n, seed, shapes: _layer(seed, shapes),
        inputs=lambda rank, n, seed, shapes: (_layer_piece(rank, n, seed, shapes), shapes),
        rules=(Only("all_gather_single", text="use one all_gather_single"),
               CallSizes("all_gather_single", lambda n, seed, shapes: [
                   _padded(sum(math.prod(shape) for shape in shapes), n)],
                   text="one all_gather_single of the layer's padded size"))),
    "sharded_sgd_step": Exercise(
        "you get `params`, a list of tensors of different shapes (the same on every rank), "
        "`grads`, this rank's gradients of them, and `lr`; take one SGD step of the gradients' "
        "average the ZeRO way: for each parameter, reduce_scatter_single its flattened "
        "gradient, padded with zeros to a multiple of the world size, with ReduceOp.AVG, so "
        "that you receive the average of your piece only; update your piece of the parameter "
        "(param - lr * grad); then all_gather_single every rank's updated piece and return the "
        "list of whole parameters, in their shapes",
        [(2, (0, 0.1)), (3, (1, 0.5)), (4, (2, 0.01)), (5, (3, 1.0))],
        lambda rank, n, seed, lr: _sgd_step(n, seed, lr),
        inputs=lambda rank, n, seed, lr: (_parameters(seed), _gradients(rank, seed), lr),
        rules=STEP_RULES),
    "zero3_linear": Exercise(
        "ZeRO-3's Linear (no bias), forward and backward by hand: you get `piece`, your rank's "
        "piece of the weight W (flattened, zero-padded, cut in n), its `shape` (out, in), your "
        "inputs `x` (batch x in) and the gradient of your outputs `grad_output` (batch x out); "
        "all-gather W, compute y = x W^T, and free W, as FSDP does after a forward; then, for "
        "the backward, all-gather W again, compute grad_x = grad_output W, and reduce-scatter "
        "the weight's gradient grad_output^T x (ReduceOp.AVG) so that you keep your piece of "
        "its average over the ranks; return (y, grad_x, your piece of the weight's gradient)",
        [(2, (0, (5, 3), 4)), (3, (1, (7, 4), 2)), (4, (2, (6, 6), 3)), (2, (3, (1, 5), 1))],
        _linear_expected,
        inputs=lambda rank, n, seed, shape, batch: (
            shard_of(seeded_randn(seed, *shape), rank, n), shape,
            *_linear_case(rank, seed, shape, batch)),
        rules=(Only("all_gather_single", "reduce_scatter_single",
                    text="use only all_gather_single and reduce_scatter_single"),
               CallSizes("all_gather_single", lambda n, seed, shape, batch: [
                   _padded(math.prod(shape), n)] * 2,
                   text="gather the weight twice, for the forward and again for the backward"),
               CallSizes("reduce_scatter_single", lambda n, seed, shape, batch: [
                   _padded(math.prod(shape), n) // n],
                   text="one reduce_scatter_single of the weight's gradient into your piece")),
        names=("y", "grad_x", "your piece of the weight's gradient"), points=2),
}


def _clip_case(seed, max_norm):
    """The whole gradients of a model of SHAPES, scaled so that max_norm sometimes clips them and
    sometimes does not."""
    return [grad * (seed + 1) for grad in _layer(seed, SHAPES)], max_norm


def _clip_expected(rank, world_size, seed, max_norm):
    """torch.nn.utils.clip_grad_norm_ on the whole gradients, in one process; this rank's pieces."""
    grads, _ = _clip_case(seed, max_norm)
    params = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [shard_of(param.grad, rank, world_size) for param in params]


EXERCISES["clip_sharded_gradients"] = Exercise(
    "clipping by the global norm when no rank holds a whole gradient: you get `pieces`, your "
    "rank's piece of each of a model's gradients (each flattened, zero-padded and cut into one "
    "piece per rank, as this lesson shards them), and `max_norm`. Return your pieces after "
    "clipping, equal to your pieces of what torch.nn.utils.clip_grad_norm_(parameters, "
    "max_norm) leaves in the whole gradients. Communicate as little as it takes: one "
    "all_reduce of a single number",
    [(2, (0, 1.0)), (3, (1, 100.0)), (4, (2, 2.5))],
    _clip_expected,
    inputs=lambda rank, n, seed, max_norm: (
        [shard_of(grad, rank, n) for grad in _clip_case(seed, max_norm)[0]], max_norm),
    rules=(Only("all_reduce", text="communicate with all_reduce only"),
           CallSizes("all_reduce", lambda n, seed, max_norm: [1],
                     text="one all_reduce of a single number")), points=3)
