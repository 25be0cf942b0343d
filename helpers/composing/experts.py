"""A mixture-of-experts layer, and expert parallelism: one expert per rank, every token carried to
its expert's rank and back by uneven all-to-alls. Lesson 10, notebooks/10_composing.ipynb.

The layer (Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer", ICLR 2017). A router nn.Linear(dim, E) scores each token; softmax turns
the scores into probabilities p_1..p_E; the token goes to its k most probable experts and the
layer returns sum over those experts of p_e * expert_e(token). Each expert is the course's
reference.FeedForward(dim). k = 1 is the Switch Transformer's routing (Fedus, Zoph and Shazeer,
"Switch Transformers", arXiv 2101.03961, 2021), k = 2 GShard's (Lepikhin et al., "GShard", arXiv
2006.16668, 2020).
The weights p_e are NOT renormalised over the k chosen experts. That is what the Switch
Transformer does for k = 1 (renormalised, a single weight would always be 1 and the router would
get no gradient from the output). Shazeer et al. take the softmax over the k kept scores only, and
GShard divides its two weights by their sum: both renormalise. We do not, so that top-1 and top-2
follow one rule.

Capacity (GShard §2.2, Algorithm 1; Switch §2.2). Tokens are routed in groups: here one group per
rank, the rank's own T tokens. Each expert accepts at most
    C = floor(capacity_factor * T * k / E)
assignments from each group; with k = 1 this is the Switch Transformer's "expert capacity =
(tokens per batch / number of experts) * capacity factor", applied to each rank's batch. Beyond C
an assignment is dropped: it contributes zero (the residual connection around the layer, outside
it, carries the token on). First choices are placed before second choices, each in token order
(GShard's Algorithm 1, without its random dropping of second choices). `MoE.forward(tokens,
num_groups)` applies the same rule to the same groups in one process: it is the reference.

Expert parallelism, E = world size, rank r holds expert r. The communication phases:
    before   rank r holds its T tokens (rows r T .. (r+1) T - 1 of the batch), a copy of the
             router and expert r
    route    locally: each kept (token, choice) names an expert, that is, a rank
    counts   all_to_all_single of E integers: how many rows rank r sends each rank, and so how
             many it will receive from each
    dispatch all_to_all_single of the token rows, sorted by destination, with those uneven splits
    compute  expert r runs on every row it received (source rank by source rank)
    combine  the reverse all_to_all_single: each result goes back to its token's rank
    after    rank r holds the outputs of its own T tokens: sum of p_e * result_e
In backward, each all-to-all's gradient is the reverse all-to-all (input and output splits
swapped): `dispatch` and `combine` are one autograd Function. The router is replicated, like a
data-parallel model: each rank's router gradient comes from its own tokens, and the ranks SUM them
(`sum_router_gradients`), since each rank's loss is its tokens' part of one loss over the whole
batch. (With a mean loss per rank one would average the router's gradients instead, and divide the
experts' by the world size.)

The communication (`exchange_counts`, `dispatch`, `combine`) comes first in this file; the layers
that use it (`MoE`, `ExpertParallelMoE`) after.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers import reference
from helpers.instrument import Observer

# --- communication ------------------------------------------------------------------------------


def exchange_counts(send_counts: list, group=None) -> list:
    """All-to-all of one integer per rank. Before: rank r knows send_counts[d], the rows it will
    send rank d. After: it knows how many rows each rank will send it (in source-rank order)."""
    send = torch.tensor(send_counts, dtype=torch.int64)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.tolist()


def _all_to_all_rows(rows, output_splits, input_splits, group):
    """Rows input_splits[d] of `rows` go to rank d; output_splits[s] rows arrive from rank s."""
    rows = rows.contiguous()
    received = rows.new_empty(sum(output_splits), *rows.shape[1:])
    dist.all_to_all_single(received, rows, output_splits, input_splits, group=group)
    return received


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all with (output_splits, input_splits). Backward: the reverse all-to-all,
    (input_splits, output_splits): each row's gradient goes back to the rank the row came from."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all_rows(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all_rows(grad, input_splits, output_splits, ctx.group), None, None, None


def dispatch(rows, send_counts: list, group=None):
    """Before: `rows` sorted by destination rank, send_counts[d] of them for rank d. After: the
    rows every rank sent this one, source rank by source rank, and how many came from each.
    Two all-to-alls: the counts, then the rows."""
    received_counts = exchange_counts(send_counts, group)
    rows = _AllToAll.apply(rows, received_counts, send_counts, group)
    return rows, received_counts


def combine(rows, received_counts: list, send_counts: list, group=None):
    """The reverse of `dispatch`: the results of the rows received from rank s go back to rank s,
    which gets them in the order it sent the rows (no counts to exchange: both sides know them)."""
    return _AllToAll.apply(rows, send_counts, received_counts, group)


# --- routing ------------------------------------------------------------------------------------


def expert_capacity(num_tokens: int, k: int, num_experts: int, capacity_factor) -> int | None:
    """C = floor(capacity_factor * T * k / E): the assignments an expert accepts from a group of
    T tokens (None: no limit)."""
    if capacity_factor is None:
        return None
    return math.floor(capacity_factor * num_tokens * k / num_experts)


def within_capacity(experts: torch.Tensor, num_experts: int, capacity: int | None):
    """(T, k) bool: which assignments an expert accepts, at most `capacity` each, first choices
    before second choices, each in token order (GShard's Algorithm 1)."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    choice_major = experts.t().reshape(-1)  # every token's first choice, then second choices
    one_hot = F.one_hot(choice_major, num_experts)
    place_in_queue = (one_hot.cumsum(0) * one_hot).sum(1) - 1
    return (place_in_queue < capacity).view(experts.shape[1], -1).t()


@dataclass
class Routing:
    """One group's routing: for each of its T tokens, its k experts and their weights."""
    experts: torch.Tensor  # (T, k) expert indices, most probable first
    weights: torch.Tensor  # (T, k) their softmax probabilities (differentiable)
    kept: torch.Tensor  # (T, k) bool: False where the expert was full
    capacity: int | None  # C, the assignments each expert accepts from this group

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())

    def routed_per_expert(self, num_experts: int) -> torch.Tensor:
        """Assignments to each expert before the capacity limit."""
        return torch.bincount(self.experts.flatten(), minlength=num_experts)

    def kept_per_expert(self, num_experts: int) -> torch.Tensor:
        """Assignments each expert accepted."""
        return torch.bincount(self.experts[self.kept], minlength=num_experts)


