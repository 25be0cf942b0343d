"""Resuming a training run exactly (lesson 12, notebooks/12_checkpoints_and_failures.ipynb).

A run stopped after step k and resumed in new processes ends where the uninterrupted run ends
only if the checkpoint holds everything step k + 1 depends on:

    the model                    its weights (sharded: DCP)
    the optimizer                AdamW's step count and running averages
    the sampler's position       which epoch (the shuffle's seed) and how far into it
    every rank's RNG state       the random draws of the next steps (dropout, noise, masking)
    the loss scaler              with float16 (lesson 11): its scale and growth count
                                 (GradScaler.state_dict()); not used here, in float64

Experiment is a small job that needs all but the last: a shuffled DistributedSampler that
crosses epochs, and input noise drawn from torch's global RNG on each rank. resumable_worker is
the loop: it loads the newest complete checkpoint in its directory, if there is one, and saves
every `save_every` steps. `Experiment.leave_out` names pieces to leave out of the checkpoint, to
see what breaks. async_save_worker saves in the background while training goes on, and records
a timeline of both.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.utils.data import DistributedSampler

from helpers import reference, strategies
from helpers.checkpoints_and_failures.sharded import full_state
from helpers.launcher.result import get_device
from helpers.timing import Clock
from helpers.training import mean_over

PIECES = ("model", "optimizer", "sampler", "rng")  # what a checkpoint here holds
OPTIONAL = PIECES[1:]  # what Experiment.leave_out may name


@dataclass(frozen=True)
class Experiment:
    """A small training job whose next step depends on more than the model (see the module
    docstring). Every rank trains on `batch_size` sequences a step, in float64."""

    steps: int = 10
    save_every: int = 5
    sequences: int = 32  # the dataset; an epoch is sequences / (ranks x batch_size) steps
    batch_size: int = 4
    noise: float = 0.25  # the fraction of input tokens each rank replaces with random ones
    vocab: int = 64  # the model's and the data's
    seed: int = 0
    leave_out: tuple = ()  # pieces of OPTIONAL the checkpoint leaves out (to see what breaks)

    def __post_init__(self):
        unknown = set(self.leave_out) - set(OPTIONAL)
        if unknown:
            raise ValueError(f"leave_out may name {OPTIONAL}, not {sorted(unknown)}")

    def model(self):
        return reference.make_lm(vocab=self.vocab, seed=self.seed).double()

    def sampler(self, rank: int, world_size: int) -> DistributedSampler:
        return DistributedSampler(range(self.sequences), num_replicas=world_size, rank=rank,
                                  shuffle=True, seed=self.seed, drop_last=True)

    def batch(self, sampler: DistributedSampler, epoch: int, offset: int) -> reference.Batch:
        """The `offset`-th batch of `epoch` from this rank's sampler, with noise from torch's
        global RNG: each input token replaced by a random one with probability `noise`."""
        sampler.set_epoch(epoch)
        indices = list(sampler)[offset * self.batch_size:(offset + 1) * self.batch_size]
        data = reference.lm_data(seed=self.seed, batch_size=self.sequences, vocab=self.vocab)[0]
        inputs = data.inputs[indices].clone()
        noisy = torch.rand(inputs.shape) < self.noise
        inputs[noisy] = torch.randint(0, self.vocab, (int(noisy.sum()),))
        return reference.Batch(inputs, data.targets[indices])

    def steps_per_epoch(self, world_size: int) -> int:
        return self.sequences // (world_size * self.batch_size)


# --- the checkpoint of a training run -----------------------------------------------------------

def training_state(model, optimizer, position: dict, leave_out=()) -> dict:
    """What a checkpoint of this run holds, as DCP saves it: the model and optimizer as DTensors
    keyed by name, the sampler's position, and this rank's RNG state under a key of its own (each
    rank draws its own numbers; a key all ranks share would be saved once, by one rank)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "sampler": dict(position),
             f"rng.rank{dist.get_rank()}": torch.get_rng_state()}
    return {key: value for key, value in state.items() if key.split(".")[0] not in leave_out}


