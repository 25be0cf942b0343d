"""Weights sent from trainer ranks to inference ranks after every optimizer step, as reinforcement
learning from feedback needs: the ranks that generate must use the policy the trainers just
updated. Lesson 10, notebooks/10_composing.ipynb.

Roles: ranks 0..T-1 train (data parallelism, lesson 06), ranks T..W-1 generate (inference).
Groups, created by every rank in this order (dist.new_group must be called by all ranks alike):
    trainers              ranks 0..T-1     the gradients' all_reduce
    inference             ranks T..W-1     the all_gather of "scatter + all_gather"
    source_and_inference  rank 0, T..W-1   the broadcasts from trainer 0
OpenRLHF does the same with a separate "model update" group that holds the actor's rank 0 and
the vLLM workers (openrlhf/trainer/ray/vllm_worker_wrap.py, `update_weight`: one broadcast from
rank 0 per named weight).

Three ways to move the weights. Before: the trainers hold the updated weights and the inference
ranks stale ones; after: every inference rank holds trainer 0's weights, bit for bit.
    per-tensor broadcast   one broadcast per parameter, from trainer 0
    bucketed broadcast     the parameters, in order, packed into flat buckets of at least
                           bucket_bytes (lesson 06's bucket_indices and Bucket); one broadcast
                           per bucket, from trainer 0
    scatter + all_gather   the flat weights, padded to a multiple of T*I elements, seen as
                           [I, T, chunk]: trainer t sends piece [i, t] to inference rank i (so
                           each trainer sends 1/T of the weights, all trainers at once), and
                           inference rank i, holding its row [i], all_gathers the rows with the
                           other inference ranks
In the alpha-beta model of lesson 04 a call on M bytes takes alpha + M / beta: the per-tensor
broadcast pays alpha once per parameter, the bucketed one once per bucket, for the same bytes.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers import reference
from helpers.data_parallelism.ddp import Bucket, average_gradients, bucket_indices
from helpers.instrument import Observer
from helpers.timing import take_turns

# {key: its label on screen}
VARIANTS = {"per_tensor": "per-tensor broadcast", "bucketed": "bucketed broadcast",
            "scatter_all_gather": "scatter + all_gather"}


@dataclass
class WeightGroups:
    trainer_ranks: list
    inference_ranks: list
    trainers: object  # each a ProcessGroup, or GroupMember.NON_GROUP_MEMBER on ranks outside it
    inference: object
    source_and_inference: object

    def is_trainer(self, rank: int) -> bool:
        return rank in self.trainer_ranks


def make_weight_groups(num_trainers: int, world_size: int) -> WeightGroups:
    """Ranks 0..num_trainers-1 train, the others generate. Every rank must call this (new_group
    is collective over the whole world, and all ranks must create the groups in the same order)."""
    if not 1 <= num_trainers < world_size:
        raise ValueError(f"need 1 to {world_size - 1} trainers out of {world_size} ranks, "
                         f"got {num_trainers}")
    trainer_ranks = list(range(num_trainers))
    inference_ranks = list(range(num_trainers, world_size))
    trainers = dist.new_group(trainer_ranks)
    inference = dist.new_group(inference_ranks)
    source_and_inference = dist.new_group([0, *inference_ranks])
    return WeightGroups(trainer_ranks, inference_ranks, trainers, inference, source_and_inference)


def weight_buckets(params: list, bucket_bytes: float | None) -> list:
    """Lesson 06's buckets over `params` in order: each closed once it holds at least
    `bucket_bytes`; one per parameter when `bucket_bytes` is None."""
    sizes = [param.numel() * param.element_size() for param in params]
    return [Bucket([params[i] for i in indices])
            for indices in bucket_indices(sizes, bucket_bytes)]


@torch.no_grad()
def broadcast_weights(buckets: list, group) -> None:
    """One broadcast per bucket from trainer 0 (the group's first rank) to the inference ranks.
    Before: trainer 0's parameters are the new ones. After: every rank of `group` holds them.
    A bucket of one parameter is broadcast in place; a larger one through its flat buffer."""
    source = dist.get_global_rank(group, 0)
    sending = dist.get_rank() == source
    for bucket in buckets:
        if bucket.flat is None:
            tensor = bucket.params[0]
        else:
            tensor = bucket.flat
            if sending:
                for view, param in zip(bucket.views, bucket.params):
                    view.copy_(param.flatten())
        dist.broadcast(tensor, src=source, group=group)  # the one distributed line
        if not sending and bucket.flat is not None:
            for view, param in zip(bucket.views, bucket.params):
                param.copy_(view.view_as(param))


def piece_elements(num_elements: int, num_trainers: int, num_inference: int) -> int:
    """The length of one piece [i, t] of the padded flat weights: ceil(P / (T * I))."""
    return math.ceil(num_elements / (num_trainers * num_inference))


@torch.no_grad()
def scatter_all_gather_weights(params: list, groups: WeightGroups) -> None:
    """Every trainer sends a different 1/T of the flat weights, then the inference ranks
    all_gather (see the module docstring for the [I, T, chunk] layout).
    Before: every trainer's parameters are the new ones (data parallelism keeps them equal).
    After: every inference rank holds them; the trainers' are unchanged."""
    trainers, inference = groups.trainer_ranks, groups.inference_ranks
    rank, numels = dist.get_rank(), [param.numel() for param in params]
    total = sum(numels)
    chunk = piece_elements(total, len(trainers), len(inference))
    flat = torch.zeros(len(inference), len(trainers), chunk, dtype=params[0].dtype)
    if groups.is_trainer(rank):
        flat.view(-1)[:total] = torch.cat([param.flatten() for param in params])
        mine = trainers.index(rank)  # this trainer sends column [:, mine], one piece per rank
        operations = [dist.P2POp(dist.isend, flat[i, mine], destination)
                      for i, destination in enumerate(inference)]
    else:
        row = torch.empty(len(trainers), chunk, dtype=flat.dtype)  # its row [i], from all
        operations = [dist.P2POp(dist.irecv, row[t], source) for t, source in enumerate(trainers)]
    for work in dist.batch_isend_irecv(operations):  # all trainers send at once
        work.wait()
    if groups.is_trainer(rank):
        return
    # every inference rank's row lands in its place in `flat`
    dist.all_gather(list(flat.view(len(inference), -1)), row.view(-1), group=groups.inference)
    for param, piece in zip(params, flat.view(-1)[:total].split(numels)):
        param.copy_(piece.view_as(param))


class WeightTransfer:
    """Moves `params` from the trainers to the inference ranks by one of VARIANTS; every rank
    builds one over its own parameters (same shapes everywhere) and calls it at the same point.
    Buckets are made once, here, as lesson 06's DDP makes its own."""

    def __init__(self, params: list, groups: WeightGroups, variant: str,
                 bucket_bytes: float | None = None):
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; choose one of {list(VARIANTS)}")
        self.params, self.groups, self.variant = list(params), groups, variant
        scattered = variant == "scatter_all_gather"
        self.takes_part = scattered or dist.get_rank() in (0, *groups.inference_ranks)
        if not scattered:
            self.buckets = weight_buckets(self.params,
                                          None if variant == "per_tensor" else bucket_bytes)

    def __call__(self) -> None:
        if not self.takes_part:  # trainers 1..T-1 have no part in a broadcast from trainer 0
            return
        if self.variant == "scatter_all_gather":
            scatter_all_gather_weights(self.params, self.groups)
        else:
            broadcast_weights(self.buckets, self.groups.source_and_inference)


@torch.no_grad()
def greedy_generate(model, prompt: torch.Tensor, new_tokens: int) -> tuple:
    """Greedy decoding: `new_tokens` times, run the whole sequence and append the most likely
    next token. `prompt` is [batch, length] token ids (length + new_tokens must fit the model's
    positions). Returns (the new tokens [batch, new_tokens], their logits [batch, new_tokens,
    vocab])."""
    tokens, all_logits = prompt, []
    for _ in range(new_tokens):
        logits = model(tokens)[:, -1]
        all_logits.append(logits)
        tokens = torch.cat([tokens, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return tokens[:, prompt.shape[1]:], torch.stack(all_logits, dim=1)


# --- the workers (lesson 10's notebook, tests and benchmarks/weights.py run them) ------------

def _stale(model):
    """An inference rank's copy before any transfer: the model's shapes, every weight NaN, so
    that a weight the transfer misses shows in the logits."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    return model


def weight_update_worker(rank, world_size, num_trainers, model, batches, prompt, new_tokens,
                         variant="bucketed", bucket_bytes=2**14, lr=1e-2):
    """Reinforcement learning's loop without the reward: per batch, the trainers take one
    data-parallel AdamW step (each on its slice of the batch, gradients averaged over the
    trainers' group, lesson 06), the weights go to the inference ranks by `variant`, and every
    rank decodes `new_tokens` greedily from `prompt` with the weights it now holds.
    Returns {"trainer", "steps": per step {"tokens", "logits"}, "parameters" (after the last
    step), "calls" (this rank's calls in the last transfer)}."""
    groups = make_weight_groups(num_trainers, world_size)
    trainer = groups.is_trainer(rank)
    local = copy.deepcopy(model) if trainer else _stale(model)
    optimizer = reference.make_optimizer("adamw", local.parameters(), lr) if trainer else None
    transfer = WeightTransfer(list(local.parameters()), groups, variant, bucket_bytes)
    steps = []
    for batch in batches:
        if trainer:
            shard = batch.shard(rank, num_trainers)
            optimizer.zero_grad()
            reference.lm_loss(local(shard.inputs), shard.targets).backward()
            average_gradients(local, group=groups.trainers)
            optimizer.step()
        calls = _calls(transfer)  # the trainers' new weights reach the inference ranks
        tokens, logits = greedy_generate(local, prompt, new_tokens)
        steps.append({"tokens": tokens, "logits": logits})
    return {"trainer": trainer, "steps": steps, "parameters": reference.parameters(local),
            "calls": calls}


def delivered_weights_worker(rank, world_size, num_trainers, model, bucket_bytes):
    """Each variant in turn moves trainer `model`'s weights to inference ranks that start from
    NaN. Returns {variant: {"parameters": what this rank holds after, "calls": its calls}}."""
    groups = make_weight_groups(num_trainers, world_size)
    delivered = {}
    for variant in VARIANTS:
        local = copy.deepcopy(model) if groups.is_trainer(rank) else _stale(model)
        calls = _calls(WeightTransfer(list(local.parameters()), groups, variant, bucket_bytes))
        delivered[variant] = {"parameters": reference.parameters(local), "calls": calls}
    return delivered


def _calls(transfer) -> list:
    """(name, bytes sent, bytes received) of each call this rank makes in one `transfer()`."""
    with Observer() as observed:
        transfer()
    return [(record.name, record.sent, record.received) for record in observed.records]


def transfer_times_worker(rank, world_size, num_trainers, widths, layers=4, bucket_bytes=2**20,
                          repeats=5):
    """For TinyLMs of each width (`layers` blocks, built on every rank: no model travels), the
    median seconds of `repeats` transfers by each variant, after one to warm up, the variants
    taking turns. Returns per width {"width", "parameters" (count), "tensors", "seconds":
    {variant: s}, "calls": {variant: this rank's calls in one transfer}}."""
    groups = make_weight_groups(num_trainers, world_size)
    sweep = []
    for width in widths:
        model = reference.make_lm(dim=width, layers=layers)
        params = list(model.parameters())
        transfers = {variant: WeightTransfer(params, groups, variant, bucket_bytes)
                     for variant in VARIANTS}
        sweep.append({"width": width, "parameters": sum(param.numel() for param in params),
                      "tensors": len(params),
                      "seconds": take_turns(transfers, rounds=repeats),
                      "calls": {variant: _calls(transfers[variant]) for variant in VARIANTS}})
    return sweep
