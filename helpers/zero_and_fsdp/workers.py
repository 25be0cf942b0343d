"""Lesson 07's workers: the ZeRO stages by hand and PyTorch's, trained on the course's reference
models and checked against single-process AdamW; the bytes each rank holds and sends; step times.

Stage 0 is lesson 06's data parallelism (the naive loop), 1 and 2 `ShardedOptimizer` (or, given
bucket_mb, `BucketedShardedOptimizer`), 3 `FSDP`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from helpers import reference, strategies
from helpers.instrument import Observer
from helpers.launcher.result import get_device
from helpers.layouts import apply_fsdp
from helpers.timing import step_timeline, training_step
from helpers.zero_and_fsdp.bucketed_optimizer import BucketedShardedOptimizer
from helpers.zero_and_fsdp.sharded_optimizer import ShardedOptimizer

# ZeRO stage -> the strategy that builds it (helpers.strategies)
STAGES = {0: "naive", 1: "zero_1", 2: "zero_2", 3: "zero_3"}
TORCH_KINDS = ("zero_redundancy_optimizer", "fully_shard")


def training_worker(rank, world_size, stage, model, batches, loss="lm", **options):
    """Train a copy of `model` with ZeRO `stage` (STAGES; `options` as strategies.build takes
    them: bucket_mb, unit, compute_dtype, optimizer, lr, max_grad_norm) on this rank's slice of
    every batch. Returns the full parameters after the last step."""
    module, optimizer = strategies.build(STAGES[stage], copy.deepcopy(model), **options)
    for batch in batches:
        local = batch.shard(rank, world_size).to(get_device())
        optimizer.zero_grad()
        strategies.LOSSES[loss](module(local.inputs), local.targets).backward()
        optimizer.step()
    return strategies.full_parameters(module)


def param_groups_worker(rank, world_size, gradient_sharding, bucket_mb=None):
    """ShardedOptimizer (or, given bucket_mb, BucketedShardedOptimizer) with two param groups
    (different lr and weight decay) and a frozen weight, against torch.optim.AdamW with the same
    groups on one process (the whole batch). Returns both models' parameters and whether the
    frozen weight stayed as it was."""
    # float64: AdamW would amplify float32 rounding into a visible difference (helpers.tolerance)
    model, batches = reference.in_float64(
        reference.make_mlp(dim=8, num_layers=3, seed=2, bias=True),
        reference.mlp_data(seed=4, batch_size=12, dim=8, steps=5))
    model.layers[1].weight.requires_grad_(False)
    alone = copy.deepcopy(model)

    def groups(m):
        return [{"params": [m.layers[0].weight, m.layers[0].bias], "lr": 0.05},
                {"params": [p for p in m.layers[1:].parameters() if p.requires_grad],
                 "weight_decay": 0.1}]

    if bucket_mb is None:
        sharded = ShardedOptimizer(groups(model), torch.optim.AdamW,
                                   gradient_sharding=gradient_sharding, lr=1e-2, weight_decay=0.0)
    else:
        sharded = BucketedShardedOptimizer(groups(model), torch.optim.AdamW,
                                           gradient_sharding=gradient_sharding,
                                           bucket_mb=bucket_mb, lr=1e-2, weight_decay=0.0)
    reference_optimizer = torch.optim.AdamW(groups(alone), lr=1e-2, weight_decay=0.0)
    frozen = model.layers[1].weight.detach().clone()
    for batch in batches:
        sharded.zero_grad()
        local = batch.shard(rank, world_size)
        reference.mse_loss(model(local.inputs), local.targets).backward()
        sharded.step()
        reference_optimizer.zero_grad()
        reference.mse_loss(alone(batch.inputs), batch.targets).backward()
        reference_optimizer.step()
    return {"sharded": reference.parameters(model), "alone": reference.parameters(alone),
            "frozen unchanged": torch.equal(model.layers[1].weight, frozen)}


def memory_worker(rank, world_size, stage, model, batches, loss="lm", bucket_mb=None):
    """Two training steps with ZeRO `stage` (stages 1 and 2 bucketed, given bucket_mb). At the
    end of the second backward (the gradients complete, the optimizer state allocated), the
    bytes this rank holds (strategies.held_bytes); the bytes it sent during that step, by
    collective; and, stage 3, the most bytes of gathered weights alive at once."""
    module, optimizer = strategies.build(STAGES[stage], copy.deepcopy(model), bucket_mb=bucket_mb)
    for step, batch in enumerate(batches[:2]):
        local = batch.shard(rank, world_size).to(get_device())
        optimizer.zero_grad()
        with Observer() as observed:
            strategies.LOSSES[loss](module(local.inputs), local.targets).backward()
            if step == 1:
                held = strategies.held_bytes(module, optimizer)
            optimizer.step()
    gathered = module.gathered.peak if stage == 3 else 0
    return {"held": held, "sent": observed.sent(), "calls": observed.calls(),
            "gathered peak": gathered}


def fully_shard_recipe_worker(rank, world_size, model_kwargs, full_state, batches,
                              max_grad_norm=1.0, dtype=torch.float32):
    """fully_shard as a model too large for one device needs it: built on the meta device (no
    memory), sharded, then given memory for this rank's pieces only, filled from rank 0's full
    state dict (broadcast, piece by piece); trained with AdamW and gradient clipping; its full
    state dict gathered to rank 0's CPU at the end (torch.distributed.checkpoint's state-dict
    helpers). Returns that state dict on rank 0, None elsewhere."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    mesh = strategies.default_mesh("fully_shard")  # every rank, on the launcher's device
    with torch.device("meta"):  # shapes only: no rank ever holds the whole model
        model = reference.TinyLM(**model_kwargs).to(dtype)
    apply_fsdp(model, mesh)  # each block, then the model (helpers.layouts)
    model.to_empty(device=get_device())  # memory for this rank's pieces
    set_model_state_dict(model, full_state if rank == 0 else {}, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    optimizer = reference.make_optimizer("adamw", model.parameters())  # on the pieces
    for batch in batches:
        local = batch.shard(rank, world_size).to(get_device())
        optimizer.zero_grad()
        reference.lm_loss(model(local.inputs), local.targets).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)  # the global norm
        optimizer.step()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
    return state if rank == 0 else None


