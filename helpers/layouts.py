"""Layouts: a model laid out on a mesh with PyTorch's own pieces, each written once: the course's
`parallelize_llama`.

Both halves of torchtitan's pair (pytorch/torchtitan@9dec370, torchtitan/parallelisms/):
functions that take a model and a mesh, with keyword options, and change the model in place
(`apply_tp`, `apply_ac`, `apply_fsdp`, as in parallelize_llama.py); and the degrees of a layout
with its mesh and the one place that composes them (`Plan`, `make_mesh`, `lay_out`, as
parallel_dims.py's `ParallelDims` and parallelize_llama.py's `parallelize_llama`). Lessons 07, 10,
11, 12, 13 and 14 call them, and show them where they first use them.

- `Plan(dp, tp=1, replicate=1, recompute="none", micro_batch=1, seq_len=2048, bf16=False)`: a
  layout and what one rank computes per step: FSDP2 over `dp` ranks (HSDP with `replicate` > 1),
  tensor parallelism over `tp`, blocks checkpointed as `apply_ac` does (`recompute`),
  `micro_batch` sequences of `seq_len` tokens per rank (lesson 13 sizes runs with them), and
  bfloat16 compute with float32 gradient reduction (torchtitan's default mixed precision).
  `Plan.check(shape)` says, before anything runs, where the degrees do not divide a Llama.
- `make_mesh(plan)`: its mesh, with a named dimension for each degree above 1 ("replicate",
  "dp", "tp"; "dp" always).
- `lay_out(model, mesh, plan)`: torchtitan's order: tensor parallelism over "tp" (a Llama by
  torchtitan's plan, `apply_llama_tp`; a TinyLM by lesson 08's, `apply_tp`), recomputation,
  then FSDP2 over "dp" (HSDP over ("replicate", "dp")).
- `clip_to_norm(model, max_norm)`: torchtitan's clipping by the global norm of gradients cut
  over any mesh; `quiet_redistribute()`: without DTensor's warning about a norm's two
  all-reduces.

- `apply_fsdp(model, mesh, unit="block", **options)`: FSDP2's documented way to wrap a
  transformer. `fully_shard` each unit (`fsdp_units`: by default each block), then the model
  itself, which takes what is left (embeddings, final norm, head). `options` (mp_policy,
  reshard_after_forward, ...) go to every call.
- `apply_tp(model, mesh, sequence_parallel=False)`: `parallelize_module` on each block of a
  TinyLM, with lesson 08's plan (tensor_parallelism.megatron.torch_plan).
- `apply_llama_tp(model, mesh, loss_parallel=True)`: tensor and sequence parallelism for a
  Llama (helpers.llama), with torchtitan's plan. Lesson 13 lays out real sizes with it.
- `apply_ac(model, mode, every=1)`: activation checkpointing of every block (or every `every`-th),
  "none", "selective" (the attention core recomputed in backward), "full" (the whole block), with
  torch.utils.checkpoint (`recompute_in_backward`), or "op": the whole block under PyTorch's
  selective-checkpointing API with torchtitan's op-level policy (`keep_products`). Lesson 11
  teaches them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

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

# The names this shared module takes from a lesson (tests/test_structure.py checks the imports, as
# it checks each lesson's): lesson 08's plan, which the course's TinyLM layout applies.
BUILDS_ON = {
    "tensor_parallelism.megatron:torch_plan": "lesson 08's tensor-parallel plan of a TinyLM block",
}

UNITS = ("block", "layer")
AC_MODES = ("none", "selective", "full")  # Korthikanti et al.'s three; apply_ac also takes "op"
RECOMPUTE = ("none", "op", "full")  # apply_ac's modes that take a Llama block whole
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


# --- the degrees, the mesh and the composition: torchtitan's ParallelDims and parallelize_llama --

@dataclass(frozen=True)
class Plan:
    dp: int
    tp: int = 1
    replicate: int = 1
    recompute: str = "none"
    micro_batch: int = 1
    seq_len: int = 2048
    bf16: bool = False

    @property
    def gpus(self) -> int:
        return self.replicate * self.dp * self.tp

    def __str__(self):
        parts = [f"dp {self.dp}"] + ([f"tp {self.tp}"] if self.tp > 1 else []) + (
            [f"replicas {self.replicate}"] if self.replicate > 1 else [])
        return (f"{' x '.join(parts)}, recompute {self.recompute}, {self.micro_batch} x "
                f"{self.seq_len} tokens{', bf16' if self.bf16 else ''}")

    def check(self, shape) -> None:
        """Raises ValueError, before anything runs, where the layout's degrees do not divide a
        Llama of `shape` (helpers.llama.Shape: its heads, its vocabulary, its sequence)."""
        if min(self.dp, self.tp, self.replicate, self.micro_batch, self.seq_len) < 1:
            raise ValueError(f"{self}: every degree and size is at least 1")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute is one of {RECOMPUTE}, not {self.recompute!r} "
                             f"({set(AC_MODES) - set(RECOMPUTE)} needs a block with a `core`)")
        for what, count in (("heads", shape.heads), ("key-value heads", shape.kv_heads),
                            ("hidden units of the MLP", shape.ffn), ("vocabulary", shape.vocab)):
            if count % self.tp:
                raise ValueError(f"tp {self.tp} does not divide the {count} {what}")
        if self.seq_len % self.tp:
            raise ValueError(f"tp {self.tp} does not divide the sequence of {self.seq_len} "
                             "tokens (sequence parallelism cuts it)")


def make_mesh(plan: Plan):
    """The mesh of `plan` on the launcher's device, its dimensions named: "replicate" and "tp"
    where their degree is above 1, "dp" always (("dp",), ("dp", "tp"), ("replicate", "dp"),
    ("replicate", "dp", "tp")), outermost first: the ranks of one tensor-parallel group are
    neighbours, as torchtitan's build_mesh puts them. (torchtitan names the sharding dimension
    "dp_shard" and the replicas "dp_replicate", and drops every dimension of size 1.)"""
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.launcher.result import get_device

    dims = [(name, size) for name, size in (("replicate", plan.replicate), ("dp", plan.dp),
                                            ("tp", plan.tp)) if size > 1 or name == "dp"]
    return init_device_mesh(get_device().type, tuple(size for _, size in dims),
                            mesh_dim_names=tuple(name for name, _ in dims))


def lay_out(model: nn.Module, mesh, plan: Plan) -> nn.Module:
    """torchtitan's order: tensor parallelism over "tp" (a Llama by torchtitan's plan, a TinyLM
    by lesson 08's), recomputation, then FSDP2 over "dp" (HSDP over ("replicate", "dp")); in
    bfloat16 with gradients reduced in float32 if plan.bf16. Returns the model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from helpers.llama import Llama

    if plan.tp > 1:
        (apply_llama_tp if isinstance(model, Llama) else apply_tp)(model, mesh["tp"])
    apply_ac(model, plan.recompute)
    options = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32)} if plan.bf16 else {}
    shard_over = mesh["replicate", "dp"] if plan.replicate > 1 else mesh["dp"]
    return apply_fsdp(model, shard_over, **options)


