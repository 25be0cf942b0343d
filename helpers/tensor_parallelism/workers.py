"""Lesson 08's workers: the hand-built tensor-parallel MLP and block, forward and backward, with
and without sequence parallelism; PyTorch's parallelize_module on the same block; the bytes each
collective sends; the activations kept; and how much of a step is communication.

Every worker gets the dense module (the same on every rank), the whole input and the targets;
with sequence parallelism each rank feeds its own tokens. The loss is the mean squared error
over the whole output, so a rank with 1/t of the tokens adds 1/t of it: the ranks' losses sum to
the dense loss, and backward gives the dense gradients.
"""

from __future__ import annotations

import copy
import statistics

import torch.distributed as dist

from helpers import reference
from helpers.instrument import Observer, saved_activations, saved_bytes
from helpers.launcher.result import get_device
from helpers.tensor_parallelism.megatron import (
    parallelize_block,
    parallelize_feed_forward,
    sequence_shard,
    torch_plan,
)


def _local(tensor, rank, world_size, sequence_parallel):
    return sequence_shard(tensor, rank, world_size) if sequence_parallel else tensor


def _squared_error(outputs, targets, total: int):
    """This rank's part of the mean squared error over `total` elements."""
    return (outputs - targets).square().sum() / total


def forward_backward(module, inputs, targets, total):
    """Forward and backward of `module` on `inputs`, counting what each sends and what forward
    keeps for backward. Returns a dict of the output, the input's gradient, every parameter's
    gradient (by name), the activation bytes kept, and per pass the bytes sent and the calls
    made by collective."""
    inputs = inputs.clone().requires_grad_()
    with Observer() as observed:
        with observed.span("forward"), saved_activations(module) as saved:
            outputs = module(inputs)
        with observed.span("backward"):
            _squared_error(outputs, targets, total).backward()
    passes = ("forward", "backward")
    return {"output": outputs.detach(), "input_grad": inputs.grad,
            "grads": {name: param.grad for name, param in module.named_parameters()},
            "activation_bytes": saved_bytes(saved),
            "sent": {span: observed.sent(span) for span in passes},
            "calls": {span: observed.calls(span) for span in passes}}


def mlp_worker(rank, world_size, feed_forward, inputs, targets):
    """The paper's MLP (parallelize_feed_forward) on the whole input."""
    return forward_backward(parallelize_feed_forward(feed_forward), inputs, targets,
                            targets.numel())


def block_worker(rank, world_size, block, inputs, targets, sequence_parallel=False):
    """The hand-built tensor-parallel block (parallelize_block)."""
    parallel = parallelize_block(block, sequence_parallel=sequence_parallel)
    return forward_backward(parallel, _local(inputs, rank, world_size, sequence_parallel),
                            _local(targets, rank, world_size, sequence_parallel),
                            targets.numel())


def torch_block_worker(rank, world_size, block, inputs, targets, sequence_parallel=False):
    """The same block through PyTorch's parallelize_module on a 1-D DeviceMesh, which the lesson
    builds with init_device_mesh itself (from lesson 10 on, layouts.make_mesh does). Returns what
    block_worker does (no counts), each gradient as this rank's piece, and each gradient's
    DTensor placements. A gradient left as Partial (a sum not yet taken: the LayerNorms' with
    sequence parallelism) is summed first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    device = get_device()  # the launcher's: a GPU of this rank's under NCCL, else the CPU
    mesh = init_device_mesh(device.type, (world_size,))
    module = parallelize_module(copy.deepcopy(block).to(device), mesh,
                                torch_plan(sequence_parallel))
    local_inputs = _local(inputs, rank, world_size, sequence_parallel).to(device).clone()
    local_inputs.requires_grad_()
    outputs = module(local_inputs)
    _squared_error(outputs, _local(targets, rank, world_size, sequence_parallel).to(device),
                   targets.numel()).backward()
    grads, placements = {}, {}
    for name, param in module.named_parameters():
        grad = param.grad
        placements[name] = tuple(map(repr, grad.placements)) if isinstance(grad, DTensor) else ()
        if isinstance(grad, DTensor):
            if any(isinstance(place, Partial) for place in grad.placements):
                grad = grad.redistribute(placements=[Replicate()])
            grad = grad.to_local()
        grads[name] = grad.cpu()
    return {"output": outputs.detach().cpu(), "input_grad": local_inputs.grad.cpu(),
            "grads": grads, "placements": placements}


def communication_share_worker(rank, world_size, dim, heads, batch, seq_len, iterations):
    """Forward and backward of a tensor-parallel Block of width `dim`, `iterations` times after a
    warm-up; each step starts after a barrier. Returns the median step seconds and the median
    seconds spent inside collectives (gloo's are synchronous), on this rank."""
    block = parallelize_block(reference.make_block(dim, heads))
    inputs = reference.seeded_randn(1, batch, seq_len, dim)
    steps, communication = [], []
    for _ in range(iterations + 1):
        dist.barrier()
        with Observer() as observed, observed.span("step"):
            block(inputs).square().mean().backward()
        step = observed.spans[-1]
        steps.append(step.end - step.start)
        communication.append(sum(observed.seconds().values()))
    return statistics.median(steps[1:]), statistics.median(communication[1:])
