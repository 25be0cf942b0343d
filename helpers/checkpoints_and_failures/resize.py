"""Resuming on another number of ranks (lesson 12, notebooks/12_checkpoints_and_failures.ipynb).

resume.py's loop saves a data position and RNG states per rank: exact, but only on the same
number of ranks. Here the position is one number, the samples the whole job has consumed, as
Megatron-LM counts `args.consumed_train_samples` (megatron/training/checkpointing.py restores it
from a checkpoint's saved arguments) and hands it to its sampler
(megatron/training/datasets/data_samplers.py, `MegatronPretrainingSampler`, at
NVIDIA/Megatron-LM@98d8c56: it takes the samples in order, micro-batch x dp at a time, and gives
rank r of d the r-th micro-batch of each group). Each step consumes a global batch
of `global_batch` samples, whatever the world size; rank r of n takes the r-th share of
global_batch / n. The noise of a sample is drawn from a generator seeded by the sample's
position in the run, not by the rank (as Megatron's `RandomSeedDataset` seeds each sample by its
index): a sample gets the same noise on any number of ranks.

    step k, n ranks        global batch k = samples [8(k-1), 8k) of the run's order
                           rank r: the samples [8(k-1) + r 8/n, 8(k-1) + (r+1) 8/n)
    the checkpoint         the model and optimizer (DCP reshards them) and
                           {"consumed_train_samples": 8k}, one value every rank shares

So a job saved on 4 ranks resumes on 2, each rank taking twice the share (or, with the same
share, two micro-batches of gradient accumulation), and trains the steps the uninterrupted job
would have trained.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from helpers import reference, strategies
from helpers.checkpoints_and_failures.resume import checkpoint_path, keep_last, latest_checkpoint
from helpers.checkpoints_and_failures.sharded import full_state
from helpers.launcher.result import get_device
from helpers.timing import slowest_rank_seconds
from helpers.training import mean_over


@dataclass(frozen=True)
class GlobalBatchJob:
    """A job whose step k is the same global batch on any number of ranks (module docstring).
    An epoch is sequences / global_batch steps; each epoch reshuffles the whole dataset."""

    steps: int = 8
    global_batch: int = 8  # sequences a step, on any number of ranks
    sequences: int = 32  # the dataset
    noise: float = 0.25  # the fraction of input tokens replaced by random ones
    vocab: int = 64
    seed: int = 0
    save_every: int = 2
    keep: int = 2  # checkpoints kept on disk (resume.keep_last)

    def __post_init__(self):
        if self.sequences % self.global_batch:
            raise ValueError("an epoch must hold a whole number of global batches")

    def model(self):
        return reference.make_lm(vocab=self.vocab, seed=self.seed).double()

    def samples(self, consumed: int, rank: int, world_size: int) -> list:
        """Rank `rank`'s share of the global batch that follows `consumed` samples: the indices
        into the dataset, and their positions in the run (which seed their noise)."""
        if self.global_batch % world_size:
            raise ValueError(f"{world_size} ranks cannot share a global batch of "
                             f"{self.global_batch}")
        share = self.global_batch // world_size
        epoch, start = divmod(consumed, self.sequences)
        order = torch.randperm(self.sequences,
                               generator=torch.Generator().manual_seed(self.seed + epoch))
        first = start + rank * share
        return [(order[first + i].item(), consumed + rank * share + i) for i in range(share)]

    def batch(self, consumed: int, rank: int, world_size: int) -> reference.Batch:
        data = reference.lm_data(seed=self.seed, batch_size=self.sequences, vocab=self.vocab)[0]
        inputs, targets = [], []
        for index, position in self.samples(consumed, rank, world_size):
            generator = torch.Generator().manual_seed(1_000_003 * (self.seed + 1) + position)
            tokens = data.inputs[index].clone()
            noisy = torch.rand(tokens.shape, generator=generator) < self.noise
            tokens[noisy] = torch.randint(0, self.vocab, (int(noisy.sum()),),
                                          generator=generator)
            inputs.append(tokens)
            targets.append(data.targets[index])
        return reference.Batch(torch.stack(inputs), torch.stack(targets))


def resized_worker(rank, world_size, job, directory, stop_after=None):
    """Train `job` under FSDP on `world_size` ranks, resuming from the newest checkpoint in
    `directory`, whatever number of ranks saved it; save every job.save_every steps and keep the
    newest job.keep. Returns {step: loss of the global batch} for the steps this run trained,
    the step it started after, each save's seconds (slowest rank, from a barrier), the step
    directories rank 0 removed, and the whole state at the end."""
    model, optimizer = strategies.build("fully_shard", job.model())
    progress = {"consumed_train_samples": 0}
    path, step = latest_checkpoint(directory)
    if path is not None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "progress": progress}
        dcp.load(state, checkpoint_id=path)  # each rank reads the pieces it holds now
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        progress = state["progress"]  # one number, whoever saved it
    started_after, losses, save_seconds, removed = step, {}, [], []
    while step < min(job.steps, stop_after or job.steps):
        consumed = progress["consumed_train_samples"]
        batch = job.batch(consumed, rank, world_size).to(get_device())
        optimizer.zero_grad()
        loss = reference.lm_loss(model(batch.inputs), batch.targets)  # the mean over my share
        loss.backward()  # FSDP averages the gradients over the ranks: the global batch's
        optimizer.step()
        step += 1
        progress = {"consumed_train_samples": consumed + job.global_batch}
        losses[step] = mean_over(loss.item(), group=None)
        if step % job.save_every == 0:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state, "progress": progress}
            save = functools.partial(dcp.save, state,
                                     checkpoint_id=checkpoint_path(directory, step))
            save_seconds.append(slowest_rank_seconds(save))
            if dist.get_rank() == 0:  # every rank has returned from dcp.save: it is complete
                removed += keep_last(directory, job.keep)
    return {"losses": losses, "started after": started_after, "save seconds": save_seconds,
            "removed": removed, "state": full_state(model, optimizer)}


def global_batches(job) -> list:
    """The whole global batch of each of job.steps steps: what one process trains on
    (reference.train, the reference)."""
    return [job.batch(step * job.global_batch, 0, 1) for step in range(job.steps)]
