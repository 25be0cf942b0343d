"""Where the capstone's time goes: two of its steps under torch.profiler, on every rank.

- `profile_worker(rank, world_size, config, directory, steps=2)`: the run's model, optimizer and
  step (helpers.capstone.train), one step to warm up, then `steps` steps under
  `torch.profiler.profile` (the CPU's activities: PyTorch's operations and gloo's transfers) with
  the course's Observer inside; each rank writes its trace, a Chrome trace that Perfetto
  (https://ui.perfetto.dev, "Open trace file") or chrome://tracing opens, to
  DIRECTORY/trace.rank<r>.json. Returns what `traces` reads from it: the intervals of compute and
  of communication, in seconds on the trace's clock (the profiler's, one for every process of a
  machine: the ranks' times compare), the totals and their overlap, and the collectives by the
  trace and by the Observer.
- `costs_worker(rank, world_size, configs, steps=2)`: for each config {label: Config}, what one
  choice of the recipe costs on this rank: the bytes a micro-batch's forward and loss leave
  alive for backward (every tensor they made that is still alive, whoever holds it: autograd,
  selective checkpointing's cache, FSDP2's root weights), and the median seconds of a step.
- `matmul_rate_worker(rank, world_size, size, dtype, seconds)`: the floating-point operations
  per second this rank's matrix products reach while every rank runs them at once: the
  machine's own peak, shared as the training shares it.
- `flops_per_token(shape, seq_len)`: torchtitan's count of a model's FLOPs per token
  (helpers.llama's, which lesson 13 also uses).
"""

from __future__ import annotations

import functools
import os

import torch
from torch.profiler import ProfilerActivity, profile

from helpers import instrument
from helpers.at_scale.accounting import make_mesh
from helpers.capstone import traces
from helpers.capstone.corpus import python_source
from helpers.capstone.train import Config, build, dp_rank, make_optimizer, train_step
from helpers.launcher.result import get_device
from helpers.llama import flops_per_token  # noqa: F401 - the notebook calls profiled.flops_per_token
from helpers.timing import Clock, synchronize


def profile_worker(rank, world_size, config: Config, directory, steps: int = 2) -> dict:
    config.check(world_size)
    corpus = python_source()
    mesh = make_mesh(config.plan)
    model = build(config, mesh)
    optimizer, scheduler = make_optimizer(model, config)

    def step(index):
        batch = corpus.batch("train", index, config.batch, config.seq_len, seed=config.seed)
        mine = batch.chunk(config.dp)[dp_rank(mesh)].to(get_device())
        train_step(model, optimizer, scheduler, mine, config)

    step(0)  # the first step builds what later ones reuse: not what a step costs
    with profile(activities=[ProfilerActivity.CPU]) as profiler, \
            instrument.Observer() as observer:
        for index in range(1, steps + 1):
            step(index)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"trace.rank{rank}.json")
    profiler.export_chrome_trace(path)
    found = traces.intervals(traces.read_trace(path))
    seconds = {kind: [(begin * traces.MICROSECONDS, end * traces.MICROSECONDS)
                      for begin, end in spans] for kind, spans in found.items()}
    return {"trace": path, "intervals": seconds, "breakdown": traces.breakdown(path),
            "observer": observer.calls()}


def costs_worker(rank, world_size, configs: dict, steps: int = 2) -> dict:
    import statistics

    from helpers.capstone.train import next_token_loss, parallel_loss
    from helpers.instrument import alive_bytes, created_storages
    from helpers.timing import slowest_rank_seconds

    corpus, found = python_source(), {}
    for label, config in configs.items():
        config.check(world_size)
        mesh = make_mesh(config.plan)
        model = build(config, mesh)
        optimizer, scheduler = make_optimizer(model, config)
        batch = corpus.batch("train", 0, config.batch, config.seq_len, seed=config.seed)
        mine = batch.chunk(config.dp)[dp_rank(mesh)].to(get_device())
        with parallel_loss(config):  # (also the first forward and backward: a warm-up)
            with created_storages() as created:
                loss = next_token_loss(model, mine.chunk(config.micro_batches)[0])
            kept = alive_bytes(created)  # (the loss itself: a few bytes)
            loss.backward()
        optimizer.zero_grad()
        step = functools.partial(train_step, model, optimizer, scheduler, mine, config)
        seconds = [slowest_rank_seconds(step) for _ in range(steps)]
        found[label] = {"kept": kept, "seconds": statistics.median(seconds)}
    return found


def matmul_rate_worker(rank, world_size, size: int = 512, dtype=torch.bfloat16,
                       seconds: float = 1.0) -> float:
    """FLOP/s of (size x size) @ (size x size) products, repeated for about `seconds`."""
    a = torch.randn(size, size, device=get_device()).to(dtype)
    b = torch.randn(size, size, device=get_device()).to(dtype)
    a @ b  # the first call pays for setup
    torch.distributed.barrier()  # every rank starts together: they share the cores
    clock, products = Clock(), 0
    while clock() < seconds:
        a @ b
        products += 1
    synchronize()
    return 2 * size ** 3 * products / clock()
