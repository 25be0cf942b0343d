"""Lesson 06's workers: data-parallel training checked against one process, where equality
breaks, the three ways to average gradients on a measured timeline, torch's DDP, gradient
accumulation, DistributedSampler, bytes per step and checkpoints.

Every worker trains a model from helpers.reference on this rank's slice of each batch.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers import reference, strategies
from helpers.cost_model import bandwidths
from helpers.data_parallelism.ddp import average_gradients, bucket_indices
from helpers.how_all_reduce_works.algorithms import ring_all_reduce
from helpers.instrument import Observer
from helpers.launcher.result import get_device
from helpers.timing import slowest_rank_seconds, step_timeline, take_turns

LOSSES = {"mean": reference.mse_loss,
          "sum": lambda outputs, targets: F.mse_loss(outputs, targets, reduction="sum")}
# The four ways to average gradients: {key: (strategy, build options)} (helpers.strategies)
STRATEGIES = {"naive": ("naive", {}), "overlapped": ("ddp", {"bucket_mb": None}),
              "bucketed": ("ddp", {}), "torch_ddp": ("torch_ddp", {})}
LABELS = {"naive": "naive", "overlapped": "overlapped", "bucketed": "bucketed",
          "torch_ddp": "torch DDP"}


def contenders(bucket_mb: float = 1.0, optimizer: str = "adamw", lr: float = 1e-2) -> dict:
    """STRATEGIES as strategies.build takes them, {key: (name, options)}: naive, the lecture's
    loop at the end of backward; overlapped, DDP with one all_reduce per gradient during
    backward; bucketed, DDP with buckets of `bucket_mb`; torch_ddp, PyTorch's own, with the same
    bucket size."""
    return {key: (name, {"bucket_mb": bucket_mb, **options, "optimizer": optimizer, "lr": lr}
                  if name != "naive" else {"optimizer": optimizer, "lr": lr})
            for key, (name, options) in STRATEGIES.items()}


def my_slice(batch: reference.Batch, rank: int, world_size: int) -> reference.Batch:
    """This rank's part of the batch: tensor_split, so sizes that do not divide are allowed (the
    parts then differ in length by one)."""
    return reference.Batch(batch.inputs.tensor_split(world_size)[rank],
                           batch.targets.tensor_split(world_size)[rank])


def simple_data_parallel_worker(rank, world_size, model, batches):
    """The data-parallel loop, all of it: single-process AdamW training, on this rank's slice of
    every batch, with one line added. Returns the parameters after the last step."""
    model = copy.deepcopy(model)  # this rank's replica (every rank receives the same weights)
    optimizer = reference.make_optimizer("adamw", model.parameters(), lr=1e-2)
    for batch in batches:
        local = batch.shard(rank, world_size)  # this rank's B/n samples
        optimizer.zero_grad()
        reference.mse_loss(model(local.inputs), local.targets).backward()
        average_gradients(model)  # the distributed line: every gradient averaged over the ranks
        optimizer.step()
    return reference.parameters(model)


def data_parallel_worker(rank, world_size, model, batches, strategy="naive", bucket_mb=1.0,
                         optimizer="adamw", lr=1e-2, loss="mean", seed_per_rank=False):
    """Train a replica of `model` on this rank's slice of every batch, averaging the gradients
    with `strategy` (STRATEGIES). Returns {"parameters": name -> tensor after the last step,
    "losses": the loss of the whole batch at each step (the average of the ranks' losses)}.

    `seed_per_rank` seeds torch's global random generator with the rank, so each rank draws its
    own dropout masks, as independent replicas would."""
    torch.manual_seed(rank if seed_per_rank else 0)
    name, options = contenders(bucket_mb, optimizer, lr)[strategy]
    module, opt = strategies.build(name, copy.deepcopy(model), **options)
    losses = []
    for batch in batches:
        local = my_slice(batch, rank, world_size).to(get_device())
        opt.zero_grad()
        value = LOSSES[loss](module(local.inputs), local.targets)
        value.backward()
        opt.step()
        whole = value.detach().clone()
        dist.all_reduce(whole, op=dist.ReduceOp.AVG)
        losses.append(whole.item())
    return {"parameters": strategies.full_parameters(module), "losses": losses}


def _dropout_model():
    return reference.seeded(0, lambda: nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5),
                                                      nn.Linear(16, 16)))


def _batch_norm_model():
    return reference.seeded(0, lambda: nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16),
                                                      nn.Linear(16, 16)))


# Data parallelism against one process: the case that holds, then the four that break it.
# {key: its label on screen, and how it differs from the default (experiments.py)}
EQUALITY_CASES = {
    "mean_loss": dict(label="mean loss, 8 samples"),
    "sum_loss": dict(label="sum loss", loss="sum"),
    "uneven_batch": dict(label="6 samples on 4 ranks", batch_size=6),
    "dropout": dict(label="dropout", model=_dropout_model, seed_per_rank=True),
    "batch_norm": dict(label="batch norm", model=_batch_norm_model),
}

# How replicas start: {key: its label on screen}
REPLICA_STARTS = {"same_seed": "same seed on every rank", "seed_by_rank": "seed = rank",
                  "broadcast": "seed = rank, then rank 0's broadcast"}


def replicas_worker(rank, world_size, start, steps):
    """Replicas trained with averaged gradients (SGD), starting from `start`, a key of
    REPLICA_STARTS. Returns, after each step, the largest difference between this rank's weights
    and rank 0's."""
    model = reference.make_mlp(dim=16, num_layers=3, seed=0 if start == "same_seed" else rank)
    if start == "broadcast":
        for param in model.parameters():  # what DDP does at construction
            dist.broadcast(param.data, src=0)
    opt = reference.make_optimizer("sgd", model.parameters(), 0.1)
    spread = []
    for batch in reference.mlp_data(seed=3, batch_size=12, dim=16, steps=steps):
        local = batch.shard(rank, world_size)
        opt.zero_grad()
        reference.mse_loss(model(local.inputs), local.targets).backward()
        average_gradients(model)
        opt.step()
        flat = torch.cat([param.detach().flatten() for param in model.parameters()])
        rank_0 = flat.clone()
        dist.broadcast(rank_0, src=0)
        spread.append((flat - rank_0).abs().max().item())
    return spread


def timeline_worker(rank, world_size, strategy, bucket_mb, dim, num_layers, batch_size, steps=7):
    """Training steps of an MLP of `num_layers` Linear(dim, dim), measured: the forward, the
    backward, every all_reduce (from its launch to its end), the wait for them at the end of
    backward, and the optimizer step. Strategies naive, overlapped or bucketed. Of `steps` steps,
    returns the one of median time (the first is a warm-up): its events [(label, start_s, end_s)]
    from the step's common start, and its time (the slowest rank's)."""
    model = reference.make_mlp(dim, num_layers, seed=0)
    batch = reference.mlp_data(seed=1, batch_size=batch_size, dim=dim)[0].shard(rank, world_size)
    batch = batch.to(get_device())
    name, options = contenders(bucket_mb, "sgd", 1e-3)[strategy]
    module, opt = strategies.build(name, model, **options)
    return step_timeline(module, opt, reference.mse_loss, batch.inputs, batch.targets,
                         steps=steps)


def step_times_worker(rank, world_size, dim, layers, batch_size, bucket_mb, iterations):
    """The MLP (`layers` Linear(dim, dim)) trained by each of STRATEGIES, taking turns on this
    rank's slice of a batch of `batch_size` (strategies.step_times_worker). Returns each
    strategy's median step time (s)."""
    batch = reference.mlp_data(seed=1, batch_size=batch_size, dim=dim)[0]
    return strategies.step_times_worker(
        rank, world_size, contenders(bucket_mb, "sgd", 1e-3),
        model=reference.make_mlp(dim, layers, seed=0), batch=batch, iterations=iterations,
        loss="mse")["seconds"]


def back_to_back_worker(rank, world_size, sizes, repeats=10):
    """The time of one all_reduce of each of `sizes` (bytes) when calls follow each other with
    nothing in between, as DDP's do: `repeats` calls timed together, divided by `repeats` (the
    slowest rank's). Returns lesson 04's records (`bandwidths`), ready for `fit_alpha_beta`."""
    records = []
    for size in sizes:
        tensor = torch.randn(size // 4)
        dist.all_reduce(tensor)  # warm-up

        def calls(tensor=tensor):
            for _ in range(repeats):
                dist.all_reduce(tensor)

        seconds = slowest_rank_seconds(calls) / repeats
        records.append(bandwidths("all_reduce", world_size, size, seconds))
    return records


def averaging_time_worker(rank, world_size, sizes, bucket_sizes, repeats=5):
    """How long averaging gradients of these `sizes` (numbers of float32, in parameter order)
    takes after backward, with buckets of each of `bucket_sizes` (bytes; None: one all_reduce
    per gradient). Buckets are cut as DDP cuts them, from the last gradient. Returns, for each
    bucket size, the median time in seconds (the slowest rank's) and the buckets' sizes."""
    grads = [torch.randn(size) for size in reversed(sizes)]
    buckets = {}
    for bucket_bytes in bucket_sizes:
        indices = bucket_indices([grad.numel() * 4 for grad in grads], bucket_bytes)
        buckets[bucket_bytes] = [torch.cat([grads[i] for i in bucket]) for bucket in indices]

    def averaging(tensors):
        return lambda: [dist.all_reduce(bucket, op=dist.ReduceOp.AVG) for bucket in tensors]

    seconds = take_turns({bucket_bytes: averaging(tensors)
                          for bucket_bytes, tensors in buckets.items()}, rounds=repeats)
    return {bucket_bytes: {"seconds": seconds[bucket_bytes],
                           "bucket bytes": [b.numel() * 4 for b in buckets[bucket_bytes]]}
            for bucket_bytes in bucket_sizes}


def sampler_worker(rank, world_size, dataset_size, epochs, drop_last):
    """The indices DistributedSampler gives this rank, epoch by epoch (shuffled, set_epoch)."""
    sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=0, drop_last=drop_last)
    indices = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        indices.append(list(sampler))
    return indices


def bytes_per_step_worker(rank, world_size, model, batch):
    """One training step whose gradients are summed by lesson 05's ring all-reduce. Returns the
    bytes this rank sent and the gradients' bytes."""
    local = batch.shard(rank, world_size)
    reference.mse_loss(model(local.inputs), local.targets).backward()
    grads = torch.cat([param.grad.flatten() for param in model.parameters()])
    with Observer() as observed:
        ring_all_reduce(grads)
    return {"bytes sent": observed.sent()["batch_isend_irecv"],
            "gradient bytes": grads.numel() * grads.element_size()}


def training_loop_worker(rank, world_size, model, inputs, targets, batch_size, accumulation,
                         epochs, directory):
    """A complete data-parallel training loop with PyTorch's own tools: a DistributedSampler
    feeding a DataLoader, DistributedDataParallel, gradient accumulation with no_sync, the loss
    averaged over the ranks for the log, and a checkpoint of model and optimizer written by
    rank 0 and read back by every rank. Returns the parameters, the logged losses, and whether
    each rank's reloaded model and optimizer equal the ones it trained."""
    dataset = TensorDataset(inputs, targets)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)  # this rank's batches
    model = nn.parallel.DistributedDataParallel(copy.deepcopy(model))  # broadcasts rank 0's
    optimizer = reference.make_optimizer("adamw", model.parameters(), lr=1e-2)
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new order every epoch, the same on every rank
        running = torch.zeros(())
        for index, (x, y) in enumerate(loader):
            synchronize = (index + 1) % accumulation == 0
            with contextlib.nullcontext() if synchronize else model.no_sync():
                loss = F.mse_loss(model(x), y) / accumulation
                loss.backward()  # the last micro-batch's backward averages the sums
            running += loss.detach()
            if synchronize:
                optimizer.step()
                optimizer.zero_grad()
                dist.all_reduce(running, op=dist.ReduceOp.AVG)  # the global batch's loss
                losses.append(running.item())
                running = torch.zeros(())
    path = os.path.join(directory, "checkpoint.pt")
    if rank == 0:  # the replicas are identical: one writer is enough
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                   path)
    dist.barrier()  # nobody reads before the file is complete
    checkpoint = torch.load(path, weights_only=True)
    restored = copy.deepcopy(model.module)
    restored.load_state_dict(checkpoint["model"])
    restored_optimizer = reference.make_optimizer("adamw", restored.parameters(), lr=1e-2)
    restored_optimizer.load_state_dict(checkpoint["optimizer"])
    same = all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(),
                                                  model.module.state_dict().values()))
    same_state = all(torch.equal(a, b) for state, twin in zip(
        restored_optimizer.state.values(), optimizer.state.values())
        for a, b in zip(state.values(), twin.values()))
    return {"parameters": reference.parameters(model.module), "losses": losses,
            "reloaded": same and same_state}
