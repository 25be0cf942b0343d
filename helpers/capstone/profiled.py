"""Where the capstone's time goes: two of its steps under torch.profiler, on every rank.

- `profile_worker(rank, world_size, config, directory, steps=2)`: the run's model, optimizer and
  step (helpers.capstone.train), one step to warm up, then `steps` steps under
  `torch.profiler.profile` (the CPU's activities: PyTorch's operations and gloo's transfers) with
  the course's Observer inside; each rank writes its trace, a Chrome trace that Perfetto
  (https://ui.perfetto.dev, "Open trace file") or chrome://tracing opens, to
  DIRECTORY/trace.rank<r>.json. Returns what `traces` reads from it: the intervals of compute and
  of communication (and of each owner's: "communication FSDP2", "communication DTensor"), in
  seconds on the trace's clock (the profiler's, one for every process of a machine: the ranks'
  times compare), the totals and their overlap by owner, and the collectives by the trace and
  by the Observer.
- `costs_worker(rank, world_size, configs, steps=2)`: for each config {label: Config}, what one
  choice of the recipe costs on this rank: the bytes a micro-batch's forward and loss leave
  alive for backward (every tensor they made that is still alive, whoever holds it: autograd,
  selective checkpointing's cache, FSDP2's root weights), and the median seconds of a step.
- `step_seconds_worker(rank, world_size, config, layouts, rounds=2)`: the median seconds of a
  step of `config`'s recipe (its whole batch, micro-batches, recomputation, bfloat16, clipping,
  AdamW) under each of `layouts`, taking turns (`timing.take_turns`), keys of LAYOUTS:
  "one_process" (1 rank, a plain model, bfloat16 by autocast), "ddp" (DistributedDataParallel
  over every rank, autocast), "fsdp2" (FSDP2 alone over every rank, as the plan does it) and
  "fsdp2_tp" (the plan: dp = ranks / 2 x tp 2).
- `matmul_rate_worker(rank, world_size, size, dtype, seconds, windows)`: the floating-point
  operations per second this rank's matrix products reach in each of `windows` windows, while
  every rank runs them at once: the machine's own peak, shared as the training shares it.
- `precision_worker(rank, world_size, config)` and `precision_in_forward(model, tokens)`: the
  dtypes a forward really computes in: the residual stream (a block's output), a norm's output
  and the norm's weight as the forward uses it; under FSDP2's MixedPrecisionPolicy on the ranks,
  or under autocast in one process (`autocast=True`; `precision_one_process(config)`).
- `communication_by_owner(profiles)`: profile_worker's split of the communication by owner
  (FSDP2's, DTensor's), every rank's added up.
- `flops_per_token(shape, seq_len)`: torchtitan's count of a model's FLOPs per token
  (helpers.llama's, which lesson 13 also uses).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

from helpers import instrument, layouts
from helpers.capstone import traces
from helpers.capstone.corpus import python_source
from helpers.capstone.train import (
    Config,
    at_least_float32,
    build,
    dp_rank,
    make_optimizer,
    train_step,
)
from helpers.launcher.result import get_device
from helpers.layouts import make_mesh
from helpers.llama import (
    Llama,
    flops_per_token,  # noqa: F401 - the notebook calls profiled.flops_per_token
    init_weights,
)
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
    events = traces.read_trace(path)
    found = traces.intervals(events)
    found |= {f"communication {owner}": parts["communication"]
              for owner, parts in traces.owners(events, found).items() if owner in traces.OWNERS}
    seconds = {kind: [(begin * traces.MICROSECONDS, end * traces.MICROSECONDS)
                      for begin, end in spans] for kind, spans in found.items()}
    return {"trace": path, "intervals": seconds, "breakdown": traces.breakdown(path),
            "observer": observer.calls()}


def communication_by_owner(profiles: list) -> dict:
    """Every rank's `traces.owners` split (profile_worker's results), in seconds, added up:
    {"FSDP2" / "DTensor": {"communication", "overlap", "exposed", "waiting"}, "exposed_where":
    {"FSDP2", "DTensor", "elsewhere"}}."""
    first = profiles[0]["breakdown"]["owners"]
    return {owner: {what: sum(found["breakdown"]["owners"][owner][what] for found in profiles)
                    for what in parts} for owner, parts in first.items()}


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
                       seconds: float = 0.2, windows: int = 5) -> list:
    """FLOP/s of (size x size) @ (size x size) products, repeated for about `seconds`, in each
    of `windows` windows that every rank starts together (they share the cores)."""
    a = torch.randn(size, size, device=get_device()).to(dtype)
    b = torch.randn(size, size, device=get_device()).to(dtype)
    a @ b  # the first call pays for setup
    rates = []
    for _ in range(windows):
        torch.distributed.barrier()
        clock, products = Clock(), 0
        while clock() < seconds:
            a @ b
            products += 1
        synchronize()
        rates.append(2 * size ** 3 * products / clock())
    return rates


def precision_in_forward(model, tokens, autocast: bool = False) -> dict:
    """{what: dtype name} seen in one forward of `model` (a helpers.llama.Llama, laid out or
    not) on `tokens`: its first block's output (the residual stream), its first norm's output,
    and that norm's weight as the forward uses it (FSDP2 casts it before the forward)."""
    block, seen = model.layers[0], {}

    def output(name):
        def hook(module, inputs, result):
            seen[name] = str(getattr(result, "dtype", None)).replace("torch.", "")
            if name == "a norm's output":
                seen["the norm's weight, as used"] = str(module.weight.dtype).replace("torch.", "")
        return hook

    handles = [block.register_forward_hook(output("the residual stream (a block's output)")),
               block.attention_norm.register_forward_hook(output("a norm's output"))]
    try:
        with torch.no_grad(), torch.autocast(get_device().type, torch.bfloat16,
                                             enabled=autocast):
            model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def precision_one_process(config: Config) -> dict:
    """precision_in_forward of the plan's model in this process, as one_process runs it (its
    bfloat16 autocast's)."""
    model = init_weights(Llama(config.shape, max_seq_len=config.seq_len), seed=config.seed)
    tokens = python_source().batch("train", 0, 1, config.seq_len, seed=config.seed)
    return precision_in_forward(model, tokens[:, :-1], autocast=config.bf16)


