"""The course's tiny language model cut for several kinds of parallelism at once (lesson 10).

Nothing here communicates by itself: the pieces are lesson 08's `parallelize_block` (tensor
parallelism inside each block, on a tp group) and the cut of the model into pipeline stages; the
workers (helpers.composing.workers) add lesson 06's DDP or gradient averaging on the dp group and
lesson 09's `pipeline_step` on the pp group.

On a dp x pp x tp grid, rank (d, p, t) holds:
    data        its dp slice of every batch (the same slice on every rank of its pp and tp groups)
    layers      stage p's share of the blocks; stage 0 also the embeddings, the last stage also
                the final LayerNorm and the head
    each block  tp shard t, cut as lesson 08's megatron.BLOCK_PLAN says (it is the one place
                that does): its heads of q, k, v (rows), the matching columns of attention's output
                projection, its rows of the MLP's up and columns of its down projection; the
                LayerNorms and the output biases whole
The embeddings, the final LayerNorm and the head are not split: every rank of a tp group keeps
them whole, and computes the same thing with them.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from helpers.tensor_parallelism.megatron import parallelize_block


class LMStage(nn.Module):
    """Stage `stage` of `num_stages` of a reference TinyLM (a copy): its share of consecutive
    blocks, tensor-parallel over `tp_group` when one is given. Stage 0 takes tokens and embeds
    them; the last stage returns logits; the others take and return hidden states. Parameter names
    are the dense model's (blocks keep their index), so a stage's parameters can be compared with
    the reference's by name."""

    def __init__(self, model: nn.Module, stage: int = 0, num_stages: int = 1, tp_group=None):
        super().__init__()
        count = len(model.blocks)
        if count % num_stages:
            raise ValueError(f"{count} blocks do not split into {num_stages} equal stages")
        size = count // num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        if self.first:
            self.token_embedding = copy.deepcopy(model.token_embedding)
            self.position_embedding = copy.deepcopy(model.position_embedding)
        self.blocks = nn.ModuleDict({
            str(index): (parallelize_block(model.blocks[index], tp_group) if tp_group is not None
                         else copy.deepcopy(model.blocks[index]))
            for index in range(stage * size, (stage + 1) * size)})
        if self.last:
            self.norm, self.head = copy.deepcopy(model.norm), copy.deepcopy(model.head)

    def forward(self, x):
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.last else x


def locate(local: torch.Tensor, full: torch.Tensor, **tolerance):
    """Where `local` sits in `full`, found by comparing values: None if it is all of it, else
    (dim, index, pieces): it is `full.chunk(pieces, dim)[index]`. Raises if it is no such piece
    (torch.testing.assert_close with `tolerance`), so this both draws the placement and checks
    it."""
    if local.shape == full.shape:
        torch.testing.assert_close(local, full, **tolerance)
        return None
    differing = [dim for dim in range(full.dim()) if local.shape[dim] != full.shape[dim]]
    if len(differing) != 1 or full.shape[differing[0]] % local.shape[differing[0]]:
        raise AssertionError(f"a piece of shape {tuple(local.shape)} is no even slice of "
                             f"{tuple(full.shape)}")
    dim = differing[0]
    pieces = full.shape[dim] // local.shape[dim]
    gaps = [float((local - chunk).abs().max()) for chunk in full.chunk(pieces, dim)]
    index = min(range(pieces), key=gaps.__getitem__)
    torch.testing.assert_close(local, full.chunk(pieces, dim)[index], **tolerance)
    return dim, index, pieces
