"""Reference solutions of lesson 10's exercises (helpers.composing.exercises)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.composing.mesh import Grid, new_groups
from helpers.tensor_parallelism.megatron import ReduceFromRegion

# --- composing ----------------------------------------------------------------------------------


def mesh_groups(rank, world_size, sizes):
    grid = Grid(tuple(f"dim{axis}" for axis in range(len(sizes))), tuple(sizes))
    groups = new_groups(grid, rank)  # every rank creates every group, in the same order
    return [dist.get_process_group_ranks(groups[dim]) for dim in grid.dims]


def dp_tp_step(rank, world_size, w1, w2, x, y, tp):
    grid = Grid(("dp", "tp"), (world_size // tp, tp))
    groups, place = new_groups(grid, rank), grid.coordinates(rank)
    up = w1.chunk(tp)[place["tp"]].clone().requires_grad_()  # column-parallel: rows of W1
    down = w2.chunk(tp, dim=1)[place["tp"]].clone().requires_grad_()  # row-parallel: columns
    x, y = x.chunk(grid.sizes[0])[place["dp"]], y.chunk(grid.sizes[0])[place["dp"]]
    partial = F.gelu(x @ up.T) @ down.T  # this rank's share of the output
    out = ReduceFromRegion.apply(partial, groups["tp"])  # g: the tp ranks' shares summed
    ((out - y).square().sum() / (y.numel() * grid.sizes[0])).backward()  # its part of the mean
    for grad in (up.grad, down.grad):
        dist.all_reduce(grad, group=groups["dp"])  # the batch's slices summed
    return up.grad, down.grad


# --- experts ------------------------------------------------------------------------------------


def moe_dispatch(rank, world_size, tokens, destinations):
    order = torch.argsort(destinations, stable=True)  # grouped by destination, in token order
    send_counts = torch.bincount(destinations, minlength=world_size)
    received_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(received_counts, send_counts)  # first, the counts
    received = tokens.new_empty(int(received_counts.sum()), tokens.shape[1])
    dist.all_to_all_single(received, tokens[order], received_counts.tolist(),
                           send_counts.tolist())
    return received


# --- ring attention -----------------------------------------------------------------------------


def online_softmax_merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)  # log(exp(a) + exp(b)), the larger one subtracted first
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)  # a's share of the softmax's denominator
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return weight_a * out_a + weight_b * out_b, lse


def _block_attention(q, k, v, diagonal):
    """(out, lse) of q against one K/V block; on the diagonal block, the future masked."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if diagonal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def ring_attention_forward(rank, world_size, q, k, v):
    kv = torch.stack((k, v))  # K and V travel together: one message per step
    out = lse = None
    for step in range(world_size):
        last = step == world_size - 1
        if not last:  # start passing the block on before computing on it
            kv_next = torch.empty_like(kv)
            transfers = [dist.isend(kv, dst=(rank + 1) % world_size),
                         dist.irecv(kv_next, src=(rank - 1) % world_size)]
        source = (rank - step) % world_size  # the rank whose K/V we hold
        if source <= rank:  # a later block is all future: skipped
            partial = _block_attention(q, kv[0], kv[1], diagonal=source == rank)
            out, lse = partial if out is None else online_softmax_merge(out, lse, *partial)
        if not last:
            for transfer in transfers:
                transfer.wait()
            kv = kv_next
    return out
