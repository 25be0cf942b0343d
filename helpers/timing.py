"""The course's one definition of "how long a step takes" across ranks, used by every figure and
benchmark that times one: a step starts on every rank after a barrier and lasts as long as its
slowest rank; contenders compared in one run take turns, round after round, and each is
summarised by its median after a warm-up.

    Clock()                                   seconds since it was made
    timestamp()                               seconds since the epoch, for logs across restarts
    slowest_rank_seconds(step, group)         one call of step(), timed on the slowest rank
    take_turns(contenders, rounds, warmup)    {name: median seconds}, contenders interleaved
    training_step(module, optimizer, ...)     zero_grad, forward, backward, step
    step_timeline(module, optimizer, ...)     the same step, observed: its compute spans and
                                              collectives, for drawing.plot_step_timelines
    observed_training(module, optimizer, ...) a step per batch on this rank's slice; the last
                                              step's Observer (its calls and bytes)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist

from helpers.instrument import TABLE_NAME, Observer
from helpers.launcher.result import get_device


class Clock:
    """Seconds since it was made (time.perf_counter: one clock for every process of a machine),
    for events that do not nest as spans do: a background write that ends in another thread."""

    def __init__(self):
        self.origin = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.origin


def timestamp() -> float:
    """Seconds since the epoch (time.time): comparable across processes, machines and restarts,
    for logs that several runs of a job write."""
    return time.time()


def synchronize() -> None:
    """Wait for the work queued on this rank's GPU, if it has one (get_device()): CUDA kernels
    and NCCL's collectives return before they are done, so a clock read without this times
    their launch only (lesson 04)."""
    if get_device().type == "cuda":
        torch.cuda.synchronize()


def slowest_rank_seconds(step: Callable[[], object], group=None) -> float:
    """Every rank of `group` waits for the others, runs `step()`, and gets the seconds of the
    slowest one. Every rank must call it."""
    dist.barrier(group=group)
    synchronize()
    started = time.perf_counter()
    step()
    synchronize()  # a GPU's kernels and NCCL's collectives run after their calls return
    return slowest(time.perf_counter() - started, group)


def slowest(seconds: float, group=None) -> float:
    """The largest of every rank's `seconds` in `group`: a step lasts as long as its slowest
    rank. Every rank must call it."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value.item()


def take_turns(contenders: dict[Hashable, Callable[[], object]], rounds: int, warmup: int = 1,
               group=None) -> dict[Hashable, float]:
    """Each round runs every contender once, one after the other (so a slow spell of a shared
    machine falls on all of them); returns each one's median seconds (slowest rank) over the
    `rounds` after `warmup` rounds."""
    timings = {name: [] for name in contenders}
    for round_ in range(warmup + rounds):
        for name, step in contenders.items():
            seconds = slowest_rank_seconds(step, group)
            if round_ >= warmup:
                timings[name].append(seconds)
    return {name: statistics.median(values) for name, values in timings.items()}


def training_step(module, optimizer, loss_fn, inputs, targets) -> None:
    """One training step, as every strategy of helpers.strategies is trained: zero_grad,
    forward, backward (which finishes a hand-built strategy's gradient sync at its end), step."""
    optimizer.zero_grad()
    loss_fn(module(inputs), targets).backward()
    optimizer.step()


def observed_training(module, optimizer, loss_fn, batches, rank, world_size) -> Observer:
    """One training step per batch on this rank's slice of it (training_step), the last one
    observed: returns its Observer, whose calls and bytes are one step's."""
    for batch in batches:
        local = batch.shard(rank, world_size).to(get_device())
        with Observer() as observed:
            training_step(module, optimizer, loss_fn, local.inputs, local.targets)
    return observed


def step_timeline(module, optimizer, loss_fn, inputs, targets, collectives=("all_reduce",),
                  steps=7) -> dict:
    """`steps` training steps (the first a warm-up), each observed: the spans forward, backward
    and step, the spans a strategy marks inside them (instrument.span: DDP's "wait" at the end
    of backward), and every call of `collectives` from its launch to its completion. Returns the
    step of median time: {"events": [(label, start_s, end_s)] from the step's start, a marked
    span cut out of the span around it, "step_seconds": the slowest rank's}. Every rank must
    call it."""
    measured = []
    for _ in range(steps):
        observed = Observer()

        def step(observed=observed):
            with observed:
                optimizer.zero_grad()
                with observed.span("forward"):
                    loss = loss_fn(module(inputs), targets)
                with observed.span("backward"):
                    loss.backward()
                with observed.span("step"):
                    optimizer.step()

        seconds = slowest_rank_seconds(step)
        start = min(span.start for span in observed.spans)
        events = [(label, begin - start, end - start)
                  for label, begin, end in cut_out_inner(observed.spans)]
        events += [(TABLE_NAME.get(record.name, record.name), record.launched - start,
                    record.completed - start) for record in observed.records
                   if TABLE_NAME.get(record.name, record.name) in collectives
                   and record.completed is not None]
        measured.append({"events": events, "step_seconds": seconds})
    later = sorted(measured[1:], key=lambda step: step["step_seconds"])
    return later[len(later) // 2]


def cut_out_inner(spans) -> list:
    """[(label, start, end)] with every span that lies inside another cut out of it: the outer
    one keeps the parts before and after, so that no two overlap (spans nest, never cross)."""
    pieces = []
    for span in sorted(spans, key=lambda span: (span.start, -span.end)):
        inner = [other for other in spans if other is not span and span.start <= other.start
                 and other.end <= span.end and (other.start, other.end) != (span.start, span.end)]
        outermost = [other for other in inner if not any(
            o is not other and o.start <= other.start and other.end <= o.end for o in inner)]
        cursor = span.start
        for other in sorted(outermost, key=lambda other: other.start):
            if other.start > cursor:
                pieces.append((span.label, cursor, other.start))
            cursor = max(cursor, other.end)
        if span.end > cursor:
            pieces.append((span.label, cursor, span.end))
    return sorted(pieces, key=lambda piece: piece[1])