def torch_training_worker(rank, world_size, kind, model, batches):
    """Train a copy of `model` with PyTorch's ZeRO `kind` (TORCH_KINDS: DDP with
    ZeroRedundancyOptimizer, stage 1, or fully_shard, stage 3). Returns the full parameters after
    the last step."""
    module, optimizer = strategies.build(kind, copy.deepcopy(model))
    for batch in batches:
        local = batch.shard(rank, world_size).to(get_device())
        optimizer.zero_grad()
        reference.lm_loss(module(local.inputs), local.targets).backward()
        optimizer.step()
    return strategies.full_parameters(module)


# The hand-built ZeRO-1 and ZeRO-2 against PyTorch's: {key: (strategy, bucketed)}
STAGE_1_2 = {"readable_zero_1": ("zero_1", False), "bucketed_zero_1": ("zero_1", True),
             "bucketed_zero_2": ("zero_2", True),
             "zero_redundancy_optimizer": ("zero_redundancy_optimizer", False)}
STAGE_1_2_LABELS = {"readable_zero_1": "readable ZeRO-1", "bucketed_zero_1": "bucketed ZeRO-1",
                    "bucketed_zero_2": "bucketed ZeRO-2",
                    "zero_redundancy_optimizer": "ZeroRedundancyOptimizer"}


def stage_1_2_contenders(bucket_mb: float) -> dict:
    """STAGE_1_2 as strategies.step_times_worker takes contenders: {key: (strategy, options)},
    the bucketed ones with buckets of `bucket_mb` MiB."""
    return {key: (name, {"bucket_mb": bucket_mb} if bucketed else {})
            for key, (name, bucketed) in STAGE_1_2.items()}


def stage_1_2_calls_worker(rank, world_size, model, batch, bucket_mb=1.0):
    """One training step of each of STAGE_1_2, observed: {key: {collective: calls}}. DDP's
    all-reduces are issued by its C++ reducer, which the observer does not see."""
    local = batch.shard(rank, world_size).to(get_device())
    calls = {}
    for key, (name, options) in stage_1_2_contenders(bucket_mb).items():
        module, optimizer = strategies.build(name, copy.deepcopy(model), **options)
        with Observer() as observed:
            training_step(module, optimizer, reference.lm_loss, local.inputs, local.targets)
        calls[key] = observed.calls()
    return calls


def zero_1_timeline_worker(rank, world_size, model, batch, bucket_mb, steps=5):
    """Training steps of the readable and the bucketed ZeRO-1, each on its own copy of `model`,
    observed (helpers.timing.step_timeline): the forward, the backward, the wait for the
    reduce-scatters at its end (bucketed), the optimizer's step, and every reduce-scatter and
    all-gather from its launch to its end. Returns, for each, the step of median time."""
    local = batch.shard(rank, world_size).to(get_device())
    timelines = {}
    for key in ("readable_zero_1", "bucketed_zero_1"):
        name, options = stage_1_2_contenders(bucket_mb)[key]
        module, optimizer = strategies.build(name, copy.deepcopy(model), **options)
        timelines[key] = step_timeline(
            module, optimizer, reference.lm_loss, local.inputs, local.targets,
            collectives=("reduce_scatter", "all_gather"), steps=steps)
    return timelines


# The hand-built ZeRO-3 against fully_shard, each unit a layer or a block: {key: (strategy,
# options)}, as strategies.step_times_worker takes contenders
ZERO_3 = {f"{who}_per_{unit}": (name, {"unit": unit}) for unit in ("layer", "block")
          for who, name in (("hand_built", "zero_3"), ("fully_shard", "fully_shard"))}
ZERO_3_LABELS = {"hand_built_per_layer": "hand-built per layer",
                 "fully_shard_per_layer": "fully_shard per layer",
                 "hand_built_per_block": "hand-built per block",
                 "fully_shard_per_block": "fully_shard per block"}
