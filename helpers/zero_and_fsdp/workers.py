"""Lesson 07's workers: the ZeRO stages by hand and PyTorch's, trained on the course's reference
models and checked against single-process AdamW; the bytes each rank holds and sends; step times.

Stage 0 is lesson 06's data parallelism (the naive loop), 1 and 2 `ShardedOptimizer` (or, given
bucket_mb, `BucketedShardedOptimizer`), 3 `FSDP`.
"""

from __future__ import annotations

import copy
import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn

from helpers import reference
from helpers.data_parallelism.ddp import average_gradients
from helpers.instrument import Observer
from helpers.layouts import apply_fsdp
from helpers.timing import step_timeline, take_turns, training_step
from helpers.zero_and_fsdp.bucketed_optimizer import BucketedShardedOptimizer
from helpers.zero_and_fsdp.fsdp import FSDP
from helpers.zero_and_fsdp.memory import held_bytes
from helpers.zero_and_fsdp.sharded_optimizer import ShardedOptimizer

STAGES = (0, 1, 2, 3)
TORCH_KINDS = ("ZeroRedundancyOptimizer", "fully_shard")


class Trainer:
    """One rank's model and optimizer for a ZeRO `stage`, with the one call that differs between
    stages (`after_backward`) and the full parameters at the end (`full_parameters`). Stages 1
    and 2 use the readable ShardedOptimizer, or given `bucket_mb` the BucketedShardedOptimizer
    with buckets of that many MiB."""

    def __init__(self, model: nn.Module, stage: int, compute_dtype=None, optimizer="adamw",
                 lr=1e-2, units=None, max_grad_norm=None, bucket_mb=None):
        self.stage, self.max_grad_norm = stage, max_grad_norm
        optimizer_cls, settings = reference.OPTIMIZERS[optimizer]
        if stage == 3:  # units: the name of the model's list of blocks, to shard one piece each
            self.module = FSDP(model, compute_dtype=compute_dtype,
                               units=getattr(model, units) if units else None)
            self.optimizer = optimizer_cls(self.module.parameters(), lr=lr, **settings)
        else:
            self.module = model
            if stage == 0:
                self.optimizer = optimizer_cls(model.parameters(), lr=lr, **settings)
            elif bucket_mb is None:
                self.optimizer = ShardedOptimizer(model.parameters(), optimizer_cls,
                                                  gradient_sharding=stage == 2, lr=lr,
                                                  max_grad_norm=max_grad_norm, **settings)
            else:
                self.optimizer = BucketedShardedOptimizer(
                    model.parameters(), optimizer_cls, gradient_sharding=stage == 2,
                    bucket_mb=bucket_mb, lr=lr, max_grad_norm=max_grad_norm, **settings)

    def after_backward(self):
        if self.stage == 0:
            average_gradients(self.module)  # the all-reduce of data parallelism
            if self.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        elif self.stage == 3:
            self.module.finish_gradient_synchronization()
            if self.max_grad_norm is not None:
                self.module.clip_grad_norm_(self.max_grad_norm)
        elif isinstance(self.optimizer, BucketedShardedOptimizer):
            self.optimizer.finish_gradient_synchronization()  # (step() would, if we did not)
        # the readable ShardedOptimizer communicates (and clips) in step(), and stage 2 also in
        # backward

    def full_parameters(self) -> dict:
        if self.stage == 3:
            return self.module.gather_full_params()
        return reference.parameters(self.module)


def training_worker(rank, world_size, stage, model, batches, loss="lm", compute_dtype=None,
                    optimizer="adamw", lr=1e-2, units=None, max_grad_norm=None, bucket_mb=None):
    """Train a copy of `model` with ZeRO `stage` on this rank's slice of every batch. Returns the
    full parameters after the last step."""
    loss_fn = reference.lm_loss if loss == "lm" else reference.mse_loss
    trainer = Trainer(copy.deepcopy(model), stage, compute_dtype, optimizer, lr, units,
                      max_grad_norm, bucket_mb)
    for batch in batches:
        local = batch.shard(rank, world_size)
        trainer.optimizer.zero_grad()
        loss_fn(trainer.module(local.inputs), local.targets).backward()
        trainer.after_backward()
        trainer.optimizer.step()
    return trainer.full_parameters()


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


