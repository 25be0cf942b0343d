"""ZeRO stage 3 by hand: `FSDP(module, compute_dtype=None)` (P_os+g+p in the ZeRO paper; FSDP in
PyTorch). Lesson 07, notebooks/07_zero_and_fsdp.ipynb.

Rank r keeps only piece r (sharding.shard_of) of every Linear's weight and bias and of every
Embedding's table: its parameters, gradients and optimizer state are all 1/n of the model's.
A layer's full weight exists only while the layer computes:

  forward    all_gather the layer's pieces (cast to compute_dtype first, if given: a bfloat16
             weight is half the bytes), compute, free the gathered weight
  backward   all_gather the weight again (the input's gradient needs it), compute the input's
             and the weight's gradients, free the weight; reduce_scatter the weight's gradient
             (AVG, in the pieces' dtype, float32): rank r keeps the average of its piece
  (An Embedding's backward needs only the token ids, so it gathers in forward only.)

For a layer gathered in its forward and its backward, each rank sends (n-1)/n of its parameters
three times per step (two all-gathers, one reduce-scatter): 3(n-1)/n, 1.5 times data
parallelism's 2(n-1)/n (the ZeRO paper, section 7.2.2). An Embedding, gathered once, costs less;
a tied weight, reduce-scattered once per use, costs more.

Other parameters (LayerNorm's) stay whole on every rank, and finish_gradient_synchronization()
averages their gradients with all_reduce, queued at the end of backward by the first of them to
arrive (lesson 06's DDP does the same), so training is forward, backward, step. The optimizer steps
the pieces in the module's own dtype (float32), so the master weights and the update keep it
whatever compute_dtype is.
The autograd Functions below hold the communication; ShardedLinear and ShardedEmbedding are the
layers that use them.

Every layer its own unit means three collectives per layer per step, each paying the latency
alpha. `FSDP(module, units=model.blocks)` shards each listed module (a transformer block) as one
piece instead, all its parameters together, LayerNorms included: three collectives per block
(one all-gather for its forward, one for its backward, one reduce-scatter) instead of three per
Linear plus an all-reduce per LayerNorm tensor. To free the block's weights between its forward
and its backward without hooks on autograd's saved tensors, GatheredUnit keeps only the block's
input and computes the block's forward again in the backward (activation recomputation, with the
random state of the first forward, so that dropout draws the same masks; a BatchNorm inside a
unit would update its running statistics twice). With units and compute_dtype, the whole block
computes in compute_dtype (inputs cast in, outputs cast back).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers.data_parallelism.ddp import at_end_of_backward, broadcast_from_first
from helpers.zero_and_fsdp.sharding import gather, scatter_mean, shard_of


class GatheredBytes:
    """The bytes of gathered (full) weights alive now, and the most alive at once: each gathered
    tensor is counted from its all-gather until Python frees it (weakref.finalize)."""

    def __init__(self):
        self.now = self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(tensor, self._freed, size)
        return tensor

    def _freed(self, size: int) -> None:
        self.now -= size


class Sharding:
    """What the sharded layers of one FSDP share: the group, the compute dtype, the layout of
    every piece, and the gathered-bytes tracker.

    A layer's parameters (a Linear's weight and bias) are flattened into one vector and sharded
    together, so that each layer costs one all-gather and one reduce-scatter, not one per
    parameter (PyTorch's first FSDP did the same with its FlatParameter)."""

    def __init__(self, group, compute_dtype):
        self.group, self.compute_dtype = group, compute_dtype
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.pieces = {}  # a layer's original parameters -> their piece (tied layers share one)
        self.shapes = {}  # a piece -> the shapes of the parameters it holds, in order

    def piece_of(self, params: tuple) -> nn.Parameter:
        key = tuple(id(param) for param in params)
        if key not in self.pieces:
            for other in self.pieces:
                if set(key) & set(other):  # a weight tied across different parameter sets
                    raise ValueError("FSDP shards a tied weight only between layers that hold "
                                     "exactly the same parameters")
            if len({param.requires_grad for param in params}) > 1:
                raise ValueError("FSDP needs a layer's parameters all trainable or all frozen")
            flat = torch.cat([param.detach().flatten() for param in params])
            piece = nn.Parameter(shard_of(flat, self.rank, self.world_size),
                                 requires_grad=params[0].requires_grad)
            self.pieces[key], self.shapes[piece] = piece, [param.shape for param in params]
        return self.pieces[key]

    def gather(self, piece: nn.Parameter, tracker: GatheredBytes) -> list:
        """The layer's whole parameters, in the compute dtype, counted while they live."""
        dtype = self.compute_dtype or piece.dtype
        shapes = self.shapes[piece]
        flat = tracker.track(gather(piece.detach().to(dtype),
                                    torch.Size([sum(math.prod(shape) for shape in shapes)]),
                                    self.group))
        return [part.view(shape) for part, shape in
                zip(flat.split([math.prod(shape) for shape in shapes]), shapes)]

    def scatter(self, gradients: list, piece: nn.Parameter) -> torch.Tensor:
        """This rank's piece of the layer's gradients averaged over the ranks, in the dtype of
        the master weights, `piece`'s."""
        return scatter_mean(torch.cat([grad.to(piece.dtype).flatten() for grad in gradients]),
                            self.group)


class GatheredLinear(torch.autograd.Function):
    """y = x W^T + b with W and b gathered for the forward, gathered again for the backward, and
    their gradients reduce-scattered (the steps at the top of this file)."""

    @staticmethod
    def forward(ctx, inputs, piece, layer):
        ctx.save_for_backward(inputs)
        ctx.layer = layer  # keeps the piece (a parameter the rank holds anyway), not the weight
        weight, *bias = layer.sharding.gather(piece, layer.gathered)  # bias: [] or [b]
        return F.linear(inputs.to(weight.dtype), weight, *bias).to(inputs.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        (inputs,) = ctx.saved_tensors
        layer = ctx.layer
        weight, *bias = layer.sharding.gather(layer.piece, layer.gathered)  # the 2nd all-gather
        grad = grad_output.to(weight.dtype)
        grad_input = (grad @ weight).to(inputs.dtype)
        grad_piece = None
        if ctx.needs_input_grad[1]:  # forward's second input, the piece, wants a gradient
            grad_rows, input_rows = grad.flatten(0, -2), inputs.to(weight.dtype).flatten(0, -2)
            gradients = [grad_rows.T @ input_rows] + ([grad_rows.sum(0)] if bias else [])
            grad_piece = layer.sharding.scatter(gradients, layer.piece)
        return grad_input, grad_piece, None


class GatheredEmbedding(torch.autograd.Function):
    """table[ids] with the table gathered for the forward; the backward adds the output's
    gradient into the rows of `ids` and reduce-scatters it (no gather: it needs no weights)."""

    @staticmethod
    def forward(ctx, ids, piece, layer):
        ctx.save_for_backward(ids)
        ctx.shape = layer.sharding.shapes[piece][0]
        ctx.sharding, ctx.piece = layer.sharding, piece
        (table,) = layer.sharding.gather(piece, layer.gathered)
        ctx.dtype = table.dtype
        return F.embedding(ids, table).to(piece.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        # Summed in the compute dtype, as autograd sums the gradient of a table cast to it.
        grad_table = grad_output.new_zeros(ctx.shape, dtype=ctx.dtype)
        grad_table.index_add_(0, ids.flatten(), grad_output.to(ctx.dtype).flatten(0, -2))
        return None, ctx.sharding.scatter([grad_table], ctx.piece), None


class GatheredUnit(torch.autograd.Function):
    """A whole module (a block) with all its parameters gathered for the forward, which keeps no
    graph; the backward gathers them again, runs the forward again with autograd, and
    reduce-scatters the parameters' gradient."""

    @staticmethod
    def forward(ctx, piece, unit, *inputs):
        ctx.unit, ctx.random_state = unit, torch.get_rng_state()  # to draw the same masks again
        ctx.save_for_backward(*inputs)
        return unit.run(unit.sharding.gather(piece, unit.gathered), inputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        unit = ctx.unit
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        weights = [w.detach().requires_grad_() for w in
                   unit.sharding.gather(unit.piece, unit.gathered)]  # the 2nd all-gather
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(ctx.random_state)
            outputs = unit.run(weights, inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        torch.autograd.backward(outputs, grad_outputs)
        grad_piece = unit.sharding.scatter([w.grad for w in weights], unit.piece)
        return (grad_piece, None, *[x.grad for x in inputs])


class ShardedUnit(nn.Module):
    """A module whose parameters, all of them, live in one piece per rank (see GatheredUnit).
    The module keeps its structure; its parameters become empty placeholders."""

    def __init__(self, module: nn.Module, sharding: Sharding, gathered: GatheredBytes):
        super().__init__()
        named = list(module.named_parameters())
        self.names = tuple(name for name, _ in named)
        self.piece = sharding.piece_of(tuple(param for _, param in named))
        for name in self.names:  # free the whole weights: the piece replaces them
            owner, _, leaf = name.rpartition(".")
            holder = module.get_submodule(owner)
            del holder._parameters[leaf]
            holder.register_buffer(leaf, torch.empty(0), persistent=False)
        self.module, self.sharding, self.gathered = module, sharding, gathered

    def run(self, weights: list, inputs):
        dtype = weights[0].dtype
        cast = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
        output = torch.func.functional_call(self.module, dict(zip(self.names, weights)),
                                            tuple(cast))
        return output.to(inputs[0].dtype) if inputs[0].is_floating_point() else output

    def forward(self, *inputs):
        return GatheredUnit.apply(self.piece, self, *inputs)


class ShardedLinear(nn.Module):
    """An nn.Linear whose weight and bias live in one piece per rank."""

    def __init__(self, linear: nn.Linear, sharding: Sharding, gathered: GatheredBytes):
        super().__init__()
        params = (linear.weight,) if linear.bias is None else (linear.weight, linear.bias)
        self.piece = sharding.piece_of(params)
        self.names = ("weight", "bias")[:len(params)]
        self.sharding, self.gathered = sharding, gathered

    def forward(self, inputs):
        return GatheredLinear.apply(inputs, self.piece, self)


class ShardedEmbedding(nn.Module):
    """An nn.Embedding whose table is one piece per rank."""

    def __init__(self, embedding: nn.Embedding, sharding: Sharding, gathered: GatheredBytes):
        super().__init__()
        if (embedding.padding_idx is not None or embedding.max_norm is not None
                or embedding.scale_grad_by_freq or embedding.sparse):
            raise ValueError("FSDP shards plain embeddings only (no padding_idx, max_norm, "
                             "scale_grad_by_freq or sparse)")
        self.piece = sharding.piece_of((embedding.weight,))
        self.names = ("weight",)
        self.sharding, self.gathered = sharding, gathered

    def forward(self, ids):
        return GatheredEmbedding.apply(ids, self.piece, self)


class FSDP(nn.Module):
    """ZeRO stage 3 (see the module docstring). At construction rank 0's parameters and buffers
    are broadcast, then each module of `units` is replaced by its sharded twin, and so is every
    Linear and Embedding outside them.

    `gathered.peak`: the most bytes of gathered weights alive at once, since construction."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, group=None,
                 units=None):
        super().__init__()
        broadcast_from_first([*module.parameters(), *module.buffers()], group)
        self.sharding, self.gathered = Sharding(group, compute_dtype), GatheredBytes()
        units = list(units or [])
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if any(child is unit for unit in units):
                    setattr(parent, name, ShardedUnit(child, self.sharding, self.gathered))
        inside_units = {id(sub) for unit in units for sub in unit.modules()}
        for parent in list(module.modules()):
            if id(parent) in inside_units:
                continue
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, ShardedLinear(child, self.sharding, self.gathered))
                elif type(child) is nn.Embedding:
                    setattr(parent, name, ShardedEmbedding(child, self.sharding, self.gathered))
        self.module = module
        self.replicated = [param for param in module.parameters()
                           if param.requires_grad and param not in self.sharding.shapes]
        self._finish_queued = False
        for param in self.replicated:
            param.register_post_accumulate_grad_hook(self.replicated_gradient_ready)

    def forward(self, *args, **kwargs):
        self._finish_queued = False  # (a backward that raised never ran its finish)
        return self.module(*args, **kwargs)

    @property
    def group(self):
        return self.sharding.group

    def replicated_gradient_ready(self, param):
        if not self._finish_queued:  # the first replicated gradient of this backward
            self._finish_queued = True
            at_end_of_backward(self.finish_gradient_synchronization)

    def finish_gradient_synchronization(self) -> None:
        """Average the gradients of the parameters that are not sharded (the pieces' gradients
        were reduce-scattered during backward). Runs at the end of backward; a second call
        does nothing."""
        if not self._finish_queued:  # nothing arrived since the last finish
            return
        self._finish_queued = False
        for param in self.replicated:
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=self.group)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so that the norm of the whole model's gradient is at most
        `max_norm`, as torch.nn.utils.clip_grad_norm_ does on one process; returns the norm
        before clipping. Each rank holds only pieces, so the squared norms of the pieces are
        summed over the ranks (all_reduce); the replicated gradients, equal on every rank, count
        once. Call it after backward."""
        pieces = [p.grad for p in self.sharding.shapes if p.grad is not None]
        replicated = [p.grad for p in self.replicated if p.grad is not None]
        squares = sum((grad ** 2).sum() for grad in pieces) + torch.zeros(())
        dist.all_reduce(squares, group=self.group)
        squares += sum((grad ** 2).sum() for grad in replicated)
        norm = squares.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad in pieces + replicated:
            grad.mul_(scale)
        return norm

    @torch.no_grad()
    def gather_full_params(self) -> dict:
        """The unsharded module's state: name -> every whole parameter (in the master weights'
        dtype; a tied weight once, under its first name) and buffer, named as in the unsharded
        module. Every rank must call it: it all-gathers."""
        full, done = {}, set()
        inside_units = {id(sub) for layer in self.module.modules()
                        if isinstance(layer, ShardedUnit) for sub in layer.module.modules()}
        for prefix, layer in self.module.named_modules():
            owner = f"{prefix}." if prefix else ""
            if id(layer) in inside_units:
                continue
            if isinstance(layer, (ShardedLinear, ShardedEmbedding, ShardedUnit)):
                if layer.piece not in done:
                    done.add(layer.piece)
                    shapes = self.sharding.shapes[layer.piece]
                    flat = gather(layer.piece, torch.Size([sum(math.prod(s) for s in shapes)]),
                                  self.group)
                    parts = flat.split([math.prod(shape) for shape in shapes])
                    for name, part, shape in zip(layer.names, parts, shapes):
                        full[owner + name] = part.view(shape).clone()
                if isinstance(layer, ShardedUnit):  # the block's own buffers, if it has any
                    full.update({owner + name: buffer.clone() for name, buffer in
                                 layer.module.state_dict(keep_vars=True).items()})
            else:
                for name, param in layer.named_parameters(recurse=False):
                    full[owner + name] = param.detach().clone()
                for name in layer._buffers:
                    if name not in layer._non_persistent_buffers_set:
                        full[owner + name] = layer._buffers[name].clone()
        return full
