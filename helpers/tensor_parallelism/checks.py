"""Lesson 08's comparisons, in the kernel: the dense module in one process, and how far each
rank's results are from it."""

from __future__ import annotations

import copy

from helpers import reference
from helpers.tensor_parallelism.megatron import sequence_shard, shard_of_gradient
from helpers.tolerance import float32_bound, within


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


def largest_differences(results: list, expected, sequence_parallel: bool = False) -> dict:
    """The largest difference, over the ranks' `results` (each a dict with 'output',
    'input_grad' and 'grads'), from what each should hold of `expected`: a dict with the keys
    'output', 'input gradient' and 'parameter gradients'."""
    worst = dict.fromkeys(("output", "input gradient", "parameter gradients"), 0.0)
    for rank, got in enumerate(results):
        output, input_grad, grads = rank_views(expected, rank, len(results), sequence_parallel)
        worst["output"] = max(worst["output"], (got["output"] - output).abs().max().item())
        worst["input gradient"] = max(worst["input gradient"],
                                      (got["input_grad"] - input_grad).abs().max().item())
        worst["parameter gradients"] = max([worst["parameter gradients"]] + [
            (got["grads"][name] - grad).abs().max().item() for name, grad in grads.items()])
    return worst


def agreement(results: list, expected, terms: int, sequence_parallel: bool = False) -> str:
    """Whether the output, the input's gradient and every gradient slice equal one process's
    within float32 rounding of sums of at most `terms` unit-sized terms (helpers.tolerance):
    "output, input gradient, parameter gradients within 3.1e-05: True"."""
    worst = largest_differences(results, expected, sequence_parallel)
    return f"{', '.join(worst)} {within(max(worst.values()), float32_bound(terms))}"
