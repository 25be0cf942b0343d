"""Reference solutions of lesson 14's exercises. Try the exercise first."""

import math
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from helpers import layouts, reference, strategies
from helpers.capstone import train
from helpers.checkpoints_and_failures.resume import (
    checkpoint_path,
    latest_checkpoint,
    load_training,
    training_state,
)
from helpers.launcher.result import get_device
from helpers.layouts import clip_to_norm
from helpers.training import mean_over

NOT_NEEDED = ("sampler", "rng")


def capstone(rank, world_size, job, directory, recompute):
    mesh = layouts.make_mesh(layouts.Plan(dp=2, tp=2))  # ("dp", "tp")
    model = job.model()
    layouts.apply_tp(model, mesh["tp"])  # lesson 08's plan, PyTorch's pieces
    layouts.apply_ac(model, "full" if recompute else "none")
    layouts.apply_fsdp(model, mesh["dp"])
    optimizer = job.optimizer(model.parameters())
    path, step = latest_checkpoint(directory)
    if path is not None:  # lesson 12's checkpoint: the batches need no sampler, the loop no RNG
        load_training(path, model, optimizer, {}, leave_out=NOT_NEEDED)
    dp_rank = mesh["dp"].get_local_rank()
    losses = {}
    while step < job.steps:
        batch = job.batch(step).shard(dp_rank, 2).to(get_device())
        optimizer.zero_grad()
        loss = reference.lm_loss(model(batch.inputs), batch.targets)
        loss.backward()
        clip_to_norm(model, job.max_norm)  # the global norm: over dp and tp
        optimizer.step()
        step += 1
        losses[step] = mean_over(loss.item(), mesh["dp"].get_group())
        if step % job.save_every == 0:
            dcp.save(training_state(model, optimizer, {}, leave_out=NOT_NEEDED),
                     checkpoint_id=checkpoint_path(directory, step))
    return losses, strategies.full_parameters(model)


def global_norm(rank, world_size, pieces):
    total = torch.zeros(1, dtype=torch.float64, device=get_device())
    for piece in pieces.values():
        coordinate = piece.device_mesh.get_coordinate()
        # a piece held whole along a mesh dimension (Replicate) is the same on every rank along
        # it: it counts once, on the rank at coordinate 0 there
        if all(where == 0 for where, placement in zip(coordinate, piece.placements)
               if placement.is_replicate()):
            total += piece.to_local().double().pow(2).sum()
    dist.all_reduce(total)  # the one communication: dp and tp as one group
    return math.sqrt(total.item())


def recipe_step(model, optimizer, scheduler, parts, config):
    sequences = sum(len(part) for part in parts)
    loss_sum = 0.0
    for index, part in enumerate(parts):
        model.set_requires_gradient_sync(index == len(parts) - 1)  # accumulate, then reduce once
        with train.parallel_loss(config):  # under tp the logits stay cut by the vocabulary
            logits = model(part[:, :-1])  # bfloat16 under FSDP2's policy: the loss in float32
            part_loss = F.cross_entropy(logits.flatten(0, 1).float() if config.bf16
                                        else logits.flatten(0, 1), part[:, 1:].flatten())
            loss = part_loss * len(part) / sequences  # each part by its share of the sequences
            loss.backward()
        loss_sum += train.whole(loss.detach()).item()
    norm = clip_to_norm(model, config.clip)  # the global norm, over dp and tp
    optimizer.step()
    scheduler.step()  # once a step: the rate of the next one
    optimizer.zero_grad()
    return loss_sum, train.whole(norm).item()


def entry_point(job):
    dist.init_process_group()  # torchrun's variables; gloo for CPU tensors, NCCL for CUDA ones
    asked = []
    for number in (signal.SIGINT, signal.SIGTERM):  # from now on a signal only raises a flag
        signal.signal(number, lambda number, frame: asked.append(number))

    def stop(step) -> bool:  # any rank asked: every rank stops, after the same step
        flag = torch.tensor([float(bool(asked))], device=get_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    job.train(stop)  # saves a checkpoint when stop says so, and returns
    dist.barrier()  # every rank done with the checkpoint before any leaves
    sys.stdout.flush()
    os._exit(0)  # without torch's C++ destructors, which can abort at exit after a backward