def precision_worker(rank, world_size, config: Config) -> dict:
    """precision_in_forward of the plan's model, laid out by `config` on the ranks."""
    config.check(world_size)
    mesh = make_mesh(config.plan)
    model = build(config, mesh)
    tokens = python_source().batch("train", 0, config.batch, config.seq_len, seed=config.seed)
    return precision_in_forward(model, tokens.chunk(config.dp)[dp_rank(mesh)][:1, :-1])


# --- the same batch under other layouts ---------------------------------------------------------

# a layout's key: its label
LAYOUTS = {"one_process": "one process", "ddp": "DDP", "fsdp2": "FSDP2", "fsdp2_tp": "FSDP2 + TP"}
SPREAD = ("ddp", "fsdp2", "fsdp2_tp")  # the layouts over several ranks


def step_seconds_worker(rank, world_size, config: Config, layouts=SPREAD,
                        rounds: int = 2) -> dict:
    """{layout: median seconds of a step (the slowest rank's)}, after a step of each to warm
    up; the layouts take turns, so a slow spell of a shared machine falls on all of them."""
    from helpers.timing import take_turns

    batch = python_source().batch("train", 0, config.batch, config.seq_len, seed=config.seed)
    steps = {layout: layout_step(config, layout, world_size, batch) for layout in layouts}
    return take_turns(steps, rounds=rounds)


def layout_step(config: Config, layout: str, world_size: int, batch):
    """A function that runs one step of `config`'s recipe on this rank's share of `batch`
    (every rank's together: the same whole batch whatever the layout), laid out as `layout`."""
    if layout in ("fsdp2", "fsdp2_tp"):
        tp = 2 if layout == "fsdp2_tp" else 1
        config = replace(config, dp=world_size // tp, tp=tp)
        mesh = make_mesh(config.plan)
        model = build(config, mesh)
        optimizer, scheduler = make_optimizer(model, config)
        mine = batch.chunk(config.dp)[dp_rank(mesh)].to(get_device())
        return functools.partial(train_step, model, optimizer, scheduler, mine, config)
    if (layout == "one_process") != (world_size == 1) or layout not in LAYOUTS:
        raise ValueError(f"{layout!r} on {world_size} ranks: the layouts are "
                         f"{', '.join(LAYOUTS)}, 'one_process' on 1 rank only")
    model = Llama(config.shape, max_seq_len=config.seq_len)
    model = init_weights(model.double() if config.float64 else model, seed=config.seed)
    layouts.apply_ac(model, config.recompute)
    model.to(get_device())
    if layout == "ddp":
        model = DistributedDataParallel(model)
    optimizer, scheduler = make_optimizer(model, config)
    mine = batch.chunk(world_size)[torch.distributed.get_rank()].to(get_device())
    return functools.partial(plain_step, model, optimizer, scheduler, mine, config)


def plain_step(model, optimizer, scheduler, tokens, config: Config) -> None:
    """train_step's recipe for a model of plain tensors (one process, or DDP: gradients
    all-reduced after the last micro-batch only), its bfloat16 autocast's."""
    parts = tokens.chunk(config.micro_batches)
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else \
                model.no_sync():
            with torch.autocast(get_device().type, torch.bfloat16, enabled=config.bf16):
                logits = model(part[:, :-1])
            loss = F.cross_entropy(at_least_float32(logits.flatten(0, 1)),
                                   part[:, 1:].flatten()) / len(parts)
            loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
