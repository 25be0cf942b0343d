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

The parts: `schedule_order` (the order, as data), `next_action` (zb's one rule, which
ideal.simulate follows too), `StageCompute` (F, B and W on the stage), p2p.Messages (the
messages), and `pipeline_step`, the loop that runs them. Compute is marked with
instrument.span(("F", i)) etc., which an active instrument.Observer records (`events`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from helpers.instrument import span
from helpers.pipeline_parallelism.p2p import Messages

SCHEDULES = ("gpipe", "1f1b", "zb")


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


def next_action(kind: str, pending_w: int, kept: int, num_stages: int, rank: int,
                message_ready: bool) -> str:
    """zb's rule: before the next `kind` ("F" or "B") of the order, run a put-off W ("W") if one
    is pending and either the message the next one needs has not arrived, or the next is a
    forward that would keep more micro-batches than 1F1B does (p - r). Else `kind`."""
    if pending_w and (not message_ready or (kind == "F" and kept >= num_stages - rank)):
        return "W"
    return kind


def bubble_formula(num_stages: int, num_micro_batches: int) -> float:
    """The idle share of a GPipe or 1F1B step when every stage takes the same time."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


class StageCompute:
    """F, B and W of one stage, and what it keeps of each micro-batch between them. With
    `split` (zb), each layer of the nn.Sequential stage gets its own autograd graph (its output
    detached), B computes only the inputs' gradients, and W the weights'."""

    def __init__(self, stage: nn.Module, loss_fn, num_micro_batches: int, last: bool,
                 split: bool):
        self.stage, self.loss_fn, self.m = stage, loss_fn, num_micro_batches
        self.last, self.split = last, split
        self.kept = {}  # micro-batch -> [(input, output)] of each layer (one pair: whole stage)
        self.output_grads = {}  # zb: micro-batch -> each layer's output gradient, for W
        self.pending_w = []  # zb: micro-batches whose W is still to run
        self.losses = []

    def forward(self, i, x, target):
        """Returns the stage's output (the loss, on the last stage)."""
        layers = list(self.stage) if self.split else [self.stage]
        pairs = []
        for layer in layers:
            out = layer(x)
            pairs.append((x, out))
            x = out.detach().requires_grad_() if self.split else out
        if self.last:  # the loss, one more "layer" without parameters
            h = pairs[-1][1]
            if self.split:
                h = h.detach().requires_grad_()
            pairs.append((h, self.loss_fn(h, target) / self.m))
            self.losses.append(pairs[-1][1].item())
        self.kept[i] = pairs
        return pairs[-1][1]

    def backward(self, i, grad):
        """Returns the gradient of the stage's input (None if it needs none)."""
        pairs = self.kept[i]
        if not self.split:
            pairs[-1][1].backward(grad)
            del self.kept[i]  # its activations are freed
            return pairs[0][0].grad
        grads = []
        for h, out in reversed(pairs):  # B: the inputs' gradients only
            grads.insert(0, grad)
            grad = torch.autograd.grad(out, h, grad, retain_graph=True)[0] \
                if h.requires_grad else None
        self.output_grads[i] = grads
        self.pending_w.append(i)
        return grad

    def weight_gradient(self):
        """W of the oldest pending micro-batch: its weights' gradients, added to .grad."""
        i = self.pending_w.pop(0)
        for layer, (_, out), grad in zip(self.stage, self.kept.pop(i),
                                         self.output_grads.pop(i)):
            params = [p for p in layer.parameters() if p.requires_grad]
            for param, g in zip(params, torch.autograd.grad(out, params, grad) if params else []):
                param.grad = g if param.grad is None else param.grad + g


def pipeline_step(stage: nn.Module, inputs, targets, loss_fn, num_micro_batches: int,
                  schedule: str = "1f1b", group=None) -> float | None:
    """One training step of this rank's `stage` on the pipeline `group`: forward and backward
    of every micro-batch in the order `schedule` gives; the gradients of the batch's mean loss
    are added to the stage's parameters' .grad. The first rank passes the batch's `inputs`, the
    last its `targets` and `loss_fn(outputs, targets)` (a mean over the micro-batch); the others
    pass None. Returns the batch's mean loss on the last rank (the sum of the micro-batches'
    losses, each divided by m in StageCompute.forward), None elsewhere."""
    messages = Messages(group)
    chunks = split_micro_batches(messages, inputs, targets, num_micro_batches)
    if schedule == "zb" and not isinstance(stage, nn.Sequential):
        raise TypeError("the zb schedule needs an nn.Sequential stage: it computes each layer's "
                        "weight gradient on its own")
    compute = StageCompute(stage, loss_fn, num_micro_batches, messages.last, schedule == "zb")
    for kind, i in schedule_order(schedule, messages.rank, messages.size, num_micro_batches):
        if kind == "F":
            incoming = messages.receive_activation()
        else:
            incoming = messages.receive_gradient(compute.kept[i][-1][1])
        while next_action(kind, len(compute.pending_w), len(compute.kept), messages.size,
                          messages.rank, incoming.ready()) == "W":
            with span(("W", compute.pending_w[0])):
                compute.weight_gradient()
        if kind == "F":
            x = chunks["inputs"][i] if messages.first else incoming.wait().requires_grad_()
            with span(("F", i)):
                output = compute.forward(i, x, chunks["targets"][i] if messages.last else None)
            if not messages.last:
                messages.send_activation(output)
        else:
            grad = incoming.wait()  # waiting is not computing: outside the span
            with span(("B", i)):
                input_grad = compute.backward(i, grad)
            if not messages.first:
                messages.send_gradient(input_grad)
    while compute.pending_w:
        with span(("W", compute.pending_w[0])):
            compute.weight_gradient()
    messages.finish()
    return sum(compute.losses) if messages.last else None


def split_micro_batches(messages, inputs, targets, num_micro_batches) -> dict:
    chunks = {}
    for name, batch, needed in (("inputs", inputs, messages.first),
                                ("targets", targets, messages.last)):
        if needed:
            if batch is None or batch.shape[0] % num_micro_batches:
                raise ValueError(f"this rank needs {name} whose first dimension divides into "
                                 f"{num_micro_batches} micro-batches")
            # copies: each micro-batch its own storage, so that what a forward keeps of it is
            # counted as its own bytes, not as the whole batch's
            chunks[name] = [chunk.clone() for chunk in batch.chunk(num_micro_batches)]
    return chunks


@dataclass
class Event:
    kind: str  # "F", "B" or "W"
    micro_batch: int
    start: float  # time.perf_counter() seconds: one clock for every process of this machine
    end: float
    stored_bytes: int  # activations kept after this event (ideal.simulate: micro-batches)


def events(spans: list, schedule: str) -> list:
    """The Events of a step from an Observer's spans (`memory_of` the stage): each micro-batch
    keeps what autograd saved in its forward until its backward (zb: until its W; the output
    gradients zb also keeps for W are not counted)."""
    kept, log = {}, []
    for entry in spans:
        if not isinstance(entry.label, tuple):
            continue
        kind, i = entry.label
        if kind == "F":
            kept[i] = entry.saved_bytes
        elif kind == "W" or schedule != "zb":
            kept.pop(i, None)
        log.append(Event(kind, i, entry.start, entry.end, sum(kept.values())))
    return log
