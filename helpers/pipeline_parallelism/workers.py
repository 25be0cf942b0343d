"""Lesson 09's workers: a step of the hand-built pipeline and of torch.distributed.pipelining on
the course's MLP, and their step times side by side.

Every worker gets the whole model and batch; rank r keeps stage r (stages.mlp_stage), the first
rank feeds the inputs and the last the targets. Gradients come back named as in the whole model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers import reference
from helpers.instrument import Observer
from helpers.pipeline_parallelism.schedule import events, pipeline_step
from helpers.pipeline_parallelism.stages import mlp_stage, stage_layer_names
from helpers.timing import take_turns


def ends(rank, world_size, batch):
    first, last = rank == 0, rank == world_size - 1
    return (batch.inputs if first else None), (batch.targets if last else None)


def named_grads(stage, rank, world_size, num_layers):
    names = stage_layer_names(rank, world_size, num_layers)
    return {names[name]: param.grad for name, param in stage.named_parameters()}


def step_worker(rank, world_size, model, batch, num_micro_batches, schedule):
    """One pipeline_step, after a barrier: the loss (last rank), this stage's gradients, its
    event log (schedule.events), and when it started and ended (time.perf_counter(): one clock
    for all ranks)."""
    stage = mlp_stage(model, rank, world_size)
    inputs, targets = ends(rank, world_size, batch)
    dist.barrier()
    with Observer(memory_of=stage) as observed, observed.span("step"):
        loss = pipeline_step(stage, inputs, targets, reference.mse_loss, num_micro_batches,
                             schedule)
    step = observed.spans[-1]
    return {"loss": loss, "grads": named_grads(stage, rank, world_size, len(model.layers)),
            "events": events(observed.spans, schedule), "start": step.start, "end": step.end}


def torch_schedule(stage, rank, world_size, num_micro_batches, schedule):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule not in kinds:
        raise ValueError(f"torch.distributed.pipelining is compared here on {list(kinds)}")
    # on the CPU on purpose, as the hand-built pipeline: the stages exchange CPU tensors, which
    # the group's gloo carries on any machine
    pipe_stage = PipelineStage(stage, rank, world_size, torch.device("cpu"))  # CPU on purpose
    # scale_grads (the default) divides the gradients by the number of micro-batches: the
    # gradients of the mean of the micro-batches' mean losses, as pipeline_step's
    return kinds[schedule](pipe_stage, num_micro_batches, loss_fn=reference.mse_loss)


def torch_step(runner, rank, world_size, batch):
    inputs, targets = ends(rank, world_size, batch)
    losses = []
    if rank == 0:
        runner.step(inputs)
    elif rank == world_size - 1:
        runner.step(target=targets, losses=losses)
    else:
        runner.step()
    return sum(loss.item() for loss in losses) / len(losses) if losses else None


def torch_step_worker(rank, world_size, model, batch, num_micro_batches, schedule):
    """The same step with torch.distributed.pipelining: a PipelineStage per rank and
    ScheduleGPipe or Schedule1F1B."""
    stage = mlp_stage(model, rank, world_size)
    runner = torch_schedule(stage, rank, world_size, num_micro_batches, schedule)
    loss = torch_step(runner, rank, world_size, batch)
    return {"loss": loss, "grads": named_grads(stage, rank, world_size, len(model.layers))}


CONTENDERS = ("hand-built 1F1B", "torch Schedule1F1B", "hand-built zb")


def step_times_worker(rank, world_size, model, batch, num_micro_batches, iterations):
    """The hand-built 1f1b and zb and torch's Schedule1F1B, each on its own copy of its stage,
    taking turns; each step starts after a barrier and lasts as long as its slowest rank.
    Returns each one's median step seconds."""
    stages = {name: mlp_stage(model, rank, world_size) for name in CONTENDERS}
    runner = torch_schedule(stages["torch Schedule1F1B"], rank, world_size, num_micro_batches,
                             "1f1b")
    inputs, targets = ends(rank, world_size, batch)
    steps = {
        "hand-built 1F1B": lambda: pipeline_step(stages["hand-built 1F1B"], inputs, targets,
                                                 reference.mse_loss, num_micro_batches, "1f1b"),
        "torch Schedule1F1B": lambda: torch_step(runner, rank, world_size, batch),
        "hand-built zb": lambda: pipeline_step(stages["hand-built zb"], inputs, targets,
                                               reference.mse_loss, num_micro_batches, "zb"),
    }

    def from_zero_gradients(name):
        def step():
            stages[name].zero_grad()
            steps[name]()
        return step

    return take_turns({name: from_zero_gradients(name) for name in CONTENDERS},
                      rounds=iterations)


def bubble_worker(rank, world_size, width, num_layers, batch_size, num_micro_batches, schedule,
                  steps=1):
    """`steps` pipeline_steps of a wide MLP, for timing, after a warm-up step: each rank builds
    its own stage of num_layers / world_size seeded layers of `width` (no model travels to the
    ranks). Returns, per measured step, the event log and the step's start on this rank."""
    layers = num_layers // world_size
    stage = mlp_stage(reference.make_mlp(width, layers, seed=rank), 0, 1)
    inputs = reference.seeded_randn(0, batch_size, width) if rank == 0 else None
    targets = reference.seeded_randn(1, batch_size, width) if rank == world_size - 1 else None
    measured = []
    for _ in range(steps + 1):  # the first step warms up
        stage.zero_grad()
        dist.barrier()
        with Observer() as observed, observed.span("step"):
            pipeline_step(stage, inputs, targets, reference.mse_loss, num_micro_batches, schedule)
        measured.append({"events": events(observed.spans, schedule),
                         "start": observed.spans[-1].start})
    return measured[1:]
