"""Reference solutions of lesson 12's exercises. Try the exercise first."""

import torch
import torch.distributed.checkpoint as dcp

from helpers import strategies
from helpers.checkpoints_and_failures.failures import records
from helpers.checkpoints_and_failures.resume import (
    advance,
    checkpoint_path,
    latest_checkpoint,
    load_training,
    training_state,
)
from helpers.checkpoints_and_failures.sharded import full_state
from helpers.launcher.result import get_device
from helpers.reference import lm_loss
from helpers.training import mean_over


def resumable(rank, world_size, job, directory):
    model, optimizer = strategies.build("fully_shard", job.model())
    scheduler = job.scheduler(optimizer)
    sampler = job.sampler(rank, world_size)
    torch.manual_seed(job.seed + rank)
    position = {"epoch": 0, "offset": 0}
    path, step = latest_checkpoint(directory)
    if path is not None:
        # the lesson's state, and the scheduler's: where the warm-up is
        extra = {"scheduler": scheduler.state_dict()}
        dcp.load(extra, checkpoint_id=path)
        scheduler.load_state_dict(extra["scheduler"])
        load_training(path, model, optimizer, position)
    losses = {}
    while step < job.steps:
        batch = job.batch(sampler, position["epoch"], position["offset"]).to(get_device())
        optimizer.zero_grad()
        loss = lm_loss(model(batch.inputs), batch.targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        step += 1
        advance(position, job.steps_per_epoch(world_size))
        losses[step] = mean_over(loss.item(), group=None)
        if step % job.save_every == 0:
            state = training_state(model, optimizer, position)
            state["scheduler"] = scheduler.state_dict()
            dcp.save(state, checkpoint_id=checkpoint_path(directory, step))
    return losses, full_state(model, optimizer)


def fell_out_of_step(dumps):
    by_rank = [{seq: (name, sizes) for seq, name, sizes, _ in records(dump)} for dump in dumps]
    first = max(min(calls) for calls in by_rank if calls)  # every rank still holds it
    last = max(max(calls) for calls in by_rank if calls)
    for seq in range(first, last + 1):
        calls = [calls.get(seq) for calls in by_rank]
        for rank, call in enumerate(calls):
            others = calls[:rank] + calls[rank + 1:]
            if all(other == others[0] for other in others) and call != others[0]:
                return rank
    raise ValueError("every rank called the same collectives")
