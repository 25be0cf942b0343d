"""Lesson 06's workers: data-parallel training checked against one process, where equality
breaks, the three ways to average gradients on a measured timeline, torch's DDP, gradient
accumulation, DistributedSampler, bytes per step and checkpoints.

Every worker trains a model from helpers.reference on this rank's slice of each batch.
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers import reference
from helpers.data_parallelism.ddp import DDP, average_gradients, bucket_indices
from helpers.timing import timed_step

LOSSES = {"mean": reference.mse_loss,
          "sum": lambda outputs, targets: F.mse_loss(outputs, targets, reduction="sum")}
STRATEGIES = ("naive", "overlapped", "bucketed", "torch DDP")


def wrap(model: nn.Module, strategy: str, bucket_mb: float = 1.0, timeline: list | None = None):
    """The model as `strategy` trains it; returns (the module to call, what to do after
    backward). naive: the lecture's loop after backward; overlapped: DDP, one all_reduce per
    gradient during backward; bucketed: DDP with buckets of `bucket_mb`; torch DDP: PyTorch's own,
    with the same bucket size."""
    if strategy == "naive":
        return model, lambda: average_gradients(model, timeline=timeline)
    if strategy in ("overlapped", "bucketed"):
        ddp = DDP(model, bucket_mb=None if strategy == "overlapped" else bucket_mb,
                  timeline=timeline)
        return ddp, ddp.finish_gradient_synchronization
    if strategy == "torch DDP":
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
EQUALITY_CASES = {
    "mean loss, 8 samples": dict(),
    "sum loss": dict(loss="sum"),
    "6 samples on 4 ranks": dict(batch_size=6),
    "dropout": dict(model=_dropout_model, seed_per_rank=True),
    "batch norm": dict(model=_batch_norm_model),
}


def compare_with_one_process(case: str, world_size: int = 4, steps: int = 5) -> float:
    """Train the model of `case` (EQUALITY_CASES) for `steps` SGD steps on one process with the
    whole batch, and on `world_size` ranks with the naive loop; return the largest difference
    between the two runs' parameters. (Runs in the kernel: it launches the ranks.)"""
    from helpers.launcher import run

    options = EQUALITY_CASES[case]
    model = options.get("model", lambda: reference.make_mlp(dim=16, num_layers=3, seed=0))()
    batches = reference.mlp_data(seed=1, batch_size=options.get("batch_size", 8), dim=16,
                                 steps=steps)
    loss = options.get("loss", "mean")
    torch.manual_seed(0)  # the single process's dropout masks
    single = reference.train(model, batches, LOSSES[loss], optimizer="sgd", lr=0.01)
    parallel = run(data_parallel_worker, world_size,
                   args=(model, batches, "naive", 1.0, "sgd", 0.01, loss,
                         options.get("seed_per_rank", False)), show_output=False)[0]
    return max((parallel["parameters"][name] - param).abs().max().item()
               for name, param in single.parameters.items())


REPLICA_STARTS = ("same seed on every rank", "seed = rank", "seed = rank, then rank 0's broadcast")


