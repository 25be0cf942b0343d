"""Data parallelism by hand: the lecture's loop (`average_gradients`), then `DDP`, used like
torch.nn.parallel.DistributedDataParallel. Lesson 06, notebooks/06_data_parallelism.ipynb.

Every rank holds the whole model and computes gradients on its own slice of the batch; averaging
the gradients over the ranks makes every rank's optimizer step the step of the whole batch.

`DDP(module, bucket_mb)`:
  construction   rank 0's parameters and buffers are broadcast, so every replica starts equal
  forward        rank 0's buffers (batch norm's running statistics) are broadcast first, as
                 torch's DDP does by default; the forward decides whether this step's backward
                 averages (outside no_sync()) or only accumulates (inside it), as torch's does
  backward       each gradient, as soon as autograd has accumulated it, is averaged across the
                 ranks by an asynchronous all_reduce (bucket_mb=None), or waits in a bucket of
                 at least bucket_mb MiB, reduced when its last gradient arrives. Buckets are
                 filled in the reverse order of the parameters, a guess at the order backward
                 produces them (torch's DDP records the real order in its first step and
                 rebuilds its buckets in that order)
  end of backward   finish_gradient_synchronization() waits for every all_reduce and puts the
                 averages into the .grad tensors. The first gradient of a backward queues it on
                 autograd's engine (`at_end_of_backward`), which runs it when the backward ends,
                 as torch's DDP queues its own wait: the caller's loop stays forward, backward,
                 optimizer.step()
`AverageAfterBackward(module)` is the lecture's loop in the same form: average_gradients, queued
at the end of backward.
Parameters with requires_grad=False are never communicated; a parameter used twice (tied
weights) is one parameter, and autograd calls its hook once, with both uses summed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from helpers.instrument import span


def average_gradients(module: nn.Module, group=None) -> None:
    """The lecture's loop: after backward, one blocking all_reduce per parameter (the naive DDP).
    Every rank must have a gradient for the same parameters, or the ranks' calls stop matching
    and they wait for each other forever."""
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=group)


def at_end_of_backward(callback) -> None:
    """Run `callback()` when the backward now running ends, after every gradient of it has been
    accumulated. Call it from inside backward (a gradient hook): autograd's engine keeps the
    callbacks of the backward it is running, and runs them, in order, before backward()
    returns. torch's DDP queues its wait the same way (Reducer::mark_variable_ready in
    torch/csrc/distributed/c10d/reducer.cpp)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def broadcast_from_first(tensors, group=None) -> None:
    """Every rank's `tensors` become the first rank of `group`'s (replicas start equal)."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in tensors:
        dist.broadcast(tensor.data, src=source, group=group)


class AverageAfterBackward(nn.Module):
    """The lecture's loop (average_gradients) as a module: the first gradient of each backward
    queues the averaging at the end of that backward. Replicas start from the first rank's
    weights."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module, self.group, self._queued = module, group, False
        broadcast_from_first([*module.parameters(), *module.buffers()], group)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self.gradient_ready)

    def forward(self, *args, **kwargs):
        self._queued = False  # (a backward that raised never ran its averaging)
        return self.module(*args, **kwargs)

    def gradient_ready(self, param):
        if not self._queued:
            self._queued = True
            at_end_of_backward(self.average)

    def average(self):
        self._queued = False
        with span("naive all_reduces"):  # (a label for helpers.instrument's timelines)
            average_gradients(self.module, self.group)


class Bucket:
    """Gradients reduced together. One parameter: its .grad is reduced in place. Several: `flat`
    is one buffer for all of them and `views` its piece for each, in order."""

    def __init__(self, params: list):
        self.params = params
        self.flat = None if len(params) == 1 else torch.empty(sum(p.numel() for p in params),
                                                              dtype=params[0].dtype,
                                                              device=params[0].device)
        self.views = [] if self.flat is None else list(
            self.flat.split([p.numel() for p in params]))
        self.ready = 0  # how many of its gradients this backward has produced so far