def load_training(path, model, optimizer, position: dict, leave_out=()) -> None:
    """Load the checkpoint at `path` into the model, optimizer, sampler position and RNG."""
    state = training_state(model, optimizer, position, leave_out)
    dcp.load(state, checkpoint_id=path)  # fills tensors in place, replaces the plain values
    if "optimizer" in state:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
    else:
        set_model_state_dict(model, state["model"])
    position.update(state.get("sampler", {}))
    rng = state.get(f"rng.rank{dist.get_rank()}")
    if rng is not None:
        torch.set_rng_state(rng)


def checkpoint_path(directory, step: int) -> str:
    return os.path.join(directory, f"step-{step:04d}")


def latest_checkpoint(directory) -> tuple:
    """(path, step) of the newest complete checkpoint in `directory`, or (None, 0). DCP writes
    .metadata last, once every rank has written its pieces: a checkpoint without it was cut off
    (a rank died while saving), and is skipped. A directory not made yet holds none."""
    if not os.path.isdir(directory):
        return None, 0
    steps = sorted(int(name.removeprefix("step-")) for name in os.listdir(directory)
                   if name.startswith("step-")
                   and os.path.exists(os.path.join(directory, name, ".metadata")))
    return (checkpoint_path(directory, steps[-1]), steps[-1]) if steps else (None, 0)


def keep_last(directory, k: int) -> list:
    """Keep the k newest complete checkpoints in `directory` (complete: with .metadata, which DCP
    writes last) and remove every other step directory older than the newest complete one, cut
    off ones included. A directory newer than that is left alone: it may be a save still being
    written. Call it on one rank, after a save has returned on every rank. Returns the steps
    removed."""
    if k < 1:
        raise ValueError("keep at least the newest checkpoint")
    steps = sorted(int(name.removeprefix("step-")) for name in os.listdir(directory)
                   if name.startswith("step-"))
    complete = [step for step in steps
                if os.path.exists(os.path.join(checkpoint_path(directory, step), ".metadata"))]
    kept = complete[-k:]
    removed = [step for step in steps if complete and step < complete[-1] and step not in kept]
    for step in removed:
        shutil.rmtree(checkpoint_path(directory, step))
    return removed


# --- the loop -----------------------------------------------------------------------------------

def resumable_worker(rank, world_size, experiment, directory, stop_after=None, on_event=None):
    """Train `experiment` under FSDP, resuming from the newest checkpoint in `directory`; save
    every experiment.save_every steps. `stop_after` ends this run after that step (the job goes
    on in new processes); `on_event(what, step)` is called on "started", after each "step" and
    each "saved" (a log, a kill); "started" gives the step it starts after.
    Returns {step: loss averaged over ranks} for the steps this run trained, and the whole state
    at the end."""
    model, optimizer = strategies.build("fully_shard", experiment.model())
    sampler = experiment.sampler(rank, world_size)
    torch.manual_seed(experiment.seed + rank)  # each rank draws its own noise
    position = {"epoch": 0, "offset": 0}
    path, step = latest_checkpoint(directory)
    if path is not None:
        load_training(path, model, optimizer, position, experiment.leave_out)
    on_event = on_event or (lambda what, step: None)
    on_event("started", step)
    losses = {}
    while step < min(experiment.steps, stop_after or experiment.steps):
        batch = experiment.batch(sampler, position["epoch"], position["offset"]).to(get_device())
        optimizer.zero_grad()
        loss = reference.lm_loss(model(batch.inputs), batch.targets)
        loss.backward()
        optimizer.step()
        step += 1
        advance(position, experiment.steps_per_epoch(world_size))
        losses[step] = mean_over(loss.item(), group=None)  # the whole batch's loss
        on_event("step", step)
        if step % experiment.save_every == 0:
            dcp.save(training_state(model, optimizer, position, experiment.leave_out),
                     checkpoint_id=checkpoint_path(directory, step))
            on_event("saved", step)
    return {"losses": losses, "state": full_state(model, optimizer)}


def each_worker(rank, world_size, experiments, directories, stop_after=None):
    """resumable_worker for each experiment, in its directory, one after the other: several runs
    in one launch. Returns their results in order."""
    return [resumable_worker(rank, world_size, experiment, directory, stop_after=stop_after)
            for experiment, directory in zip(experiments, directories)]


