"""FSDP2's knobs, measured (lesson 11, notebooks/11_fitting_a_model.ipynb): fully_shard on each
block of the course's TinyLM and then on the whole model, as its documentation wraps a
transformer, and what three of its settings change.

reshard_after_forward (True, False or an int k): after a block's forward, free its gathered
weights (True: the backward gathers them again), keep them (False: no second all-gather, all
the blocks' weights held until their backward), or keep a 1/k piece of them (an int k, a divisor
of n other than 1 and n, which FSDP2 takes as False and True: the backward gathers from k ranks
only, inside a machine on a real cluster). With B bytes of
weights per block, R for the root's own (embeddings, final norm, head), L blocks, on n ranks:

    setting   all-gathers per step             gathered bytes held at most
    True      L + 1 over n, L + 1 over n       R + 2 B          (a block, and the next one's
                                                                 prefetched in backward)
    False     L + 1 over n                     R + L B          (every block until backward)
    k         L + 1 over n, L + 1 over k       R + 2 B + (L-1) B/k

  (True here is passed to the root too, so its weights are gathered again for backward; the
  default, None, keeps the root's gathered from forward to backward.) The second B: by default
  FSDP2 prefetches in backward (FSDPParamGroup._backward_prefetch, _fsdp_param_group.py): a
  block's pre-backward issues the all-gather of the block whose backward comes next, and its
  output buffer holds that block's whole weights until the block copies them out. With False
  nothing is gathered in backward, so nothing is prefetched.

prefetch: set_modules_to_forward_prefetch / set_modules_to_backward_prefetch name the modules
whose all-gathers a module issues in its own pre-forward / pre-backward hook, ahead of their
turn. On a GPU the all-gather then runs on its own stream while this block computes; on the CPU
with gloo every collective FSDP2 issues completes before the call returns (it has no second
stream), so the prefetch shows in *when* each all-gather is issued, one block early, not in
overlap.

HSDP: fully_shard over a 2-D mesh (replicate, shard) shards each block over the "shard" ranks
and replicates the pieces over the "replicate" ranks: all-gathers and reduce-scatters inside a
shard group, (s-1)/s of the bytes each; then an all-reduce of each rank's gradient piece,
1/s of the gradients, over its replicate group, 2 (r-1)/r of it.

`gathered_bytes` reads FSDP2's internals (FSDPParam.all_gather_outputs and
_sharded_post_forward_param_data, torch/distributed/fsdp/_fully_shard/_fsdp_param.py): no public
API tells how many gathered bytes a module holds.
"""

from __future__ import annotations

import collections
import copy

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from helpers import reference
from helpers.instrument import Observer, peak_at_hooks
from helpers.launcher.result import get_device
from helpers.layouts import apply_fsdp
from helpers.strategies import default_mesh, full_parameters
from helpers.timing import observed_training


def gathered_bytes(model) -> int:
    """The bytes of gathered weights the fully_shard'ed modules inside `model` hold now: their
    all-gather outputs (a storage of size 0 once freed), the 1/k pieces an int
    reshard_after_forward keeps, and the buffer of an all-gather issued ahead of its module's
    turn that no module has copied out yet (FSDP2's default backward prefetch gathers the next
    block's weights in the backward of this one). FSDP2 internals (see the module docstring)."""
    storages = {}
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(
            module, FSDPModule) else None
        if group is None:
            continue
        pending = group._all_gather_result  # issued, not yet copied out into the parameters
        tensors = [pending.all_gather_output] if pending is not None else []
        for param in group.fsdp_params:
            tensors += [*param.all_gather_outputs,
                        getattr(param, "_sharded_post_forward_param_data", None)]
        for tensor in tensors:
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def group_size(record, world_size: int) -> int:
    """The ranks in the group an Observer record's collective ran on."""
    return world_size if record.detail is None else len(record.detail)


def reshard_worker(rank, world_size, model, batch, reshard_after_forward):
    """A forward and backward of fully_shard'ed `model` (2 steps; the second observed) with
    `reshard_after_forward`. Returns {"peak": the most gathered bytes held at any hook of a
    block's Linear (instrument.peak_at_hooks), "all-gathers": {group size: count}, "sent":
    {group size: bytes of all-gathers}}."""
    model = apply_fsdp(copy.deepcopy(model).to(get_device()), default_mesh("fully_shard"),
                       reshard_after_forward=reshard_after_forward)
    # every Linear of the blocks (the root's own layers take no backward hook quietly: the
    # embeddings' inputs need no gradient, and the head's output is the model's)
    layers = [module for block in model.blocks for module in block.modules()
              if isinstance(module, nn.Linear)]
    local = batch.shard(rank, world_size).to(get_device())
    for _ in range(2):
        with Observer() as observed, peak_at_hooks(layers, lambda: gathered_bytes(model)) as held:
            reference.lm_loss(model(local.inputs), local.targets).backward()
    peak = held.value
    gathers = [record for record in observed.records if record.name == "all_gather_single"]
    counts, sent = collections.Counter(), collections.Counter()
    for record in gathers:
        counts[group_size(record, world_size)] += 1
        sent[group_size(record, world_size)] += record.sent
    return {"peak": peak, "all-gathers": dict(counts), "sent": dict(sent)}


