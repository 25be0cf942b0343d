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
import time

import torch.distributed as dist

from helpers import reference
from helpers.tensor_parallelism.megatron import (
    parallelize_block,
    parallelize_feed_forward,
    sequence_shard,
)
from helpers.tensor_parallelism.memory import saved_activations, saved_bytes
from helpers.zero_and_fsdp.sharding import CommCounter


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
    with CommCounter() as forward, saved_activations(module) as saved:
        outputs = module(inputs)
    with CommCounter() as backward:
        _squared_error(outputs, targets, total).backward()
    return {"output": outputs.detach(), "input_grad": inputs.grad,
            "grads": {name: param.grad for name, param in module.named_parameters()},
            "activation_bytes": saved_bytes(saved),
            "sent": {"forward": forward.sent, "backward": backward.sent},
            "calls": {"forward": forward.calls, "backward": backward.calls}}


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


def torch_plan(sequence_parallel: bool) -> dict:
    """PyTorch's plan for the course's Block, as the tensor-parallel tutorial writes one for a
    Llama block: q, k, v and up column-wise, out and down row-wise; with sequence parallelism the
    LayerNorms run on each rank's tokens, and attention and the MLP gather them first."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    output = Shard(1) if sequence_parallel else Replicate()
    plan = {"attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(),
            "attention.v": ColwiseParallel(), "attention.out": RowwiseParallel(
                output_layouts=output),
            "feed_forward.up": ColwiseParallel(),
            "feed_forward.down": RowwiseParallel(output_layouts=output)}
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),),
                                    desired_input_layouts=(Replicate(),))
        plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel(),
                 "attention": gather, "feed_forward": gather}
    return plan


def torch_block_worker(rank, world_size, block, inputs, targets, sequence_parallel=False):
    """The same block through PyTorch's parallelize_module on a 1-D DeviceMesh. Returns what
    block_worker does (no counts), each gradient as this rank's piece, and each gradient's
    DTensor placements. A gradient left as Partial (a sum not yet taken: the LayerNorms' with
    sequence parallelism) is summed first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    module = parallelize_module(copy.deepcopy(block), mesh, torch_plan(sequence_parallel))
    local_inputs = _local(inputs, rank, world_size, sequence_parallel).clone().requires_grad_()
    outputs = module(local_inputs)
    _squared_error(outputs, _local(targets, rank, world_size, sequence_parallel),
                   targets.numel()).backward()
    grads, placements = {}, {}
    for name, param in module.named_parameters():
        grad = param.grad
        placements[name] = tuple(map(repr, grad.placements)) if isinstance(grad, DTensor) else ()
        if isinstance(grad, DTensor):
            if any(isinstance(place, Partial) for place in grad.placements):
                grad = grad.redistribute(placements=[Replicate()])
            grad = grad.to_local()
        grads[name] = grad
    return {"output": outputs.detach(), "input_grad": local_inputs.grad, "grads": grads,
            "placements": placements}


def _timing_collectives(seconds: list):
    """Patches torch.distributed's three collectives to add each call's seconds to `seconds`."""
    saved = {}
    for name in ("all_reduce", "all_gather_single", "reduce_scatter_single"):
        original = saved[name] = getattr(dist, name)

        def timed(*args, original=original, **kwargs):
            started = time.perf_counter()
            result = original(*args, **kwargs)
            seconds.append(time.perf_counter() - started)
            return result

        setattr(dist, name, timed)
    return saved


def communication_share_worker(rank, world_size, dim, heads, batch, seq_len, iterations):
    """Forward and backward of a tensor-parallel Block of width `dim`, `iterations` times after a
    warm-up; each step starts after a barrier. Returns the median step seconds and the median
    seconds spent inside collectives (gloo's are synchronous), on this rank."""
    block = parallelize_block(reference.make_block(dim, heads))
    inputs = reference.seeded_randn(1, batch, seq_len, dim)
    steps, communication = [], []
    for _ in range(iterations + 1):
        seconds = []
        saved = _timing_collectives(seconds)
        dist.barrier()
        started = time.perf_counter()
        block(inputs).square().mean().backward()
        steps.append(time.perf_counter() - started)
        for name, original in saved.items():
            setattr(dist, name, original)
        communication.append(sum(seconds))
    return statistics.median(steps[1:]), statistics.median(communication[1:])
