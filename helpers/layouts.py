"""Layouts: a model laid out on a mesh with PyTorch's own pieces, each written once.

In the style of torchtitan's `apply_tp`, `apply_ac` and `apply_fsdp` (pytorch/torchtitan@9dec370,
torchtitan/parallelisms/parallelize_llama.py): functions that take a model and a mesh, with
keyword options, and change the model in place. Lessons 07, 10, 11 and 12 call them, and show
them where they first use them.

- `apply_fsdp(model, mesh, unit="block", **options)`: FSDP2's documented way to wrap a
  transformer. `fully_shard` each unit (`fsdp_units`: by default each block), then the model
  itself, which takes what is left (embeddings, final norm, head). `options` (mp_policy,
  reshard_after_forward, ...) go to every call.
- `apply_tp(model, mesh, sequence_parallel=False)`: `parallelize_module` on each block of a
  TinyLM, with lesson 08's plan (tensor_parallelism.megatron.torch_plan).
- `apply_llama_tp(model, mesh, loss_parallel=True)`: tensor and sequence parallelism for a
  Llama (helpers.llama), with torchtitan's plan. Lesson 13 lays out real sizes with it.
- `apply_dp_tp(model, mesh, recompute="none")`: both on a ("dp", "tp") mesh: tensor parallelism
  over mesh["tp"], then activation checkpointing, then FSDP2 over mesh["dp"] (torchtitan's order).
- `apply_ac(model, mode, every=1)`: activation checkpointing of every block (or every `every`-th),
  "none", "selective" (the attention core recomputed in backward), "full" (the whole block), with
  torch.utils.checkpoint (`recompute_in_backward`), or "op": the whole block under PyTorch's
  selective-checkpointing API with torchtitan's op-level policy (`keep_products`). Lesson 11
  teaches them.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

UNITS = ("block", "layer")
AC_MODES = ("none", "selective", "full")  # Korthikanti et al.'s three; apply_ac also takes "op"
_aten, _functional = torch.ops.aten, torch.ops._c10d_functional
PRODUCTS = (_aten.mm.default, _aten.addmm.default)  # a Linear without and with a bias
KEPT_BY_OP_POLICY = (  # besides every other product: attention kernels, collectives' outputs
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _functional.reduce_scatter_tensor.default, _functional.all_reduce.default)


def apply_fsdp(model: nn.Module, mesh, *, unit: str = "block", **options) -> nn.Module:
    """fully_shard each unit of `model`, then `model` itself; returns `model`.

    unit="block": each transformer block (`model.blocks`; an MLP's `model.layers`).
    unit="layer": each Linear and Embedding, those that share a weight (tied) in one unit."""
    for modules in fsdp_units(model, unit):
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def apply_tp(model: nn.Module, mesh, *, sequence_parallel: bool = False) -> nn.Module:
    """parallelize_module each block of a TinyLM over `mesh` (1-D), with lesson 08's plan."""
    from helpers.tensor_parallelism.megatron import torch_plan  # only here: FSDP needs no lesson 08

    for block in model.blocks:
        parallelize_module(block, mesh, torch_plan(sequence_parallel=sequence_parallel))
    return model


def apply_llama_tp(model: nn.Module, mesh, *, loss_parallel: bool = True) -> nn.Module:
    """Tensor and sequence parallelism for a Llama over `mesh` (1-D), as torchtitan lays it out
    (pytorch/torchtitan@9dec370, torchtitan/parallelisms/parallelize_llama.py, apply_tp, without
    Float8): between the blocks each rank keeps 1/t of the tokens (Shard(1)); each block gathers
    them before attention and the MLP, whose projections in are cut by columns (heads, hidden
    units) and whose projections out by rows, reduce-scattered back to the tokens; the embedding
    is cut by rows of the vocabulary, the head by its columns. With `loss_parallel` (torchtitan's
    default) the logits stay cut by the vocabulary, a DTensor: compute the loss inside
    torch.distributed.tensor.parallel.loss_parallel(); without it they are gathered whole."""
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel)})
    gather = {"input_layouts": (Shard(1), None, None),
              "desired_input_layouts": (Replicate(), None, None)}
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(**gather),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    return model


def apply_dp_tp(model: nn.Module, mesh, *, recompute: str = "none") -> nn.Module:
    """A TinyLM on a ("dp", "tp") mesh: tensor-parallel over "tp", each block checkpointed as
    `recompute` says (apply_ac), then FSDP2 over "dp"."""
    apply_tp(model, mesh["tp"])
    apply_ac(model, recompute)
    return apply_fsdp(model, mesh["dp"])


def recompute_in_backward(module: nn.Module, method: str = "forward", **options) -> None:
    """From now on, `module.method` runs under torch.utils.checkpoint: autograd keeps only its
    inputs, and backward runs it again to get what it needs. `options` go to checkpoint."""
    original = getattr(type(module), method)
    setattr(module, method, functools.partial(checkpoint, original, module, use_reentrant=False,
                                              **options))


def keep_products():
    """A policy for torch.utils.checkpoint's selective checkpointing, after torchtitan's op-level
    one (pytorch/torchtitan@9dec370, torchtitan/parallelisms/parallelize_llama.py, `_save_list` and
    `_custom_policy`): keep the output of every other matrix product (the first, the third,
    ...), of the attention kernels and of the collectives that end a tensor-parallel region
    (torchtitan's reduce-scatters; the all-reduces of lesson 08's plan); recompute everything
    else. (torchtitan also keeps `abs` and `max`, for Float8 training's scales.) In torch 2.13
    the policy is called in forward only, and the recomputation replays its answers in order
    (torchtitan's counter for the recomputation served older releases). A new one for each
    forward: it counts."""
    products = 0

    def policy(context, op, *args, **kwargs):
        nonlocal products
        if op in PRODUCTS:
            products += 1
            keep = products % 2 == 1
        else:
            keep = op in KEPT_BY_OP_POLICY
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_ac(model: nn.Module, mode: str = "full", *, every: int = 1) -> nn.Module:
    """Checkpoint the blocks of `model` (a TinyLM's `blocks`, a Llama's `layers`, or `model`
    itself, one block): "full" recomputes the whole block from its input, "selective" only its
    attention core, "op" what `keep_products` does not keep, "none" nothing. `every` = k: only
    every k-th block, counted from 1 (the blocks at indices k - 1, 2k - 1, ..., as
    torchtitan@9dec370's layer-level selective checkpointing counts them); the others keep
    everything. Returns model."""
    if mode not in AC_MODES + ("op",):
        raise ValueError(f"mode must be one of {AC_MODES + ('op',)}, got {mode!r}")
    for index, block in enumerate(getattr(model, "blocks", getattr(model, "layers", [model]))):
        if (index + 1) % every:
            continue
        if mode == "full":
            recompute_in_backward(block)
        elif mode == "selective":
            recompute_in_backward(block.attention, "core")
        elif mode == "op":
            recompute_in_backward(block, context_fn=lambda: create_selective_checkpoint_contexts(
                keep_products()))
    return model


def fsdp_units(model: nn.Module, unit: str = "block") -> list:
    """The units apply_fsdp shards one by one: lists of modules, each list one fully_shard."""
    if unit == "block":
        return [[block] for block in getattr(model, "blocks", getattr(model, "layers", []))]
    if unit == "layer":
        tied = {}
        for module in model.modules():
            if type(module) in (nn.Linear, nn.Embedding):
                tied.setdefault(id(module.weight), []).append(module)
        return list(tied.values())
    raise ValueError(f"unknown unit {unit!r}; choose one of {UNITS}")