def bucket_indices(sizes_bytes: list, bucket_bytes: float | None) -> list:
    """Cut tensors of these sizes (in the order given) into buckets: runs of consecutive indices,
    each closed as soon as it holds at least `bucket_bytes` (so the last one may hold less); one
    tensor per bucket when `bucket_bytes` is None."""
    if bucket_bytes is None:
        return [[index] for index in range(len(sizes_bytes))]
    buckets, current, held = [], [], 0
    for index, size in enumerate(sizes_bytes):
        current.append(index)
        held += size
        if held >= bucket_bytes:
            buckets.append(current)
            current, held = [], 0
    return buckets + ([current] if current else [])


def make_buckets(params: list, bucket_mb: float | None) -> list:
    """The buckets of `params` (in the order given), each of at least `bucket_mb` MiB but the last;
    one per parameter when `bucket_mb` is None."""
    sizes = [param.numel() * param.element_size() for param in params]
    cap = None if bucket_mb is None else bucket_mb * 2**20
    return [Bucket([params[i] for i in indices]) for indices in bucket_indices(sizes, cap)]


class DDP(nn.Module):
    """A hand-built DistributedDataParallel (see the module docstring)."""

    def __init__(self, module: nn.Module, bucket_mb: float | None = None, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.source = dist.get_global_rank(group, 0) if group is not None else 0
        broadcast_from_first([*module.parameters(), *module.buffers()], group)
        trainable = [param for param in module.parameters() if param.requires_grad]
        self.buckets = make_buckets(list(reversed(trainable)), bucket_mb)
        self._bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}
        self._pending = []  # (work, bucket) of every all_reduce launched in this backward
        self.require_gradient_sync = True  # False inside no_sync()
        self._sync_this_backward = True  # what the last forward decided
        self._finish_queued = False  # whether this backward has queued its finish
        for param in trainable:
            param.register_post_accumulate_grad_hook(self.gradient_ready)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._finish_queued = False  # (a backward that raised never ran its finish)
            self._sync_this_backward = self.require_gradient_sync
            if self._sync_this_backward:
                for buffer in self.module.buffers():  # every step starts from rank 0's
                    dist.broadcast(buffer, src=self.source, group=self.group)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside only accumulate gradients locally; the first
        backward after it averages the accumulated sums (gradient accumulation without extra
        communication). As in torch, it is the forward that must run inside."""
        self.require_gradient_sync = False
        try:
            yield
        finally:
            self.require_gradient_sync = True

    def gradient_ready(self, param):
        if not self._sync_this_backward:
            return
        if not self._finish_queued:  # the first gradient of this backward
            self._finish_queued = True
            at_end_of_backward(self.finish_gradient_synchronization)
        bucket = self._bucket_of[param]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):  # its last gradient: send the bucket
            self.launch(bucket)

    def launch(self, bucket):
        if bucket.flat is None:
            tensor = bucket.params[0].grad
        else:
            for view, param in zip(bucket.views, bucket.params):
                view.copy_(param.grad.flatten())
            tensor = bucket.flat
        work = dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        self._pending.append((work, bucket))

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all_reduce and put the averages into the .grad tensors. Runs
        at the end of each backward that synchronizes; a second call does nothing."""
        self._finish_queued = False
        if not any(bucket.ready for bucket in self.buckets):  # nothing launched since the last
            return
        waiting = [bucket for bucket in self.buckets if bucket.ready < len(bucket.params)]
        if self._sync_this_backward and waiting:  # the ranks' all_reduces would stop matching
            names = {param: name for name, param in self.module.named_parameters()}
            missing = [names[param] for bucket in waiting for param in bucket.params]
            raise RuntimeError(
                f"no gradient arrived for {', '.join(missing)} in this backward: this DDP needs "
                "every parameter used in every step (torch's DDP has find_unused_parameters)")
        with span("wait"):  # (a label for helpers.instrument's timelines)
            for work, bucket in self._pending:
                work.wait()
                if bucket.flat is not None:
                    for view, param in zip(bucket.views, bucket.params):
                        param.grad.copy_(view.view_as(param))
        self._pending.clear()
        for bucket in self.buckets:
            bucket.ready = 0
