"""Lesson 06's workers: data-parallel training checked against one process, where equality
breaks, the three ways to average gradients on a measured timeline, torch's DDP, gradient
accumulation, DistributedSampler, bytes per step and checkpoints.

Every worker trains a model from helpers.reference on this rank's slice of each batch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers import reference
from helpers.cost_model import bandwidths
from helpers.data_parallelism.ddp import DDP, average_gradients, bucket_indices
from helpers.how_all_reduce_works.algorithms import ring_all_reduce
from helpers.instrument import Observer
from helpers.timing import slowest_rank_seconds, step_timeline, take_turns, training_step

LOSSES = {"mean": reference.mse_loss,
          "sum": lambda outputs, targets: F.mse_loss(outputs, targets, reduction="sum")}
STRATEGIES = ("naive", "overlapped", "bucketed", "torch_ddp")
LABELS = {"naive": "naive", "overlapped": "overlapped", "bucketed": "bucketed",
          "torch_ddp": "torch DDP"}


def wrap(model: nn.Module, strategy: str, bucket_mb: float = 1.0):
    """The model as `strategy` trains it; returns (the module to call, what to do after
    backward). naive: the lecture's loop after backward; overlapped: DDP, one all_reduce per
    gradient during backward; bucketed: DDP with buckets of `bucket_mb`; torch_ddp: PyTorch's own,
    with the same bucket size."""
    if strategy == "naive":
        return model, lambda: average_gradients(model)
    if strategy in ("overlapped", "bucketed"):
        ddp = DDP(model, bucket_mb=None if strategy == "overlapped" else bucket_mb)
        return ddp, ddp.finish_gradient_synchronization
    if strategy == "torch_ddp":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb), None
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")


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
    with `strategy`. Returns {"parameters": name -> tensor after the last step, "losses": the
    loss of the whole batch at each step (the average of the ranks' losses)}.

    `seed_per_rank` seeds torch's global random generator with the rank, so each rank draws its
    own dropout masks, as independent replicas would."""
    torch.manual_seed(rank if seed_per_rank else 0)
    model = copy.deepcopy(model)
    module, after_backward = wrap(model, strategy, bucket_mb)
    opt = reference.make_optimizer(optimizer, model.parameters(), lr)
    losses = []
    for batch in batches:
        local = my_slice(batch, rank, world_size)
        opt.zero_grad()
        value = LOSSES[loss](module(local.inputs), local.targets)
        value.backward()
        if after_backward:
            after_backward()
        opt.step()
        whole = value.detach().clone()
        dist.all_reduce(whole, op=dist.ReduceOp.AVG)
        losses.append(whole.item())
    return {"parameters": reference.parameters(model), "losses": losses}


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
    backward, every all_reduce (from its launch to its end), the wait for them, and the optimizer
    step. Strategies naive, overlapped or bucketed. Of `steps` steps, returns the one of median
    time (the first is a warm-up): its events [(label, start_s, end_s)] from the step's common
    start, and its time (the slowest rank's)."""
    model = reference.make_mlp(dim, num_layers, seed=0)
    batch = reference.mlp_data(seed=1, batch_size=batch_size, dim=dim)[0].shard(rank, world_size)
    module, after_backward = wrap(model, strategy, bucket_mb)
    opt = reference.make_optimizer("sgd", model.parameters(), 1e-3)
    # naive: every all_reduce, one after another; else: the wait for those backward launched
    finishing = "naive all_reduces" if strategy == "naive" else "wait"
    return step_timeline(module, opt, reference.mse_loss, batch.inputs, batch.targets,
                         after_backward, finishing=finishing, steps=steps)


def step_times_worker(rank, world_size, dim, layers, batch_size, bucket_mb, iterations):
    """Four copies of the same MLP (`layers` Linear(dim, dim)), one per strategy, take turns
    training on this rank's slice of a batch of `batch_size`; every step starts after a barrier
    and lasts as long as the slowest rank. Returns each strategy's median step time (s)."""
    batch = my_slice(reference.mlp_data(seed=1, batch_size=batch_size, dim=dim)[0], rank,
                     world_size)
    contenders = {}
    for strategy in STRATEGIES:
        model = reference.make_mlp(dim, layers, seed=0)
        module, after_backward = wrap(model, strategy, bucket_mb)
        optimizer = reference.make_optimizer("sgd", model.parameters(), 1e-3)
        contenders[strategy] = functools.partial(
            training_step, module, optimizer, reference.mse_loss, batch.inputs, batch.targets,
            after_backward)
    # The first step of each is a warm-up (torch DDP rebuilds its buckets after it).
    return take_turns(contenders, rounds=iterations, warmup=1)


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


def accumulation_worker(rank, world_size, model, batch, micro_batches, lr):
    """Gradient accumulation with DDP.no_sync: the rank's slice is cut into `micro_batches`;
    every backward but the last runs inside no_sync (no communication), each loss scaled by
    1 / micro_batches. Returns the parameters after one SGD step and how many all_reduces each
    variant launched: with no_sync, and averaging after every micro-batch."""
    local = batch.shard(rank, world_size)
    pieces = list(zip(local.inputs.chunk(micro_batches), local.targets.chunk(micro_batches)))
    results = {}
    for variant in ("no_sync", "every micro-batch"):
        replica = copy.deepcopy(model)
        ddp = DDP(replica, bucket_mb=None)
        with Observer() as observed:
            for index, (inputs, targets) in enumerate(pieces):
                last = index == len(pieces) - 1
                quiet = variant == "no_sync" and not last
                with ddp.no_sync() if quiet else contextlib.nullcontext():
                    (reference.mse_loss(ddp(inputs), targets) / micro_batches).backward()
                if not quiet:
                    ddp.finish_gradient_synchronization()
        with torch.no_grad():
            for param in replica.parameters():
                param -= lr * param.grad
        results[variant] = {"parameters": reference.parameters(replica),
                            "all_reduce calls": observed.calls().get("all_reduce", 0)}
    return results


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
