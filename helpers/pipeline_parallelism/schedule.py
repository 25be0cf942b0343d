"""Pipeline parallelism by hand: `pipeline_step`, one training step of one pipeline stage, with the
GPipe, 1F1B and a zero-bubble schedule (lesson 09, notebooks/09_pipeline_parallelism.ipynb).

A model is cut into p consecutive stages, one per rank. A batch is cut into m micro-batches.
Rank r runs its stage's forward on each micro-batch as soon as rank r - 1 sends the activations
(rank 0 has the inputs), and its backward as soon as rank r + 1 sends back the gradient of those
activations (rank p - 1 has the targets and the loss). Every rank calls `pipeline_step` with its
own stage; the gradients of the whole batch's mean loss are left in the stages' parameters.

Schedules (the order in which a rank runs its forwards F and backwards B):
    gpipe   all m forwards, then all m backwards (Huang et al., "GPipe", 2019). A rank keeps the
            activations of all m micro-batches at once (GPipe itself recomputes them in backward
            and keeps only each micro-batch's stage input; this code does not recompute).
    1f1b    p - r - 1 forwards to fill the pipeline, then one forward and one backward in turn,
            then the remaining backwards (Narayanan et al., "PipeDream", 2019; the
            "PipeDream-Flush" schedule of Narayanan et al., "Efficient Large-Scale Language Model
            Training on GPU Clusters Using Megatron-LM", 2021, §2.2). At most p - r
            micro-batches' activations at once; the same bubble as GPipe.
    zb      1f1b's order, but each backward B computes only the gradient of its input (which the
            previous rank waits for), and the gradient of the weights, W, is put off: it runs
            while the rank would otherwise wait for a message, before a forward that would keep
            more micro-batches than 1F1B does (p - r), or at the end. After Qi et al., "Zero
            Bubble Pipeline Parallelism" (2023), whose ZB-H1 places the W's by a static plan
            within 1F1B's memory; this one fills the waits greedily within the same bound. The
            stage must be an nn.Sequential: pipeline_step cuts the autograd graph between its
            layers (each layer's output detached), so that each layer's W can run on its own.
The bubble, the idle share of the step, is (p - 1) / (m + p - 1) for gpipe and 1f1b when every
stage takes the same time (Narayanan et al. give it as (p - 1) / m of the ideal time instead:
the same bubble, measured against the time without it).

Messages: activations go to rank + 1 and gradients to rank - 1 with isend (a blocking send could
deadlock: in 1F1B's steady phase neighbours send to each other at the same time), received with
irecv. Before its first activation, each rank sends the next one the activation's dtype and
shape (every micro-batch has the same).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from helpers.instrument import saved_activations, saved_bytes

SCHEDULES = ("gpipe", "1f1b", "zb")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def schedule_order(schedule: str, rank: int, num_stages: int, num_micro_batches: int) -> list:
    """The order in which rank `rank` runs its forwards and backwards: [("F", 0), ...]."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    m = num_micro_batches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(num_stages - rank - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def bubble_formula(num_stages: int, num_micro_batches: int) -> float:
    """The idle share of a GPipe or 1F1B step when every stage takes the same time."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


@dataclass
class Event:
    kind: str  # "F", "B" or "W"
    micro_batch: int
    start: float  # time.perf_counter() seconds: one clock for every process of this machine
    end: float
    stored_bytes: int  # activations (and, for zb, output gradients) kept after this event


@dataclass
class StepResult:
    loss: float | None  # the batch's mean loss, on the last rank
    events: list = field(default_factory=list)  # this rank's Events, in order
    start: float = 0.0  # time.perf_counter() when this rank began the step
    end: float = 0.0  # and when it was done


class _MicroBatch:
    """What a rank keeps of one micro-batch between its forward and its backward."""

    def __init__(self):
        self.inputs = self.outputs = None  # whole stage (gpipe, 1f1b)
        self.layers = []  # zb: [(input, output)] per layer; then the output gradients for W
        self.output_grads = []
        self.inputs_grad = None
        self.bytes = 0


def _send_meta(tensor, dst, group):
    meta = torch.zeros(8, dtype=torch.int64)
    meta[0], meta[1] = DTYPES.index(tensor.dtype), tensor.dim()
    meta[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.send(meta, dst, group=group)


def _recv_meta(src, group):
    meta = torch.zeros(8, dtype=torch.int64)
    dist.recv(meta, src, group=group)
    return DTYPES[meta[0]], tuple(meta[2:2 + meta[1]].tolist())


class _Pipeline:
    def __init__(self, stage, group):
        self.stage, self.group = stage, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        # neighbours' global ranks (send and recv take those); the first and the last have one
        self.prev, self.next = (dist.get_global_rank(group, r) if group is not None
                                and 0 <= r < self.size else r
                                for r in (self.rank - 1, self.rank + 1))
        self.sends = []  # (work, tensor): kept until the end of the step
        self.input_spec = None
        self.meta_sent = False
        self.pending_w = []  # zb: micro-batches whose weight gradient is still to compute
        self.events, self.kept = [], {}

    def stored(self) -> int:
        return sum(micro.bytes for micro in self.kept.values())

    def send(self, tensor, dst):
        tensor = tensor.detach().contiguous()
        self.sends.append((dist.isend(tensor, dst, group=self.group), tensor))

    def receive(self, buffer, src, fill_with_w: bool):
        """Receive into `buffer`; while it has not arrived, compute put-off weight gradients."""
        work = dist.irecv(buffer, src, group=self.group)
        while fill_with_w and self.pending_w and not work.is_completed():
            self.weight_gradient()
        work.wait()
        return buffer

    def timed(self, kind, micro_batch, run):
        start = time.perf_counter()
        run()
        self.events.append(Event(kind, micro_batch, start, time.perf_counter(), self.stored()))

    # The three computations.

    def forward(self, index, inputs, targets, loss_fn, num_micro_batches, split):
        # zb: no more micro-batches kept than 1F1B keeps (p - rank): put-off W's first
        while split and self.pending_w and len(self.kept) >= self.size - self.rank:
            self.weight_gradient()
        if self.first:
            x = inputs[index]
        else:
            if self.input_spec is None:
                self.input_spec = _recv_meta(self.prev, self.group)
            dtype, shape = self.input_spec
            x = self.receive(torch.empty(shape, dtype=dtype), self.prev, split)
            x.requires_grad_()
        micro = self.kept[index] = _MicroBatch()

        def run():
            counting = saved_activations(self.stage) if self.track_memory else nullcontext([])
            with counting as saved:
                if split:  # each layer on its own graph, so that W can be taken per layer
                    h = x
                    for layer in self.stage:
                        out = layer(h)
                        micro.layers.append((h, out))
                        h = out.detach().requires_grad_()
                    out = micro.layers[-1][1]
                    if self.last:  # the loss as one more "layer", without parameters
                        h = out.detach().requires_grad_()
                        out = loss_fn(h, targets[index]) / num_micro_batches
                        micro.layers.append((h, out))
                else:
                    out = self.stage(x)
                    if self.last:
                        out = loss_fn(out, targets[index]) / num_micro_batches
            micro.inputs, micro.outputs = x, out
            micro.bytes = saved_bytes(saved) if self.track_memory else 0

        self.timed("F", index, run)
        if self.last:
            self.losses.append(micro.outputs.item())
        else:
            if not self.meta_sent:
                _send_meta(micro.outputs, self.next, self.group)
                self.meta_sent = True
            self.send(micro.outputs, self.next)

    def backward(self, index, split):
        micro = self.kept[index]
        grad = None
        if not self.last:
            grad = self.receive(torch.empty_like(micro.outputs), self.next, split)

        def run():
            if not split:
                micro.outputs.backward(grad)
                del self.kept[index]  # its activations are freed
                return
            g = grad
            for h, out in reversed(micro.layers):  # B: the inputs' gradients only
                micro.output_grads.insert(0, g)
                g = (torch.autograd.grad(out, h, g, retain_graph=True)[0]
                     if h.requires_grad else None)
            micro.inputs_grad = g
            micro.bytes += sum(t.numel() * t.element_size() for t in micro.output_grads
                               if t is not None)  # kept for W
            self.pending_w.append(index)

        self.timed("B", index, run)
        if not self.first:
            self.send(micro.inputs.grad if not split else micro.inputs_grad, self.prev)

    def weight_gradient(self):
        index = self.pending_w.pop(0)
        micro = self.kept[index]

        def run():
            for layer, (_, out), g in zip(self.stage, micro.layers, micro.output_grads):
                params = [p for p in layer.parameters() if p.requires_grad]
                if params:
                    grads = torch.autograd.grad(out, params, g)
                    for param, grad in zip(params, grads):
                        param.grad = grad if param.grad is None else param.grad + grad
            del self.kept[index]

        self.timed("W", index, run)


def pipeline_step(stage: nn.Module, inputs, targets, loss_fn, num_micro_batches: int,
                  schedule: str = "1f1b", group=None, track_memory: bool = True) -> StepResult:
    """One training step of this rank's `stage`: forward and backward of every micro-batch, in
    the order `schedule` gives; the gradients of the batch's mean loss are added to the stage's
    parameters' .grad. The first rank passes the batch's `inputs`, the last its `targets` and
    `loss_fn(outputs, targets)` (a mean over the micro-batch); the others pass None. The batch
    must split into `num_micro_batches` equal micro-batches. Returns the loss (last rank) and
    this rank's event log; every rank of `group` must call it. `track_memory`: count each
    micro-batch's saved activations (saved-tensor hooks, which cost a little time)."""
    pipeline = _Pipeline(stage, group)
    split = schedule == "zb"
    if split and not isinstance(stage, nn.Sequential):
        raise TypeError("the zb schedule needs an nn.Sequential stage: it computes each layer's "
                        "weight gradient on its own")
    order = schedule_order(schedule, pipeline.rank, pipeline.size, num_micro_batches)
    chunks = {}
    for name, batch, needed in (("inputs", inputs, pipeline.first),
                                ("targets", targets, pipeline.last)):
        if needed:
            if batch is None or batch.shape[0] % num_micro_batches:
                raise ValueError(f"this rank needs {name} whose first dimension divides into "
                                 f"{num_micro_batches} micro-batches")
            # copies: each micro-batch its own storage, so that what a forward keeps of it is
            # counted as its own bytes, not as the whole batch's
            chunks[name] = [chunk.clone() for chunk in batch.chunk(num_micro_batches)]
    pipeline.losses, pipeline.track_memory = [], track_memory
    started = time.perf_counter()
    for kind, index in order:
        if kind == "F":
            pipeline.forward(index, chunks.get("inputs"), chunks.get("targets"), loss_fn,
                             num_micro_batches, split)
        else:
            pipeline.backward(index, split)
    while pipeline.pending_w:
        pipeline.weight_gradient()
    for work, _ in pipeline.sends:
        work.wait()
    loss = sum(pipeline.losses) if pipeline.last else None
    return StepResult(loss, pipeline.events, started, time.perf_counter())
