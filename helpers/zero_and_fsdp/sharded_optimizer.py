"""ZeRO stages 1 and 2 by hand: `ShardedOptimizer`, a torch.optim.Optimizer whose state lives in
shards (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020: P_os is stage 1, P_os+g stage 2). Lesson 07, notebooks/07_zero_and_fsdp.ipynb.

Every rank holds the whole model and computes the gradients of its own slice of the batch, as in
data parallelism. What changes is who updates what. Each trainable parameter is cut into n flat
pieces (sharding.shard_of); rank r owns piece r of every parameter, and keeps the optimizer state
(Adam's two moments) of its pieces only: 1/n of the state. (The ZeRO paper and DeepSpeed cut the
concatenation of a group's parameters into n ranges instead, and bucketed_optimizer cuts each
bucket, as Megatron-LM does; PyTorch's ZeroRedundancyOptimizer gives each rank whole
parameters.) Cutting a parameter anywhere is right
for element-wise optimizers (SGD, Adam, AdamW), whose update of an element depends on that
element alone; optimizers that look at a whole tensor (LAMB's trust ratio, Adafactor's factored
moments) need whole parameters.

Communication, each step:
  1. gradients   reduce_scatter each gradient with AVG: rank r receives the average of its piece.
                 Stage 1 does it in step(), from the full .grad that backward left. Stage 2
                 (gradient_sharding=True) does it during backward, as soon as each gradient is
                 complete (a post-accumulate-grad hook), and frees each full gradient as soon as
                 its piece is reduced, so full gradients do not pile up.
  2. update      the inner optimizer steps the pieces this rank owns.
  3. parameters  all_gather every updated piece into the full parameter, on every rank.
Each rank sends (n-1)/n of the gradients in 1 and (n-1)/n of the parameters in 3: 2(n-1)/n in
all, the same bytes as data parallelism's all-reduce.

Parameters with requires_grad=False are never sharded, sent or changed; a tied parameter is one
parameter; param groups keep their own hyperparameters (copied to the inner optimizer at every
step, so learning-rate schedules work). At construction rank 0's parameters are broadcast.
`max_grad_norm` clips the gradient by its global norm, computed from the pieces (an all-reduce
of their squared norms): after stage 2's backward no rank holds a full gradient to clip.
`state_dict()` is this rank's: its pieces' optimizer state; save one file per rank
(helpers.strategies.state_dict gives torch.distributed.checkpoint a form that loads on any number
of ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from helpers.data_parallelism.ddp import broadcast_from_first
from helpers.zero_and_fsdp.sharding import gather, scatter_mean, shard_of


class ShardedOptimizer(torch.optim.Optimizer):
    """`ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`: ZeRO stage 1, or
    stage 2 with `gradient_sharding=True` (see the module docstring). It averages the gradients
    itself: use it on a plain model, not on a DDP one."""

    def __init__(self, params, optimizer_cls, gradient_sharding: bool = False, group=None,
                 max_grad_norm: float | None = None, **defaults):
        super().__init__(params, defaults)
        self.group, self.gradient_sharding = group, gradient_sharding
        self.max_grad_norm = max_grad_norm
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        broadcast_from_first([param for param_group in self.param_groups  # replicas start equal
                              for param in param_group["params"]], group)
        self.pieces = {}  # parameter -> this rank's piece of it, which the inner optimizer updates
        inner_groups = []
        for param_group in self.param_groups:
            pieces = []
            for param in param_group["params"]:
                if param.requires_grad:
                    self.pieces[param] = self.piece_in_place(param, rank, world_size)
                    pieces.append(self.pieces[param])
            inner_groups.append({**self.hyperparameters(param_group), "params": pieces})
        self.inner = optimizer_cls(inner_groups)
        if gradient_sharding:
            for param in self.pieces:
                param.register_post_accumulate_grad_hook(self.shard_gradient)

    @staticmethod
    def piece_in_place(param: nn.Parameter, rank: int, world_size: int) -> nn.Parameter:
        """Move `param` into a zero-padded flat buffer of n equal pieces (param becomes a view of
        it) and return piece `rank` as a leaf that shares its memory: updating the piece updates
        the parameter, and the rank holds no second copy of its weights."""
        flat = torch.cat([shard_of(param, r, world_size) for r in range(world_size)])
        param.data = flat[:param.numel()].view(param.shape)
        size = flat.numel() // world_size
        return nn.Parameter(flat[rank * size:(rank + 1) * size])

    @staticmethod
    def hyperparameters(param_group: dict) -> dict:
        return {key: value for key, value in param_group.items() if key != "params"}

    def shard_gradient(self, param):
        """Stage 2, inside backward: keep this rank's piece of the averaged gradient only."""
        piece = self.pieces[param]
        averaged = scatter_mean(param.grad, self.group)
        piece.grad = averaged if piece.grad is None else piece.grad + averaged  # accumulation
        param.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for param, piece in self.pieces.items():  # 1. gradients (stage 1)
            if not self.gradient_sharding and param.grad is not None:
                piece.grad = scatter_mean(param.grad, self.group)
        self.update_pieces()  # 2. update this rank's pieces
        for param, piece in self.pieces.items():  # 3. parameters
            param.copy_(gather(piece, param.shape, self.group))  # (its own piece is unchanged)
        return loss

    def update_pieces(self) -> None:
        """Clip the pieces' gradients (given max_grad_norm), hand each param group's current
        hyperparameters to the inner optimizer (so that learning-rate schedules work), and let
        it step this rank's pieces."""
        if self.max_grad_norm is not None:
            self.clip_pieces(self.max_grad_norm)
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update(self.hyperparameters(outer))
        self.inner.step()

    def clip_pieces(self, max_norm: float) -> None:
        """torch.nn.utils.clip_grad_norm_ over the whole model, from the pieces: the squares of
        every rank's pieces, summed over the ranks, are the squares of the whole gradient."""
        grads = [piece.grad for piece in self.pieces.values() if piece.grad is not None]
        squares = sum((grad ** 2).sum() for grad in grads) + torch.zeros(())
        dist.all_reduce(squares, group=self.group)
        scale = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(scale)

    def state_dict(self) -> dict:
        """This rank's optimizer state (its pieces'), and the layout it belongs to."""
        return {"inner": self.inner.state_dict(), "rank": dist.get_rank(self.group),
                "world_size": dist.get_world_size(self.group),
                "piece_sizes": [piece.numel() for piece in self.pieces.values()]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by the same rank of a group of the same size, for the same
        pieces."""
        layout = (dist.get_rank(self.group), dist.get_world_size(self.group))
        if (state_dict["rank"], state_dict["world_size"]) != layout:
            raise ValueError(f"this state belongs to rank {state_dict['rank']} of "
                             f"{state_dict['world_size']}, not to rank {layout[0]} of "
                             f"{layout[1]}")
        if state_dict["piece_sizes"] != [piece.numel() for piece in self.pieces.values()]:
            raise ValueError("this state's pieces have other sizes than this optimizer's: it "
                             "was saved for another model, or another bucket size")
        self.inner.load_state_dict(state_dict["inner"])

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)
