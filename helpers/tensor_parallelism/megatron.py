"""Tensor parallelism the Megatron-LM way, by hand, and sequence parallelism on top of it.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019), §3; Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), §4.2.2. Lesson 08, notebooks/08_tensor_parallelism.ipynb.

An MLP Y = GeLU(X A), Z = Y B is split over t ranks without communicating in the middle: A by
columns (rank r computes its own columns of Y, and GeLU works element by element) and B by rows
(rank r multiplies its columns of Y by its rows of B, giving a partial Z that the ranks sum).
In nn.Linear's terms, whose weight is (out, in): ColumnParallelLinear keeps rows of the weight
(output features), RowParallelLinear keeps its columns (input features).

Two conjugate operators carry the communication, each an autograd Function (the paper's names):
    f   forward: identity           backward: all-reduce    (where a parallel region begins)
    g   forward: all-reduce         backward: identity      (where it ends)
Every rank feeds the same X into the region; its gradient there is the sum of every rank's part,
hence f's all-reduce in backward. A block of attention and MLP has one f and one g around each:
two all-reduces forward, two backward.

Sequence parallelism shards the rest (LayerNorms, residual adds) along the sequence: rank r keeps
tokens r of every sequence there. g becomes a reduce-scatter along the sequence (each rank keeps
the sum of its own tokens) and f an all-gather (every rank needs every token in the region); in
backward each is the other. Same bytes as the all-reduce, which is a reduce-scatter followed by
an all-gather; but the LayerNorms now see 1/t of the tokens each, so their gradients, and the
gradients of the biases added after the reduce-scatter, are partial sums: `parallelize_block`
all-reduces them in backward.

Activations are (batch, sequence, hidden); all_gather_single and reduce_scatter_single work on
dimension 0, so the sequence functions move it there and back (Megatron keeps activations as
(sequence, batch, hidden) to save those copies).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_gather_sequence(x, group):
    """(b, s/t, h) on each rank -> (b, s, h): every rank's tokens, in rank order."""
    pieces = x.transpose(0, 1).contiguous()
    gathered = pieces.new_empty(pieces.shape[0] * dist.get_world_size(group), *pieces.shape[1:])
    dist.all_gather_single(gathered, pieces, group=group)
    return gathered.transpose(0, 1).contiguous()