def accumulation_worker(rank, world_size, stage, model, batches, micro_batches, bucket_mb):
    """ZeRO `stage` (1 or 2) with BucketedShardedOptimizer: each step `micro_batches` backward
    passes on parts of this rank's slice, each loss divided by micro_batches, with no zero_grad
    between them; then one optimizer step. Returns the parameters after the last step and the
    collectives of the last step."""
    model = copy.deepcopy(model)
    adamw, settings = reference.OPTIMIZERS["adamw"]
    optimizer = BucketedShardedOptimizer(model.parameters(), adamw, gradient_sharding=stage == 2,
                                         bucket_mb=bucket_mb, lr=reference.LR, **settings)
    for batch in batches:
        local = batch.shard(rank, world_size)
        optimizer.zero_grad()
        with Observer() as observed:
            for part in range(micro_batches):
                micro = local.shard(part, micro_batches)
                loss = reference.lm_loss(model(micro.inputs), micro.targets) / micro_batches
                loss.backward()
            optimizer.step()
    return {"parameters": reference.parameters(model), "calls": observed.calls()}


def memory_worker(rank, world_size, stage, model, batches, loss="lm", bucket_mb=None):
    """Two training steps with ZeRO `stage` (stages 1 and 2 bucketed, given bucket_mb). At the
    end of the second backward (the gradients complete, the optimizer state allocated), the
    bytes this rank holds (memory.held_bytes); the bytes it sent during that step, by
    collective; and, stage 3, the most bytes of gathered weights alive at once."""
    loss_fn = reference.lm_loss if loss == "lm" else reference.mse_loss
    trainer = Trainer(copy.deepcopy(model), stage, bucket_mb=bucket_mb)
    for step, batch in enumerate(batches[:2]):
        local = batch.shard(rank, world_size)
        trainer.optimizer.zero_grad()
        with Observer() as observed:
            loss_fn(trainer.module(local.inputs), local.targets).backward()
            trainer.after_backward()
            if step == 1:
                held = held_bytes(trainer.module, trainer.optimizer)
            trainer.optimizer.step()
    gathered = trainer.module.gathered.peak if stage == 3 else 0
    return {"held": held, "sent": observed.sent(), "calls": observed.calls(),
            "gathered peak": gathered}


def torch_model(kind, model, unit="block"):
    """`model` wrapped as PyTorch's own ZeRO: DDP with ZeroRedundancyOptimizer (stage 1), or
    fully_shard (FSDP2, stage 3) on every `unit` and then on the whole model. unit="block": each
    transformer block (or MLP layer), as fully_shard's documentation wraps a transformer;
    unit="layer": each Linear and Embedding, the units of the hand-built FSDP."""
    if kind == "ZeroRedundancyOptimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = nn.parallel.DistributedDataParallel(model)
        adamw, settings = reference.OPTIMIZERS["adamw"]
        return ddp, ZeroRedundancyOptimizer(model.parameters(), adamw, lr=reference.LR,
                                            **settings)
    if kind == "fully_shard":
        from torch.distributed.device_mesh import init_device_mesh

        apply_fsdp(model, init_device_mesh("cpu", (dist.get_world_size(),)), unit=unit)
        return model, reference.make_optimizer("adamw", model.parameters())
    raise ValueError(f"unknown kind {kind!r}; choose one of {TORCH_KINDS}")


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
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):  # shapes only: no rank ever holds the whole model
        model = reference.TinyLM(**model_kwargs).to(dtype)
    apply_fsdp(model, mesh)  # each block, then the model (helpers.layouts)
    model.to_empty(device="cpu")  # memory for this rank's pieces
    set_model_state_dict(model, full_state if rank == 0 else {}, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    optimizer = reference.make_optimizer("adamw", model.parameters())  # on the pieces
    for batch in batches:
        local = batch.shard(rank, world_size)
        optimizer.zero_grad()
        reference.lm_loss(model(local.inputs), local.targets).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)  # the global norm
        optimizer.step()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
    return state if rank == 0 else None


def torch_training_worker(rank, world_size, kind, model, batches):
    """Train a copy of `model` with PyTorch's ZeRO `kind` (TORCH_KINDS). Returns the full
    parameters after the last step."""
    model = copy.deepcopy(model)
    module, optimizer = torch_model(kind, model)
    for batch in batches:
        local = batch.shard(rank, world_size)
        optimizer.zero_grad()
        reference.lm_loss(module(local.inputs), local.targets).backward()
        optimizer.step()
    return {name: param.full_tensor() if hasattr(param, "full_tensor") else param.detach().clone()
            for name, param in model.named_parameters()}


# The hand-built ZeRO-1 and ZeRO-2 that the benchmark times: (stage, bucketed)
SHARDED_OPTIMIZERS = {"readable ZeRO-1": (1, False), "bucketed ZeRO-1": (1, True),
                      "bucketed ZeRO-2": (2, True)}
STAGE_1_2_CONTENDERS = (*SHARDED_OPTIMIZERS, "ZeroRedundancyOptimizer")


