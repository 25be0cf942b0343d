"""ZeRO stages 1 and 2 as they are shipped: `BucketedShardedOptimizer`, lesson 07's
`ShardedOptimizer` with flat buckets whose gradients are reduce-scattered while backward runs
(notebooks/07_zero_and_fsdp.ipynb).

The readable `ShardedOptimizer` sends two collectives per parameter, one after the other, and
stage 1 only after backward has ended; each pays gloo's latency (lesson 04). This one does what
Megatron-LM's distributed optimizer does with overlap_grad_reduce
(megatron/core/distributed/param_and_grad_buffer.py), with the buckets of lesson 06's DDP
(DeepSpeed's ZeRO-1/2, deepspeed/runtime/zero/stage_1_and_2.py, likewise reduces gradient
buckets during backward, but shards each param group's whole flat buffer):

  construction  the trainable parameters of each param group, in reverse order (a guess at the
                order backward produces their gradients, as lesson 06's DDP guesses), are laid
                end to end in flat buffers, one per bucket of at least `bucket_mb` MiB, each
                zero-padded to a multiple of n; every parameter becomes a view of its bucket.
                Rank r owns piece r of every bucket, a contiguous 1/n of it, and the inner
                optimizer updates those pieces only: its state is 1/n of the whole
  backward      a gradient hook copies each gradient into its bucket's flat gradient buffer;
                when a bucket's last gradient arrives, an asynchronous reduce_scatter (AVG)
                sends the bucket while backward goes on with the rest
  end of backward  finish_gradient_synchronization(), queued on autograd's engine by the first
                gradient of the backward (as lesson 06's DDP queues its wait), waits for the
                reduce-scatters and gives each piece its averaged gradient
  step()        the inner optimizer updates the
                pieces; one all_gather per bucket brings every rank's updated pieces back into
                the flat buffers, and so into the parameters, which are views of them
  stages        stage 1 keeps the full gradient buffers (each .grad is a view of one, as torch
                DDP's gradient_as_bucket_view makes it); stage 2 (gradient_sharding=True) hands
                each buffer to its reduce-scatter and frees it once that has been waited for,
                with no more than IN_FLIGHT waiting at once (a bucket's launch waits for the
                oldest beyond that): at most IN_FLIGHT + 1 full buffers, with the one filling.

With several backward passes before a step (gradient accumulation), stage 1's buffers hold the
sum and each reduce-scatter replaces the piece's gradient; stage 2 adds each reduce-scatter to
it. Both send one reduce-scatter per bucket per backward. Every trainable parameter must get a
gradient in every backward (the ranks' reduce-scatters must match), as in lesson 06's DDP.
Bucket pieces cut parameters anywhere, which is right for element-wise optimizers only (see
sharded_optimizer). Parameters with requires_grad=False are broadcast from rank 0 once and
never sharded, sent or changed; a param group's buckets hold only its own parameters, so its
hyperparameters apply to its pieces.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from helpers.data_parallelism.ddp import at_end_of_backward, broadcast_from_first, bucket_indices
from helpers.instrument import span
from helpers.zero_and_fsdp.sharded_optimizer import ShardedOptimizer


class InFlight(NamedTuple):
    """A bucket's reduce-scatter while it runs: the Work, the bucket, the tensor that receives
    this rank's averaged piece, and the full gradient buffer it reads (held here, so that stage
    2, which lets the bucket drop it, frees it only once the reduce-scatter has been waited for)."""
    work: dist.Work
    bucket: ShardedBucket
    received: torch.Tensor
    gradients: torch.Tensor


class ShardedBucket:
    """Parameters laid end to end in one flat buffer, zero-padded to n equal pieces. `weights` is
    the buffer (every parameter a view of it), `piece` this rank's piece of it (a leaf sharing
    its memory, what the inner optimizer updates), `gradients` the flat gradient buffer while it
    is held."""

    def __init__(self, params: list, rank: int, world_size: int):
        self.params = params
        numel = sum(param.numel() for param in params)
        self.piece_numel = math.ceil(numel / world_size)
        self.weights = params[0].new_zeros(self.piece_numel * world_size)
        self.offsets, offset = {}, 0
        for param in params:
            self.offsets[param] = offset
            self.view_in(self.weights, param).copy_(param.detach())
            param.data = self.view_in(self.weights, param)
            offset += param.numel()
        self.piece = nn.Parameter(self.weights[rank * self.piece_numel:
                                               (rank + 1) * self.piece_numel])
        self.gradients = None
        self.arrived = set()  # the parameters whose gradient arrived in this backward

    def view_in(self, flat: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        """`param`'s place in a flat buffer of this bucket's layout, in `param`'s shape."""
        offset = self.offsets[param]
        return flat[offset:offset + param.numel()].view(param.shape)


