"""Lesson 08's comparisons, in the kernel: the dense module in one process, and how far each
rank's results are from it."""

from __future__ import annotations

import copy

from helpers import reference
from helpers.tensor_parallelism.megatron import sequence_shard, shard_of_gradient
from helpers.tolerance import agree, relative_verdict


def dense(module, inputs, targets):
    """One process: the output, the input's gradient and every parameter's gradient (by name)
    of the mean squared error, on a copy of `module`."""
    module, inputs = copy.deepcopy(module), inputs.clone().requires_grad_()
    outputs = module(inputs)
    reference.mse_loss(outputs, targets).backward()
    return (outputs.detach(), inputs.grad,
            {name: param.grad for name, param in module.named_parameters()})


def rank_views(expected, rank: int, world_size: int, sequence_parallel: bool = False):
    """What rank `rank` should hold of `dense`'s results: the output and input gradient (its
    tokens, with sequence parallelism) and each gradient's slice (shard_of_gradient)."""
    output, input_grad, grads = expected
    if sequence_parallel:
        output, input_grad = (sequence_shard(t, rank, world_size) for t in (output, input_grad))
    return output, input_grad, {name: shard_of_gradient(name, grad, rank, world_size)
                                for name, grad in grads.items()}


def pairs(results: list, expected, sequence_parallel: bool = False) -> list:
    """(got, expected) for every rank's output, input gradient and gradient slices, against
    what each rank should hold of `expected` (rank_views)."""
    found = []
    for rank, got in enumerate(results):
        output, input_grad, grads = rank_views(expected, rank, len(results), sequence_parallel)
        found += [(got["output"], output), (got["input_grad"], input_grad)]
        found += [(got["grads"][name], grad) for name, grad in grads.items()]
    return found


def agreement(results: list, expected, terms: int, sequence_parallel: bool = False) -> str:
    """Whether the output, the input's gradient and every gradient slice of every rank equal one
    process's, each within float32 rounding of sums of at most `terms` terms scaled to its own
    size (helpers.tolerance): "output, input gradient, parameter gradients within 256 ε of
    each tensor's largest magnitude: True"."""
    ok = agree(pairs(results, expected, sequence_parallel), terms)
    return f"output, input gradient, parameter gradients {relative_verdict(ok, terms)}"