def stage_1_2_contenders(model, bucket_mb) -> dict:
    """{name: (module, optimizer, after_backward)} of STAGE_1_2_CONTENDERS, each on its own copy
    of `model`; the BucketedShardedOptimizers with buckets of `bucket_mb` MiB."""
    contenders = {}
    for name, (stage, bucketed) in SHARDED_OPTIMIZERS.items():
        hand = Trainer(copy.deepcopy(model), stage, bucket_mb=bucket_mb if bucketed else None)
        contenders[name] = (hand.module, hand.optimizer, hand.after_backward)
    contenders["ZeroRedundancyOptimizer"] = (
        *torch_model("ZeroRedundancyOptimizer", copy.deepcopy(model)), None)
    return contenders


def stage_1_2_times_worker(rank, world_size, model, batch, iterations, bucket_mb=1.0):
    """The hand-built ZeRO-1 and ZeRO-2 (ShardedOptimizer, and BucketedShardedOptimizer with
    buckets of `bucket_mb` MiB) and DDP with ZeroRedundancyOptimizer, each on its own copy of
    `model`, taking turns as in step_times_worker. Returns the median step time of each (s) and
    the bytes each holds."""
    local = batch.shard(rank, world_size)
    return _take_turns(stage_1_2_contenders(model, bucket_mb), local, iterations)


def stage_1_2_calls_worker(rank, world_size, model, batch, bucket_mb=1.0):
    """One training step of each of STAGE_1_2_CONTENDERS, observed: {name: {collective: calls}}.
    DDP's all-reduces are issued by its C++ reducer, which the observer does not see."""
    local = batch.shard(rank, world_size)
    calls = {}
    for name, (module, optimizer, after_backward) in stage_1_2_contenders(model,
                                                                          bucket_mb).items():
        with Observer() as observed:
            training_step(module, optimizer, reference.lm_loss, local.inputs, local.targets,
                          after_backward)
        calls[name] = observed.calls()
    return calls


def zero_1_timeline_worker(rank, world_size, model, batch, bucket_mb, steps=5):
    """Training steps of the readable and the bucketed ZeRO-1, each on its own copy of `model`,
    observed (helpers.timing.step_timeline): the forward, the backward, the wait for the
    reduce-scatters (bucketed), the optimizer's step, and every reduce-scatter and all-gather
    from its launch to its end. Returns, for each, the step of median time."""
    local = batch.shard(rank, world_size)
    timelines = {}
    for name, buckets in (("readable ZeRO-1", None), ("bucketed ZeRO-1", bucket_mb)):
        trainer = Trainer(copy.deepcopy(model), 1, bucket_mb=buckets)
        timelines[name] = step_timeline(
            trainer.module, trainer.optimizer, reference.lm_loss, local.inputs, local.targets,
            after_backward=None if buckets is None else trainer.after_backward,
            collectives=("reduce_scatter", "all_gather"), steps=steps)
    return timelines


CONTENDERS = ("hand-built per layer", "fully_shard per layer", "hand-built per block",
              "fully_shard per block")


def step_times_worker(rank, world_size, model, batch, iterations):
    """The hand-built ZeRO-3 and fully_shard, each with every Linear and Embedding its own unit
    and with whole blocks as units, each on its own copy of `model`, taking turns; every step
    starts after a barrier and lasts as long as the slowest rank. Returns the median step time
    of each (s) and the bytes of parameters, gradients and optimizer state each holds
    (memory.held_bytes)."""
    local = batch.shard(rank, world_size)
    contenders = {}
    for unit in ("layer", "block"):
        hand = Trainer(copy.deepcopy(model), 3, units="blocks" if unit == "block" else None)
        contenders[f"hand-built per {unit}"] = (hand.module, hand.optimizer, hand.after_backward)
        contenders[f"fully_shard per {unit}"] = (
            *torch_model("fully_shard", copy.deepcopy(model), unit), None)
    with warnings.catch_warnings():
        # fully_shard on a single Linear warns that its output (a view, for 3-D inputs) must not
        # be changed in place; these models never do
        warnings.filterwarnings("ignore", message=".*returned a view tensor")
        return _take_turns(contenders, local, iterations)


def _take_turns(contenders: dict, local, iterations: int):
    """Train each contender, {name: (module, optimizer, after_backward)}, one step after the
    other (helpers.timing). Returns each one's median step time, and the bytes it holds in one
    more step, between backward and the optimizer's step (gradients and optimizer state
    allocated)."""
    steps = {name: functools.partial(training_step, module, optimizer, reference.lm_loss,
                                     local.inputs, local.targets, after_backward)
             for name, (module, optimizer, after_backward) in contenders.items()}
    seconds = take_turns(steps, rounds=iterations)
    held = {}
    for name, (module, optimizer, after_backward) in contenders.items():
        def finish_and_count(name=name, module=module, optimizer=optimizer, finish=after_backward):
            if finish is not None:
                finish()
            held[name] = held_bytes(module, optimizer)
        training_step(module, optimizer, reference.lm_loss, local.inputs, local.targets,
                      finish_and_count)
    return seconds, held
