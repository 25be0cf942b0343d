"""What lesson 10's ranks run for its main topic, strategies composed on a mesh (torch only: no
plotting here). Each worker returns plain data. The other topics' workers live in their own
modules: experts.moe_worker, weights' transfer workers, ring_attention's."""

from __future__ import annotations

import copy

import torch.distributed as dist

from helpers import reference, strategies
from helpers.composing.hybrid import LMStage
from helpers.composing.mesh import Grid, new_groups
from helpers.data_parallelism.ddp import DDP, average_gradients
from helpers.launcher.result import get_device
from helpers.layouts import Plan, lay_out, make_mesh
from helpers.pipeline_parallelism.schedule import pipeline_step
from helpers.training import mean_over

# --- mesh ---------------------------------------------------------------------------------------

def grid_worker(rank, world_size, dims, sizes):
    """The hand-built grid's groups against init_device_mesh's, for the same shape and names
    (the lesson teaches init_device_mesh here; elsewhere the course's layouts.make_mesh calls
    it). Returns {dimension: (this rank's group members by hand, by init_device_mesh)}."""
    from torch.distributed.device_mesh import init_device_mesh

    grid = Grid(tuple(dims), tuple(sizes))
    groups = new_groups(grid, rank)
    mesh = init_device_mesh(get_device().type, tuple(sizes), mesh_dim_names=tuple(dims))
    return {dim: (dist.get_process_group_ranks(groups[dim]),
                  dist.get_process_group_ranks(mesh.get_group(dim))) for dim in dims}


def dp_tp_worker(rank, world_size, model, batches, tp_size, lr=1e-2):
    """Data x tensor parallelism by hand on a (world_size / tp_size) x tp_size grid: each block
    tensor-parallel over the tp group (lesson 08's parallelize_block), the whole model wrapped in
    lesson 06's DDP over the dp group. Returns the batch loss of every step and this rank's
    parameters at the end (its shards), by the dense model's names."""
    grid = Grid(("dp", "tp"), (world_size // tp_size, tp_size))
    groups, place = new_groups(grid, rank), grid.coordinates(rank)
    model = DDP(LMStage(model, tp_group=groups["tp"]), group=groups["dp"])
    optimizer = reference.make_optimizer("adamw", model.parameters(), lr)
    losses = []
    for batch in batches:
        local = batch.shard(place["dp"], grid.sizes[0])
        optimizer.zero_grad()
        # forward and backward: tensor parallelism's all-reduces, on the tp group; in backward,
        # DDP's hooks also launch each gradient's all-reduce on the dp group as it is ready, and
        # the end of backward waits for them
        loss = reference.lm_loss(model(local.inputs), local.targets)
        loss.backward()
        optimizer.step()
        losses.append(mean_over(loss.item(), groups["dp"]))
    return {"place": place, "losses": losses,
            "parameters": reference.parameters(model.module)}


def dp_tp_pp_worker(rank, world_size, model, batches, sizes, micro_batches=2, lr=1e-2):
    """Data x pipeline x tensor parallelism by hand on a dp x pp x tp grid (`sizes`): rank
    (d, p, t) runs pipeline stage p (lesson 09's pipeline_step, 1F1B, on the pp group) of blocks
    that are tensor-parallel over the tp group, on dp slice d of each batch, and averages its
    gradients over the dp group (lesson 06's average_gradients). Returns the batch loss of every
    step (on the last stage; None elsewhere), its place, and its parameters at the end."""
    grid = Grid(("dp", "pp", "tp"), tuple(sizes))
    groups, place = new_groups(grid, rank), grid.coordinates(rank)
    num_stages = grid.sizes[1]
    stage = LMStage(model, place["pp"], num_stages, groups["tp"])
    optimizer = reference.make_optimizer("adamw", stage.parameters(), lr)
    losses = []
    for batch in batches:
        local = batch.shard(place["dp"], grid.sizes[0])
        optimizer.zero_grad()
        loss = pipeline_step(stage, local.inputs if stage.first else None,
                             local.targets if stage.last else None, reference.lm_loss,
                             micro_batches, "1f1b", group=groups["pp"])
        average_gradients(stage, groups["dp"])  # data parallelism: one all_reduce per parameter
        optimizer.step()
        if stage.last:
            losses.append(mean_over(loss, groups["dp"]))
    return {"place": place, "losses": losses if stage.last else None,
            "parameters": reference.parameters(stage)}


def torch_dp_tp_worker(rank, world_size, model, batches, tp_size, lr=1e-2):
    """The same training with PyTorch's pieces on one DeviceMesh ("dp", "tp"), laid out by
    layouts.lay_out (the course's parallelize_llama). Returns the losses, every parameter
    gathered whole (full_tensor), each parameter's DTensor layout: its mesh dimensions,
    placements and the shape of this rank's piece, and the piece itself ("pieces")."""
    plan = Plan(dp=world_size // tp_size, tp=tp_size)
    mesh = make_mesh(plan)  # ("dp", "tp")
    model = lay_out(copy.deepcopy(model).to(get_device()), mesh, plan)  # TP, then FSDP2
    optimizer = reference.make_optimizer("adamw", model.parameters(), lr)
    dp_rank, losses = mesh.get_local_rank("dp"), []
    for batch in batches:
        local = batch.shard(dp_rank, plan.dp).to(get_device())
        optimizer.zero_grad()
        loss = reference.lm_loss(model(local.inputs), local.targets)
        loss.backward()
        optimizer.step()
        losses.append(mean_over(loss.item(), mesh.get_group("dp")))
    layouts = {name: (param.device_mesh.mesh_dim_names, tuple(map(repr, param.placements)),
                      tuple(param.to_local().shape))
               for name, param in model.named_parameters()}
    full = strategies.full_parameters(model)  # (it quiets DTensor's two-all-gather warning)
    pieces = {name: param.to_local().detach().cpu() for name, param in model.named_parameters()}
    return {"losses": losses, "parameters": full, "layouts": layouts, "pieces": pieces}