class BucketedShardedOptimizer(ShardedOptimizer):
    """`BucketedShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`: ZeRO stage 1,
    or stage 2 with `gradient_sharding=True`, in flat buckets of at least `bucket_mb` MiB,
    reduce-scattered during backward (see the module docstring). Param groups, clipping and
    state_dict work as in ShardedOptimizer."""

    IN_FLIGHT = 2  # stage 2: the most full gradient buffers whose reduce-scatter may be running

    def __init__(self, params, optimizer_cls, gradient_sharding: bool = False,
                 bucket_mb: float = 25.0, group=None, max_grad_norm: float | None = None,
                 **defaults):
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.group, self.gradient_sharding = group, gradient_sharding
        self.max_grad_norm = max_grad_norm
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.buckets, inner_groups = [], []
        for param_group in self.param_groups:
            buckets = self.make_buckets(param_group["params"], bucket_mb, rank, world_size)
            # every replica starts from rank 0's weights: the frozen ones, and the buckets
            broadcast_from_first([param for param in param_group["params"]
                                  if not param.requires_grad]
                                 + [bucket.weights for bucket in buckets], group)
            inner_groups.append({**self.hyperparameters(param_group),
                                 "params": [bucket.piece for bucket in buckets]})
            self.buckets += buckets
        self.pieces = {bucket: bucket.piece for bucket in self.buckets}
        self.inner = optimizer_cls(inner_groups)
        self.bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}
        self.pending = []  # an InFlight for every reduce-scatter not yet waited for
        self.finish_queued = False  # whether this backward has queued its finish
        for param in self.bucket_of:
            param.register_post_accumulate_grad_hook(self.gradient_ready)

    @staticmethod
    def make_buckets(params: list, bucket_mb: float, rank: int, world_size: int) -> list:
        """The trainable `params`, in reverse order, cut into buckets of at least `bucket_mb`
        MiB (the last may hold less), one dtype per bucket."""
        trainable = [param for param in reversed(params) if param.requires_grad]
        buckets = []
        for dtype in dict.fromkeys(param.dtype for param in trainable):
            same = [param for param in trainable if param.dtype == dtype]
            sizes = [param.numel() * param.element_size() for param in same]
            for indices in bucket_indices(sizes, bucket_mb * 2**20):
                buckets.append(ShardedBucket([same[i] for i in indices], rank, world_size))
        return buckets

    def gradient_ready(self, param):
        """Inside backward, once `param`'s gradient is complete: into the bucket's gradient
        buffer; the bucket's last gradient starts its reduce-scatter."""
        if not self.finish_queued:  # the first gradient of this backward
            self.finish_queued = True
            at_end_of_backward(self.finish_gradient_synchronization)
        bucket = self.bucket_of[param]
        if bucket.gradients is None:
            bucket.gradients = torch.zeros_like(bucket.weights)  # the padding stays 0
        place = bucket.view_in(bucket.gradients, param)
        if param.grad.data_ptr() != place.data_ptr():  # (stage 1 accumulates in place)
            place.copy_(param.grad)
        param.grad = None if self.gradient_sharding else place
        bucket.arrived.add(param)
        if len(bucket.arrived) == len(bucket.params):
            received = torch.empty_like(bucket.piece)
            work = dist.reduce_scatter_single(received, bucket.gradients,
                                              op=dist.ReduceOp.AVG, group=self.group,
                                              async_op=True)
            self.pending.append(InFlight(work, bucket, received, bucket.gradients))
            if self.gradient_sharding:  # stage 2: the buffer is now the reduce-scatter's alone,
                bucket.gradients = None  # and no more than IN_FLIGHT of them wait at once
                self.collect(keep=self.IN_FLIGHT)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce-scatter that backward started, and give each piece its
        averaged gradient. Runs at the end of backward."""
        self.finish_queued = False
        missing = [param for bucket in self.buckets for param in bucket.params
                   if param not in bucket.arrived]
        if missing and any(bucket.arrived for bucket in self.buckets):
            shapes = ", ".join(str(tuple(param.shape)) for param in missing[:4])
            raise RuntimeError(  # the ranks' reduce-scatters would stop matching
                f"no gradient arrived for {len(missing)} trainable parameters in this backward "
                f"(shapes {shapes}{', ...' if len(missing) > 4 else ''}): every rank must "
                "reduce every bucket, so every trainable parameter must be used in every step")
        with span("wait"):  # (a label for helpers.instrument's timelines)
            self.collect(keep=0)
        for bucket in self.buckets:
            bucket.arrived.clear()

    def collect(self, keep: int) -> None:
        """Wait for the reduce-scatters in flight, oldest first, until only the `keep` newest
        are: each piece gets its averaged gradient, and stage 2's full gradient buffer, no
        longer referenced, is freed."""
        while len(self.pending) > keep:
            flight = self.pending.pop(0)  # (stage 2: its buffer goes when `flight` does)
            flight.work.wait()
            piece, received = flight.bucket.piece, flight.received
            if self.gradient_sharding and piece.grad is not None:
                received += piece.grad  # stage 2 accumulates this backward's part
            piece.grad = received  # stage 1's buffer held the sum: replace

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        self.finish_queued = False  # (a backward that raised never ran its finish)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # 1. gradients: reduce-scattered in backward, received at its end
        self.update_pieces()  # 2. update this rank's piece of every bucket
        works = [dist.all_gather_single(bucket.weights, bucket.piece.detach(), group=self.group,
                                        async_op=True) for bucket in self.buckets]
        for work in works:  # 3. parameters: every rank's pieces, into the flat buffers
            work.wait()
        return loss
