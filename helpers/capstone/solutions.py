"""Reference solutions of lesson 14's exercises. Try the exercise first."""

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from helpers import layouts, reference, strategies
from helpers.at_scale.accounting import clip_to_norm
from helpers.checkpoints_and_failures.resume import checkpoint_path, latest_checkpoint
from helpers.launcher.result import get_device
from helpers.training import mean_over


def capstone(rank, world_size, job, directory, recompute):
    mesh = init_device_mesh(get_device().type, (2, 2), mesh_dim_names=("dp", "tp"))
    model = job.model()
    layouts.apply_tp(model, mesh["tp"])  # lesson 08's plan, PyTorch's pieces
    layouts.apply_ac(model, "full" if recompute else "none")
    layouts.apply_fsdp(model, mesh["dp"])
    optimizer = job.optimizer(model.parameters())
    path, step = latest_checkpoint(directory)
    if path is not None:
        state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
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
            state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))
            dcp.save(state, checkpoint_id=checkpoint_path(directory, step))
    return losses, strategies.full_parameters(model)