def replicas_worker(rank, world_size, start, steps):
    """Replicas trained with averaged gradients (SGD), starting from `start`, one of
    REPLICA_STARTS. Returns, after each step, the largest difference between this rank's weights
    and rank 0's."""
    model = reference.make_mlp(dim=16, num_layers=3, seed=0 if start == REPLICA_STARTS[0] else rank)
    if start == REPLICA_STARTS[2]:
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
    comm = []
    module, after_backward = wrap(model, strategy, bucket_mb, timeline=comm)
    opt = reference.make_optimizer("sgd", model.parameters(), 1e-3)
    measured = []
    for _ in range(steps):
        comm.clear()
        events = []
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        loss = reference.mse_loss(module(batch.inputs), batch.targets)
        events.append(("forward", 0.0, time.perf_counter() - start))
        began = time.perf_counter()
        loss.backward()  # the overlapped strategies launch their all_reduces in here
        events.append(("backward", began - start, time.perf_counter() - start))
        began = time.perf_counter()
        after_backward()  # naive: every all_reduce, one after another; else: wait for them
        events.append(("naive all_reduces" if strategy == "naive" else "wait",
                       began - start, time.perf_counter() - start))
        began = time.perf_counter()
        opt.step()
        events.append(("step", began - start, time.perf_counter() - start))
        seconds = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # every rank gets the same times
        events += [("all_reduce", launched - start, ended - start) for _, launched, ended in comm]
        measured.append({"events": events, "step_seconds": seconds.item()})
    later = sorted(measured[1:], key=lambda step: step["step_seconds"])
    return later[len(later) // 2]


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
        contenders[strategy] = (module, after_backward,
                                reference.make_optimizer("sgd", model.parameters(), 1e-3))
    timings = {strategy: [] for strategy in STRATEGIES}
    for _ in range(iterations + 1):
        for strategy, (module, after_backward, optimizer) in contenders.items():
            timings[strategy].append(timed_step(module, optimizer, reference.mse_loss,
                                                batch.inputs, batch.targets, after_backward))
    # The first step of each is a warm-up (torch DDP rebuilds its buckets after it).
    return {strategy: statistics.median(values[1:]) for strategy, values in timings.items()}


def back_to_back_worker(rank, world_size, sizes, repeats=10):
    """The time of one all_reduce of each of `sizes` (bytes) when calls follow each other with
    nothing in between, as DDP's do: `repeats` calls timed together, divided by `repeats` (the
    slowest rank's). Returns lesson 04's records (`bandwidths`), ready for `fit_alpha_beta`."""
    from helpers.cost_model import bandwidths

    records = []
    for size in sizes:
        tensor = torch.randn(size // 4)
        dist.all_reduce(tensor)  # warm-up
        dist.barrier()
        started = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(tensor)
        seconds = torch.tensor([(time.perf_counter() - started) / repeats])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        records.append(bandwidths("all_reduce", world_size, size, seconds.item()))
    return records


def averaging_time_worker(rank, world_size, sizes, bucket_sizes, repeats=5):
    """How long averaging gradients of these `sizes` (numbers of float32, in parameter order)
    takes after backward, with buckets of each of `bucket_sizes` (bytes; None: one all_reduce
    per gradient). Buckets are cut as DDP cuts them, from the last gradient. Returns, for each
    bucket size, the median time in seconds (the slowest rank's) and the buckets' sizes."""
    grads = [torch.randn(size) for size in reversed(sizes)]
    contenders = {}
    for bucket_bytes in bucket_sizes:
        indices = bucket_indices([grad.numel() * 4 for grad in grads], bucket_bytes)
        contenders[bucket_bytes] = [torch.cat([grads[i] for i in bucket]) for bucket in indices]
    timings = {bucket_bytes: [] for bucket_bytes in bucket_sizes}
    for _ in range(repeats + 1):  # the first round is a warm-up
        for bucket_bytes, buckets in contenders.items():
            dist.barrier()
            started = time.perf_counter()
            for bucket in buckets:
                dist.all_reduce(bucket, op=dist.ReduceOp.AVG)
            seconds = torch.tensor([time.perf_counter() - started])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            timings[bucket_bytes].append(seconds.item())
    return {bucket_bytes: {"seconds": sorted(values[1:])[repeats // 2],
                           "bucket bytes": [b.numel() * 4 for b in contenders[bucket_bytes]]}
            for bucket_bytes, values in timings.items()}


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
                            "all_reduce calls": ddp.all_reduce_calls}
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
    """One training step whose gradients are averaged by lesson 05's ring all-reduce, which
    counts the bytes it sends. Returns those bytes and the gradients' bytes."""
    from helpers.how_all_reduce_works.algorithms import ring_all_reduce

    local = batch.shard(rank, world_size)
    reference.mse_loss(model(local.inputs), local.targets).backward()
    grads = torch.cat([param.grad.flatten() for param in model.parameters()])
    sent = ring_all_reduce(grads)
    return {"bytes sent": sent, "gradient bytes": grads.numel() * grads.element_size()}


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
