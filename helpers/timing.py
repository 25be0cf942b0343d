"""The course's one definition of "how long a step takes" across ranks, used by every figure and
benchmark that times one: a step starts on every rank after a barrier and lasts as long as its
slowest rank; contenders compared in one run take turns, round after round, and each is
summarised by its median after a warm-up.

    slowest_rank_seconds(step, group)         one call of step(), timed on the slowest rank
    take_turns(contenders, rounds, warmup)    {name: median seconds}, contenders interleaved
    training_step(module, optimizer, ...)     zero_grad, forward, backward, finish, step
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


def slowest_rank_seconds(step: Callable[[], object], group=None) -> float:
    """Every rank of `group` waits for the others, runs `step()`, and gets the seconds of the
    slowest one. Every rank must call it."""
    dist.barrier(group=group)
    started = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


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


def training_step(module, optimizer, loss_fn, inputs, targets, after_backward=None) -> None:
    """One training step: zero_grad, forward, backward, `after_backward` (a hand-built
    strategy's finish_gradient_synchronization, or None), optimizer step."""
    optimizer.zero_grad()
    loss_fn(module(inputs), targets).backward()
    if after_backward is not None:
        after_backward()
    optimizer.step()


def observed_training(module, optimizer, loss_fn, batches, rank, world_size) -> Observer:
    """One training step per batch on this rank's slice of it (training_step), the last one
    observed: returns its Observer, whose calls and bytes are one step's."""
    for batch in batches:
        local = batch.shard(rank, world_size)
        with Observer() as observed:
            training_step(module, optimizer, loss_fn, local.inputs, local.targets)
    return observed


def step_timeline(module, optimizer, loss_fn, inputs, targets, after_backward=None,
                  finishing="wait", collectives=("all_reduce",), steps=7) -> dict:
    """`steps` training steps (the first a warm-up), each observed: the spans forward, backward,
    `finishing` (after_backward, if any) and step, and every call of `collectives` from its
    launch to its completion. Returns the step of median time: {"events": [(label, start_s,
    end_s)] from the step's start, "step_seconds": the slowest rank's}. Every rank must call it."""
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
                if after_backward is not None:
                    with observed.span(finishing):
                        after_backward()
                with observed.span("step"):
                    optimizer.step()

        seconds = slowest_rank_seconds(step)
        start = observed.spans[0].start
        events = [(span.label, span.start - start, span.end - start) for span in observed.spans]
        events += [(TABLE_NAME.get(record.name, record.name), record.launched - start,
                    record.completed - start) for record in observed.records
                   if TABLE_NAME.get(record.name, record.name) in collectives
                   and record.completed is not None]
        measured.append({"events": events, "step_seconds": seconds})
    later = sorted(measured[1:], key=lambda step: step["step_seconds"])
    return later[len(later) // 2]