def reshard_formula(block_bytes: int, root_bytes: int, blocks: int, world_size: int,
                    reshard_after_forward) -> dict:
    """The table in the module docstring: {"peak": bytes, "all-gathers": {group size: count}}."""
    passes = blocks + 1  # every block and the root, once per pass
    if reshard_after_forward is True:  # this block's, and the next one's prefetched
        return {"peak": root_bytes + 2 * block_bytes, "all-gathers": {world_size: 2 * passes}}
    if reshard_after_forward is False:
        return {"peak": root_bytes + blocks * block_bytes, "all-gathers": {world_size: passes}}
    k = reshard_after_forward
    return {"peak": root_bytes + 2 * block_bytes + (blocks - 1) * block_bytes // k,
            "all-gathers": {world_size: passes, k: passes}}


def prefetch_worker(rank, world_size, model, batch, prefetch: int):
    """One observed step (after one unobserved) of fully_shard'ed `model`; `prefetch` > 0 makes
    each block prefetch the next `prefetch` blocks' weights in forward and in backward
    (set_modules_to_forward_prefetch, set_modules_to_backward_prefetch), 0 leaves FSDP2's
    defaults. Returns {"events": [(label, start_s, end_s)]: each block's "forward" and "backward"
    and each "all_gather" from launch to completion, from the step's start; "ahead": for each
    block, the all-gathers issued before its forward began}."""
    model = apply_fsdp(copy.deepcopy(model).to(get_device()), default_mesh("fully_shard"))
    blocks = list(model.blocks)
    if prefetch:
        for index, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[index + 1:index + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, index - prefetch):index][::-1])
    local = batch.shard(rank, world_size).to(get_device())
    for _ in range(2):
        with Observer() as observed, observed.module_spans(dict(enumerate(blocks))), \
                observed.span("step"):
            reference.lm_loss(model(local.inputs), local.targets).backward()
    spans = {span.label: span for span in observed.spans}
    start = spans["step"].start
    gathers = [(record.launched - start, record.completed - start)
               for record in observed.records if record.name == "all_gather_single"]
    events = [(kind, spans[kind, index].start - start, spans[kind, index].end - start)
              for kind in ("forward", "backward") for index in range(len(blocks))]
    events += [("all_gather", launched, completed) for launched, completed in gathers]
    ahead = [sum(launched < spans["forward", index].start - start for launched, _ in gathers)
             for index in range(len(blocks))]
    return {"events": events, "ahead": ahead}


def hsdp_worker(rank, world_size, model, batches, shape=(2, 2)):
    """Train a copy of `model` with HSDP on a (replicate, shard) = `shape` mesh: fully_shard
    over the 2-D mesh, each rank on its slice of every batch. Returns the full parameters after
    the last step, and the bytes and calls of the last step by (collective, "shard" or
    "replicate": the mesh dimension of its group). The lesson shows init_device_mesh's 2-D mesh
    here itself (elsewhere the course's layouts.make_mesh makes meshes)."""
    mesh = init_device_mesh(get_device().type, shape, mesh_dim_names=("replicate", "shard"))
    model = apply_fsdp(copy.deepcopy(model).to(get_device()), mesh)
    optimizer = reference.make_optimizer("adamw", model.parameters())
    observed = observed_training(model, optimizer, reference.lm_loss, batches, rank, world_size)
    dimension = {tuple(dist.get_process_group_ranks(mesh.get_group(name))): name
                 for name in ("replicate", "shard")}
    sent, calls = collections.Counter(), collections.Counter()
    for record in observed.records:
        key = (record.name, dimension[tuple(record.detail)])
        sent[key] += record.sent
        calls[key] += 1
    return {"parameters": full_parameters(model), "sent": dict(sent), "calls": dict(calls)}


def hsdp_formula(model_bytes: int, block_bytes: int, blocks: int, shape=(2, 2)) -> dict:
    """Bytes one rank sends per step under HSDP (the module docstring), by (collective, mesh
    dimension): the blocks' weights gathered twice (forward, backward) and the root's once (the
    default keeps the root's from forward to backward), over the s shard ranks; the gradients
    reduce-scattered over them; the 1/s piece all-reduced over the r replicas."""
    replicas, shards = shape
    root_bytes = model_bytes - blocks * block_bytes
    ring = (shards - 1) / shards
    return {("all_gather_single", "shard"): ring * (2 * blocks * block_bytes + root_bytes),
            ("reduce_scatter_single", "shard"): ring * model_bytes,
            ("all_reduce", "replicate"): 2 * (replicas - 1) / replicas * model_bytes / shards}