def reduce_scatter_sequence(x, group):
    """(b, s, h) partial sums on each rank -> (b, s/t, h): the sum of this rank's tokens."""
    world_size = dist.get_world_size(group)
    if x.shape[1] % world_size:
        raise ValueError(f"a sequence of {x.shape[1]} tokens does not split over "
                         f"{world_size} ranks")
    whole = x.transpose(0, 1).contiguous()
    piece = whole.new_empty(whole.shape[0] // world_size, *whole.shape[1:])
    dist.reduce_scatter_single(piece, whole, group=group)
    return piece.transpose(0, 1).contiguous()


class GatherSequence(torch.autograd.Function):
    """f with sequence parallelism: all-gather along the sequence forward, reduce-scatter back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class ScatterSequence(torch.autograd.Function):
    """g with sequence parallelism: reduce-scatter along the sequence forward, all-gather back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


def f(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f: `x` unchanged; in backward, its gradient summed over the group's ranks."""
    return CopyToRegion.apply(x, group)


def g(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g: `x` summed over the group's ranks; in backward, its gradient unchanged."""
    return ReduceFromRegion.apply(x, group)


def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence parallelism's f: every rank's tokens (dimension 1); reduce-scatter in backward."""
    return GatherSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence parallelism's g: this rank's tokens of the sum; all-gather in backward."""
    return ScatterSequence.apply(x, group)


def sequence_shard(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s tokens of `x` (batch, sequence, ...): a contiguous slice of dimension 1."""
    if x.shape[1] % world_size:
        raise ValueError(f"a sequence of {x.shape[1]} tokens does not split over "
                         f"{world_size} ranks")
    size = x.shape[1] // world_size
    return x[:, rank * size:(rank + 1) * size]


def my_slice(size: int, group) -> slice:
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if size % world_size:
        raise ValueError(f"{size} features do not split over {world_size} ranks")
    part = size // world_size
    return slice(rank * part, (rank + 1) * part)


def parameter_copy(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach().clone())


class ColumnParallelLinear(nn.Module):
    """This rank's output features of `linear` (the same full nn.Linear on every rank): its rows
    of the weight and its slice of the bias. Its output is this rank's slice of the features.
    `copy_input`: begin a parallel region with f; give False when f (or gather_sequence) is
    applied once before several of them, as for attention's q, k and v."""

    def __init__(self, linear: nn.Linear, group=None, copy_input: bool = True):
        super().__init__()
        rows = my_slice(linear.out_features, group)
        self.weight = parameter_copy(linear.weight[rows])
        self.bias = parameter_copy(linear.bias[rows]) if linear.bias is not None else None
        self.group, self.copy_input = group, copy_input

    def forward(self, x):
        if self.copy_input:
            x = f(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's input features of `linear`: its columns of the weight, and the whole bias. It
    takes this rank's slice of the features, and ends the region: the partial products are summed
    with g (with `sequence_parallel`, reduce-scattered along the sequence), then the bias added."""

    def __init__(self, linear: nn.Linear, group=None, sequence_parallel: bool = False):
        super().__init__()
        columns = my_slice(linear.in_features, group)
        self.weight = parameter_copy(linear.weight[:, columns])
        self.bias = parameter_copy(linear.bias) if linear.bias is not None else None
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        partial = F.linear(x, self.weight)
        y = scatter_sequence(partial, self.group) if self.sequence_parallel else g(partial,
                                                                                 self.group)
        return y if self.bias is None else y + self.bias


# The course's Block cut for tensor parallelism, once: each Linear by its name in the Block, and
# how it is cut. "column": ColumnParallelLinear (its output features split), "row":
# RowParallelLinear (its input features split). The hand-built layers, the gradient slices and
# PyTorch's plan (torch_plan) all follow it.
BLOCK_PLAN = {"attention.q": "column", "attention.k": "column", "attention.v": "column",
              "attention.out": "row", "feed_forward.up": "column", "feed_forward.down": "row"}


def plan_style(layer: str) -> str | None:
    """"column", "row" or None (not cut) for a layer named as in a Block (`attention.q`), in a
    model of Blocks (`blocks.0.attention.q`) or in a FeedForward alone (`up`)."""
    for name, style in BLOCK_PLAN.items():
        if layer == name or layer.endswith("." + name) or name.endswith("." + layer):
            return style
    return None


def parallel_layer(linear: nn.Linear, style: str, group, copy_input: bool,
                    sequence_parallel: bool) -> nn.Module:
    if style == "column":
        return ColumnParallelLinear(linear, group, copy_input=copy_input)
    return RowParallelLinear(linear, group, sequence_parallel)


def parallelize_feed_forward(feed_forward: nn.Module, group=None) -> nn.Module:
    """A copy of a reference FeedForward (up, GeLU, down) cut as BLOCK_PLAN says, `up`
    column-parallel (it applies f) and `down` row-parallel (it applies g): the paper's MLP."""
    feed_forward = copy.deepcopy(feed_forward)
    for name in ("up", "down"):
        setattr(feed_forward, name, parallel_layer(getattr(feed_forward, name),
                                                    plan_style(name), group, True, False))
    return feed_forward


def sum_gradient_over_ranks(param: nn.Parameter, group) -> None:
    """In backward, replace `param`'s gradient by its sum over the group's ranks (before it is
    accumulated into .grad, so gradient accumulation stays right)."""
    def summed(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    param.register_hook(summed)


def parallelize_block(block: nn.Module, group=None, sequence_parallel: bool = False
                      ) -> nn.Module:
    """A tensor-parallel copy of a reference transformer Block: attention's q, k and v
    column-parallel (so each rank computes its own heads; the head count must divide by the
    group's size), its output projection row-parallel; the MLP's up column-parallel, down
    row-parallel. One f (or all-gather) where attention and the MLP begin, one g (or
    reduce-scatter) where they end.

    With `sequence_parallel` the block takes and returns this rank's tokens (sequence_shard);
    the LayerNorms' parameters and the row-parallel biases then get partial gradients, which are
    summed over the ranks in backward."""
    block = copy.deepcopy(block)
    attention, feed_forward = block.attention, block.feed_forward
    for name, style in BLOCK_PLAN.items():  # each region's f comes once, from the hook below
        region, _, layer = name.rpartition(".")
        parent = block.get_submodule(region)
        setattr(parent, layer, parallel_layer(getattr(parent, layer), style, group,
                                               copy_input=False,
                                               sequence_parallel=sequence_parallel))
    enter = gather_sequence if sequence_parallel else f
    for region in (attention, feed_forward):
        region.register_forward_pre_hook(lambda module, args: (enter(args[0], group),))
    if sequence_parallel:
        for param in (*block.norm1.parameters(), *block.norm2.parameters(),
                      attention.out.bias, feed_forward.down.bias):
            if param is not None:
                sum_gradient_over_ranks(param, group)
    return block


def shard_of_gradient(name: str, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The slice of a dense Block's (or FeedForward's) gradient `full`, named as in the dense
    module, that rank `rank`'s parallel copy holds: rows for column-parallel layers, columns for
    row-parallel weights, all of it for the rest (LayerNorms, row-parallel biases)."""
    layer, _, kind = name.rpartition(".")
    style = plan_style(layer)
    if style == "column":
        return full.chunk(world_size, dim=0)[rank]
    if style == "row" and kind == "weight":
        return full.chunk(world_size, dim=1)[rank]
    return full


def torch_plan(sequence_parallel: bool) -> dict:
    """BLOCK_PLAN for PyTorch's parallelize_module, as the tensor-parallel tutorial writes one for
    a Llama block: "column" layers ColwiseParallel, "row" layers RowwiseParallel; with sequence
    parallelism the LayerNorms run on each rank's tokens, and attention and the MLP gather them
    first."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    output = Shard(1) if sequence_parallel else Replicate()
    plan = {name: ColwiseParallel() if style == "column" else RowwiseParallel(
        output_layouts=output) for name, style in BLOCK_PLAN.items()}
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),),
                                    desired_input_layouts=(Replicate(),))
        plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel(),
                 "attention": gather, "feed_forward": gather}
    return plan