def advance(position: dict, steps_per_epoch: int) -> None:
    """The sampler's position after one more batch: the next offset, or the next epoch's start."""
    position["offset"] += 1
    if position["offset"] == steps_per_epoch:
        position.update(epoch=position["epoch"] + 1, offset=0)


def global_batches(experiment, world_size: int) -> list:
    """What one process trains on (reference.train, the reference): for each step, every rank's
    batch (and its noise, from that rank's own generator state) concatenated into one. Each rank's
    batch is the same size, so the whole batch's mean loss is the mean of the ranks' losses, whose
    gradient FSDP averages."""
    samplers = [experiment.sampler(rank, world_size) for rank in range(world_size)]
    rng_states = [torch.manual_seed(experiment.seed + rank).get_state()
                  for rank in range(world_size)]
    saved = torch.get_rng_state()
    batches, per_epoch = [], experiment.steps_per_epoch(world_size)
    for step in range(experiment.steps):
        epoch, offset = divmod(step, per_epoch)
        parts = []
        for rank in range(world_size):
            torch.set_rng_state(rng_states[rank])
            parts.append(experiment.batch(samplers[rank], epoch, offset))
            rng_states[rank] = torch.get_rng_state()
        batches.append(reference.Batch(torch.cat([part.inputs for part in parts]),
                                       torch.cat([part.targets for part in parts])))
    torch.set_rng_state(saved)
    return batches


# --- saving in the background -------------------------------------------------------------------

def async_save_worker(rank, world_size, experiment, directory, asynchronous=True):
    """Train experiment.steps steps, saving every save_every steps with dcp.async_save (or
    dcp.save, `asynchronous=False`), and record when each step and each save ran on this rank.
    async_save copies the state into CPU memory (staging) and returns a future; a background
    thread writes the copy while training goes on. It passes async_save a gloo group of
    its own (required where training runs on NCCL alone: async_save refuses a group without a
    CPU backend; here it keeps the background thread's collectives off the default group), and
    it waits for one save to finish writing before it starts the next (our choice).
    Returns the events [(what, start, end)] in seconds from the first step, the bytes staged
    (one more copy of this rank's state), and the whole state at the end."""
    model, optimizer = strategies.build("fully_shard", experiment.model())
    sampler = experiment.sampler(rank, world_size)
    torch.manual_seed(experiment.seed + rank)
    saving_group = dist.new_group(backend="gloo")
    position, events, pending, staged = {"epoch": 0, "offset": 0}, [], None, 0
    dist.barrier()
    now = Clock()  # seconds since the ranks left the barrier
    for step in range(1, experiment.steps + 1):
        started = now()
        batch = experiment.batch(sampler, position["epoch"], position["offset"]).to(get_device())
        optimizer.zero_grad()
        reference.lm_loss(model(batch.inputs), batch.targets).backward()
        optimizer.step()
        advance(position, experiment.steps_per_epoch(world_size))
        events.append((f"step {step}", started, now()))
        if step % experiment.save_every:
            continue
        if pending is not None:
            waited = now()
            pending.result()  # one save in flight at a time
            events.append(("wait", waited, now()))
        state = training_state(model, optimizer, position)
        started = now()
        if asynchronous:
            staged = local_bytes(state)
            pending = dcp.async_save(state, checkpoint_id=checkpoint_path(directory, step),
                                     process_group=saving_group)
            events.append(("stage", started, now()))
            # the write ends when its future does (an AsyncSaveResponse holds it, or it is one)
            pending = getattr(pending, "upload_completion", pending)
            pending.add_done_callback(
                lambda _, started=started: events.append(("write", started, now())))
        else:
            dcp.save(state, checkpoint_id=checkpoint_path(directory, step))
            events.append(("save", started, now()))
    if pending is not None:
        pending.result()
    return {"events": sorted(events, key=lambda event: event[1]), "staged bytes": staged,
            "state": full_state(model, optimizer)}


def local_bytes(state) -> int:
    """The bytes of this rank's own pieces of every tensor in `state`."""
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += local_bytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total
