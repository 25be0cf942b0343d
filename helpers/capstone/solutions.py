"""Reference solutions of lesson 14's exercises. Try the exercise first."""

import math

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from helpers import layouts, reference, strategies
from helpers.at_scale.accounting import clip_to_norm
from helpers.checkpoints_and_failures.resume import (
    checkpoint_path,
    latest_checkpoint,
    load_training,
    training_state,
)
from helpers.launcher.result import get_device
from helpers.training import mean_over

NOT_NEEDED = ("sampler", "rng")


def capstone(rank, world_size, job, directory, recompute):
    mesh = init_device_mesh(get_device().type, (2, 2), mesh_dim_names=("dp", "tp"))
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
