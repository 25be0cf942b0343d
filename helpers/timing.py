"""Timing a training step across ranks, for the lessons' step-time comparisons (06, 07) and
their benchmarks: every step starts after a barrier and lasts as long as its slowest rank."""

import time

import torch
import torch.distributed as dist


def timed_step(module, optimizer, loss_fn, inputs, targets, after_backward=None,
               before_step=None) -> float:
    """One training step (zero_grad, forward, backward, `after_backward`, `before_step`,
    optimizer step); returns its seconds on the slowest rank. Every rank must call it."""
    dist.barrier()
    started = time.perf_counter()
    optimizer.zero_grad()
    loss_fn(module(inputs), targets).backward()
    if after_backward is not None:
        after_backward()
    if before_step is not None:
        before_step()
    optimizer.step()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()