def clip_to_norm(model: nn.Module, max_norm: float, foreach: bool = False) -> torch.Tensor:
    """torchtitan's clip_grad_norm_ (torchtitan/utils.py at 9dec370): the gradients' global norm
    from each rank's pieces, a DTensor made whole (an all-reduce of a few numbers per mesh
    dimension), then every gradient scaled by max_norm / norm where that is below 1. torchtitan's
    train.py passes foreach=True, as lesson 13's step does; the capstone (lesson 14) keeps
    PyTorch's one-tensor-at-a-time default, with which its committed runs were made (the same
    norm, summed in another order). Gradients on different meshes (a model laid out in part) are
    normed mesh by mesh, then together. Returns the norm before clipping."""
    from torch.distributed.tensor import DTensor

    by_mesh = {}  # a DTensor's norm needs its mesh: a model laid out in part (lesson 08's plan
    for parameter in model.parameters():  # cuts only the blocks) has gradients on two meshes
        if parameter.grad is not None:
            by_mesh.setdefault(getattr(parameter.grad, "device_mesh", None), []).append(
                parameter.grad)
    norms = []
    for gradients in by_mesh.values():
        with quiet_redistribute():  # (its docstring says why)
            norm = torch.nn.utils.get_total_norm(gradients, foreach=foreach)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm, foreach=foreach)
    return norm


@contextlib.contextmanager
def quiet_redistribute():
    """Without DTensor's warning that a redistribution over a 2-D mesh takes "2 sequential
    all_reduce operations" (a norm's partial sums, one over each dimension, each of a few
    numbers) or two all-gathers (a (dp, tp) parameter gathered whole to be checked): costs
    nothing to warn about where they happen. Lesson 14 quotes the warning."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