def route(router: nn.Linear, tokens: torch.Tensor, k: int, capacity_factor=None) -> Routing:
    """Top-k routing of a group of tokens (T, dim) by softmax probabilities, weights not
    renormalised, then the capacity limit."""
    probabilities = torch.softmax(router(tokens), dim=-1)
    weights, experts = probabilities.topk(k, dim=-1)
    num_experts = router.out_features
    capacity = expert_capacity(tokens.shape[0], k, num_experts, capacity_factor)
    return Routing(experts, weights, within_capacity(experts, num_experts, capacity), capacity)


# --- the layers ---------------------------------------------------------------------------------


class MoE(nn.Module):
    """A router nn.Linear(dim, E) and E experts reference.FeedForward(dim), in one process: the
    reference that expert parallelism is checked against."""

    def __init__(self, dim: int, num_experts: int, k: int = 1, capacity_factor=None):
        super().__init__()
        self.router = nn.Linear(dim, num_experts)
        self.experts = nn.ModuleList(reference.FeedForward(dim) for _ in range(num_experts))
        self.k, self.capacity_factor = k, capacity_factor

    def routings(self, tokens: torch.Tensor, num_groups: int = 1) -> list:
        """The Routing of each of `num_groups` consecutive groups of `tokens` (the ranks')."""
        return [route(self.router, group, self.k, self.capacity_factor)
                for group in tokens.tensor_split(num_groups)]

    def forward(self, tokens: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
        """tokens (N, dim) -> (N, dim), routed in `num_groups` consecutive groups, each with its
        own capacity: expert parallelism's ranks, computed here one after the other."""
        groups = tokens.tensor_split(num_groups)
        return torch.cat([self._group_output(group, routing)
                          for group, routing in zip(groups, self.routings(tokens, num_groups))])

    def _group_output(self, tokens, routing):
        output = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            token, choice = ((routing.experts == index) & routing.kept).nonzero(as_tuple=True)
            weight = routing.weights[token, choice].unsqueeze(1)
            output = output.index_add(0, token, weight * expert(tokens[token]))
        return output


def make_moe(dim: int = 16, num_experts: int = 4, k: int = 1, capacity_factor=None,
             seed: int = 0) -> MoE:
    """An MoE whose weights depend only on `seed`."""
    return reference.seeded(seed, lambda: MoE(dim, num_experts, k, capacity_factor))


class ExpertParallelMoE(nn.Module):
    """Rank r's part of `moe`, whose E experts are the group's E ranks: a copy of the router and
    expert r. Forward: this rank's tokens in, their outputs out (see the module's docstring)."""

    def __init__(self, moe: MoE, group=None):
        super().__init__()
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if len(moe.experts) != world_size:
            raise ValueError(f"one expert per rank: {len(moe.experts)} experts on "
                             f"{world_size} ranks")
        self.router, self.expert = copy.deepcopy(moe.router), copy.deepcopy(moe.experts[rank])
        self.k, self.capacity_factor, self.group = moe.k, moe.capacity_factor, group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward_with_routing(tokens)[0]

    def forward_with_routing(self, tokens):
        """This rank's outputs, and its Routing."""
        routing = route(self.router, tokens, self.k, self.capacity_factor)
        token, choice = routing.kept.nonzero(as_tuple=True)
        by_destination = torch.argsort(routing.experts[token, choice], stable=True)
        token, choice = token[by_destination], choice[by_destination]
        send_counts = routing.kept_per_expert(self.router.out_features).tolist()
        received, received_counts = dispatch(tokens[token], send_counts, self.group)
        results = combine(self.expert(received), received_counts, send_counts, self.group)
        weight = routing.weights[token, choice].unsqueeze(1)
        return torch.zeros_like(tokens).index_add(0, token, weight * results), routing


def sum_router_gradients(layer: ExpertParallelMoE):
    """Before: each rank's router gradient from its own tokens. After: their sum, on every rank."""
    for param in layer.router.parameters():
        dist.all_reduce(param.grad, group=layer.group)


# --- bytes --------------------------------------------------------------------------------------


def all_to_all_bytes(kept_counts, rank: int, dim: int, element_size: int = 4) -> dict:
    """Bytes rank `rank` sends to and receives from other ranks, by formula: kept_counts[s][e] is
    how many assignments source rank s sends expert e (on rank e). Dispatch: every row for another
    expert leaves the rank, every row from another rank arrives, dim * element_size bytes each;
    combine is the mirror. phase -> (sent, received)."""
    row_bytes = dim * element_size
    others = [other for other in range(len(kept_counts)) if other != rank]
    sent = sum(kept_counts[rank][expert] for expert in others) * row_bytes
    received = sum(kept_counts[source][rank] for source in others) * row_bytes
    return {"dispatch": (sent, received), "combine": (received, sent)}


def uniform_all_to_all_bytes(num_tokens: int, k: int, dim: int, world_size: int,
                             element_size: int = 4) -> float:
    """What one rank sends in one all-to-all when routing is uniform and nothing is dropped: of its
    T k assignments, (E - 1) / E go to other ranks. (E - 1)/E * T * k * dim * element_size."""
    return (world_size - 1) / world_size * num_tokens * k * dim * element_size


# --- the worker (lesson 10's notebook and tests run it) ---------------------------------------

# moe_worker's all-to-alls of rows, in the order they run
MOE_PHASES = ("dispatch", "combine", "combine backward", "dispatch backward")


def moe_worker(rank, world_size, moe, tokens, output_grad):
    """Expert parallelism, one expert per rank: rank r takes its slice of `tokens` (N, dim), the
    ranks' N / E each in rank order, through ExpertParallelMoE(moe), then backward from the
    loss sum(output * output_grad) over the whole batch, each rank its own slice's part.
    Returns its outputs, its tokens' gradient, its expert's and the router's gradients (named as
    in `moe`), its routing's counts, and the bytes of every all-to-all of rows."""
    layer = ExpertParallelMoE(moe)
    local = tokens.tensor_split(world_size)[rank].clone().requires_grad_()
    with Observer() as observed:
        output, routing = layer.forward_with_routing(local)
        (output * output_grad.tensor_split(world_size)[rank]).sum().backward()
    # forward: the counts' all-to-all, dispatch's rows, combine's; backward: the rows' in reverse
    counts, *rows = [record for record in observed.records if record.name == "all_to_all_single"]
    traffic = [{"phase": phase, "sent_bytes": record.sent, "received_bytes": record.received}
               for phase, record in zip(MOE_PHASES, rows, strict=True)]
    sum_router_gradients(layer)  # the replicated router: gradients summed, as in data parallelism
    grads = {f"router.{name}": param.grad for name, param in layer.router.named_parameters()}
    grads.update({f"experts.{rank}.{name}": param.grad
                  for name, param in layer.expert.named_parameters()})
    return {"output": output.detach(), "input_grad": local.grad, "grads": grads,
            "routed_per_expert": routing.routed_per_expert(world_size).tolist(),
            "kept_per_expert": routing.kept_per_expert(world_size).tolist(),
            "dropped": routing.dropped, "capacity": routing.capacity,
            "capacity_factor": layer.capacity_factor, "traffic": traffic}
