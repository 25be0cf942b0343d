"""Lesson 07's fast ZeRO-1/2 (helpers.zero_and_fsdp.bucketed_optimizer): it trains like
single-process AdamW and like the readable ShardedOptimizer; its buckets are reduce-scattered
during backward and all-gathered once each after the update; the bytes it holds and sends equal
their formulas; it is a drop-in optimizer for the CS336 interface."""

import copy
import math

import pytest
import torch
from compare import labelled
from torch import nn

from helpers import WorkerError, reference, run, strategies
from helpers.instrument import Observer
from helpers.zero_and_fsdp import workers
from helpers.zero_and_fsdp.bucketed_optimizer import BucketedShardedOptimizer
from helpers.zero_and_fsdp.sharded_optimizer import ShardedOptimizer

# The trained parameters are results that are numbers: `make test` runs those tests again on
# other CPU kernels (Makefile). Bytes, counts and errors are the same on any CPU.

TINY_BUCKETS = 0.01  # MiB: 2,621 float64 elements or more per bucket, about 9 buckets of the LM
ONE_BUCKET = 25.0  # MiB: the whole TinyLM in one bucket


def float64_lm_and_batches():
    """Whole AdamW runs are compared in float64, where AdamW cannot amplify rounding into a
    visible difference (helpers.tolerance), with assert_close's float64 default."""
    return reference.in_float64(reference.make_lm(tie_weights=True, seed=0),
                                reference.lm_data(seed=1, batch_size=8, steps=5))


def both_versions_worker(rank, world_size, stage, model, batches, bucket_mb):
    """The readable and the bucketed optimizer of `stage`, each training its own copy."""
    return {name: workers.training_worker(rank, world_size, stage, model, batches,
                                          bucket_mb=buckets)
            for name, buckets in (("readable", None), ("bucketed", bucket_mb))}


# float64: runs once (Makefile)
@pytest.mark.parametrize("stage, world_size, bucket_mb", [
    (1, 2, TINY_BUCKETS), (2, 4, TINY_BUCKETS), (1, 4, ONE_BUCKET), (2, 2, ONE_BUCKET)])
def test_bucketed_zero_trains_like_one_process_and_like_the_readable_version(
        stage, world_size, bucket_mb):
    """A TinyLM with a tied embedding, LayerNorms and biases; 5 AdamW steps."""
    model, batches = float64_lm_and_batches()
    single = reference.train(model, batches, reference.lm_loss, optimizer="adamw", lr=1e-2)
    out = run(both_versions_worker, world_size, show_output=False, kwargs=dict(
        stage=stage, model=model, batches=batches, bucket_mb=bucket_mb))
    for result in out:
        assert list(result["bucketed"]) == list(single.parameters)  # the names, the tie once
        for name, param in single.parameters.items():
            torch.testing.assert_close(result["bucketed"][name], param, msg=labelled(name))
            torch.testing.assert_close(result["bucketed"][name], result["readable"][name],
                                       msg=labelled(name))


# float64: runs once (Makefile)
@pytest.mark.parametrize("gradient_sharding", [False, True])
def test_bucketed_zero_keeps_param_groups_and_leaves_frozen_weights(gradient_sharding):
    """Two groups with their own lr and weight decay (each group its own buckets), one frozen
    weight, 3 ranks; buckets small enough that a group has several."""
    out = run(workers.param_groups_worker, 3, args=(gradient_sharding,),
              kwargs={"bucket_mb": 2e-4}, show_output=False)
    for result in out:
        assert result["frozen unchanged"]
        for name, param in result["alone"].items():
            torch.testing.assert_close(result["sharded"][name], param, msg=labelled(name))


@pytest.mark.numerical
@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_accumulation_equals_one_process_on_the_whole_batch(stage):
    """Stage 1's buffers sum the micro-batches' gradients, and each reduce-scatter replaces the
    piece's gradient; stage 2 adds each reduce-scatter to it. Either way: the whole batch, and
    one reduce-scatter per bucket per micro-batch."""
    model, batches = float64_lm_and_batches()
    single = reference.train(model, batches, reference.lm_loss, optimizer="adamw", lr=1e-2)
    out = run(strategies.accumulation_worker, 2, show_output=False, kwargs=dict(
        strategy=workers.STAGES[stage], model=model, batches=batches, micro_batches=2,
        loss="lm", bucket_mb=TINY_BUCKETS))
    for result in out:
        for name, param in single.parameters.items():
            torch.testing.assert_close(result["parameters"][name], param, msg=labelled(name))
        buckets = result["calls"]["all_gather_single"]
        assert buckets > 2
        assert result["calls"]["reduce_scatter_single"] == 2 * buckets


MLP_DIM, MLP_LAYERS = 64, 4
LAYER_NUMEL = MLP_DIM * MLP_DIM + MLP_DIM  # a Linear's weight and bias
# Buckets closed at one layer's bytes: the reversed parameters (bias, weight of the last layer,
# then the layer before, ...) make one bucket per layer.
ONE_LAYER_MB = 4 * LAYER_NUMEL / 2**20


def state_worker(rank, world_size, gradient_sharding, bucket_mb):
    """Two steps of the MLP (trained in float32); in the second, the bytes held after backward
    and the count and bytes of the collectives in backward and in step."""
    model = reference.make_mlp(dim=MLP_DIM, num_layers=MLP_LAYERS, seed=0, bias=True)
    batch = reference.mlp_data(seed=1, batch_size=12, dim=MLP_DIM)[0].shard(rank, world_size)
    optimizer = BucketedShardedOptimizer(model.parameters(), torch.optim.AdamW,
                                         gradient_sharding=gradient_sharding,
                                         bucket_mb=bucket_mb, lr=1e-2)
    reference.mse_loss(model(batch.inputs), batch.targets).backward()
    optimizer.step()  # AdamW allocates its state in its first step
    optimizer.zero_grad()
    with Observer() as observed:
        with observed.span("backward"):
            reference.mse_loss(model(batch.inputs), batch.targets).backward()  # waits at its end
        held = strategies.held_bytes(model, optimizer)
        with observed.span("step"):
            optimizer.step()
    state = sum(value.numel() * value.element_size() for piece_state in
                optimizer.inner.state.values() for key, value in piece_state.items()
                if key != "step")  # AdamW's step counts aside
    launches = {span: [record.name for record in observed.records if record.span == span]
                for span in ("backward", "step")}
    return {"held": held, "state": state, "calls": launches, "sent": observed.sent(),
            "buckets": len(optimizer.buckets)}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("bucket_mb, buckets", [(ONE_LAYER_MB, MLP_LAYERS), (25.0, 1)])
@pytest.mark.parametrize("gradient_sharding", [False, True])
def test_held_and_sent_bytes_equal_the_formula(world_size, bucket_mb, buckets,
                                               gradient_sharding):
    """A bucket of N elements is padded to n * ceil(N / n). Weights: the padded buffers.
    Optimizer state: AdamW's two float32 moments of this rank's piece of each bucket. Gradients:
    stage 1 the padded buffers plus the averaged pieces, stage 2 the pieces only. Sent: each
    bucket once reduce-scattered, during backward, and once all-gathered, in step."""
    per_bucket = MLP_LAYERS // buckets * LAYER_NUMEL
    piece = math.ceil(per_bucket / world_size)
    padded, pieces = buckets * world_size * piece, buckets * piece
    out = run(state_worker, world_size, args=(gradient_sharding, bucket_mb), show_output=False)
    for result in out:
        assert result["buckets"] == buckets
        assert result["held"]["weights"] == 4 * padded
        assert result["held"]["optimizer"] == 4 * (2 * pieces + buckets)  # with step counts
        assert result["state"] == 2 * 4 * pieces
        assert result["held"]["gradients"] == 4 * (pieces if gradient_sharding
                                                   else padded + pieces)
        assert result["calls"] == {"backward": ["reduce_scatter_single"] * buckets,
                                   "step": ["all_gather_single"] * buckets}
        ring = (world_size - 1) / world_size * 4 * padded  # one ring pass over the buffers
        assert result["sent"] == pytest.approx({"reduce_scatter_single": ring,
                                                "all_gather_single": ring})


def overlap_worker(rank, world_size):
    """One backward of the TinyLM in small buckets, observed."""
    model = reference.make_lm(seed=0)
    batch = reference.lm_data(seed=1, batch_size=4)[0].shard(rank, world_size)
    optimizer = BucketedShardedOptimizer(model.parameters(), torch.optim.AdamW,
                                         bucket_mb=0.02, lr=1e-2)
    with Observer() as observed:
        with observed.span("backward"):
            reference.lm_loss(model(batch.inputs), batch.targets).backward()
        optimizer.step()
    spans = {span.label: span for span in observed.spans}
    backward, wait = spans["backward"], spans["wait"]
    launches = [record.launched for record in observed.records
                if record.name == "reduce_scatter_single"]
    return {"buckets": len(optimizer.buckets), "before the end": sum(
        backward.start < launched < backward.end for launched in launches),
        "waited inside backward": backward.start < wait.start <= wait.end <= backward.end}


def test_the_reduce_scatters_start_and_end_while_backward_runs():
    """Every bucket's reduce-scatter is launched from a gradient hook inside backward (the last
    one's too: autograd runs the hook before backward returns), and waited for by the callback
    the first hook queued on autograd's engine, before backward returns."""
    for result in run(overlap_worker, 2, show_output=False):
        assert result["buckets"] > 2
        assert result["before the end"] == result["buckets"]
        assert result["waited inside backward"]


class ToyModel(nn.Module):
    """A model in the manner of CS336's sharded-optimizer test: two Linears whose weights are
    tied, a LayerNorm, and a parameter that is never trained."""

    def __init__(self):
        super().__init__()
        self.first, self.norm, self.last = nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 6)
        self.last.weight = self.first.weight
        self.fixed = nn.Parameter(torch.tensor([2.0, 2.0]), requires_grad=False)

    def forward(self, inputs):
        return self.last(torch.relu(self.norm(self.first(inputs)))) * self.fixed[0]


def drop_in_worker(rank, world_size, optimizer_name):
    """Every rank the same model and the same data; the optimizer built as CS336's interface
    builds it, (params, optimizer_cls, **kwargs), and used like torch.optim.AdamW."""
    optimizers = {"readable": ShardedOptimizer, "bucketed": BucketedShardedOptimizer}
    torch.manual_seed(0)
    alone = ToyModel().double()
    sharded = copy.deepcopy(alone)
    settings = dict(lr=0.1, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    optimizer = optimizers[optimizer_name](sharded.parameters(), torch.optim.AdamW, **settings)
    reference_optimizer = torch.optim.AdamW(alone.parameters(), **settings)
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        inputs = torch.rand(16, 6, generator=generator, dtype=torch.float64)
        targets = torch.rand(16, 6, generator=generator, dtype=torch.float64)
        for model, opt in ((alone, reference_optimizer), (sharded, optimizer)):
            opt.zero_grad()
            ((model(inputs) - targets) ** 2).sum().backward()
            opt.step()
    return reference.parameters(alone), reference.parameters(sharded)


@pytest.mark.numerical
@pytest.mark.parametrize("optimizer_name", ["readable", "bucketed"])
def test_both_optimizers_are_drop_in_for_the_cs336_interface(optimizer_name):
    for alone, sharded in run(drop_in_worker, 2, args=(optimizer_name,), show_output=False):
        assert list(sharded) == list(alone)
        for name, param in alone.items():
            torch.testing.assert_close(sharded[name], param, msg=labelled(name))


def unused_parameter_worker(rank, world_size):
    model = reference.make_mlp(dim=8, num_layers=3, seed=0)
    optimizer = BucketedShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1,
                                         bucket_mb=1e-4)
    inputs = torch.randn(4, 8)
    model.layers[1](inputs).sum().backward()  # layers 0 and 2 get no gradient
    optimizer.step()


def test_an_unused_parameter_is_an_error_on_every_rank_not_a_hang():
    with pytest.raises(WorkerError) as caught:
        run(unused_parameter_worker, 2, show_output=False, timeout=60)
    assert "no gradient arrived for 2 trainable parameters in this backward" in str(caught.value)
    assert "every trainable parameter must be used in every step" in str(caught.value)


def mismatched_state_worker(rank, world_size, directory):
    import os

    model = reference.make_mlp(dim=8, num_layers=3, seed=0)
    first = BucketedShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1,
                                     bucket_mb=1e-4)
    path = os.path.join(directory, f"rank{rank}.pt")
    torch.save(first.state_dict(), path)
    other = BucketedShardedOptimizer(copy.deepcopy(model).parameters(), torch.optim.AdamW,
                                     lr=0.1, bucket_mb=25.0)
    other.load_state_dict(torch.load(path, weights_only=True))


def test_a_state_saved_with_other_buckets_is_refused(tmp_path):
    with pytest.raises(WorkerError, match="another bucket size"):
        run(mismatched_state_worker, 2, args=(str(tmp_path),), show_output=False)


def closure_worker(rank, world_size, optimizer_name):
    """step(closure), as torch.optim.Optimizer takes it: the closure's loss comes back, and the
    step is the one of the gradients the closure made."""
    optimizers = {"readable": ShardedOptimizer, "bucketed": BucketedShardedOptimizer}
    torch.manual_seed(0)
    alone = ToyModel().double()
    sharded = copy.deepcopy(alone)
    optimizer = optimizers[optimizer_name](sharded.parameters(), torch.optim.SGD, lr=0.1)
    reference_optimizer = torch.optim.SGD(alone.parameters(), lr=0.1)
    inputs = torch.rand(8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    losses = []
    for model, opt in ((alone, reference_optimizer), (sharded, optimizer)):
        def closure(model=model, opt=opt):
            opt.zero_grad()
            loss = model(inputs).square().sum()
            loss.backward()
            return loss
        losses.append(opt.step(closure))
    return losses, reference.parameters(alone), reference.parameters(sharded)


@pytest.mark.numerical
@pytest.mark.parametrize("optimizer_name", ["readable", "bucketed"])
def test_step_takes_a_closure(optimizer_name):
    for losses, alone, sharded in run(closure_worker, 2, args=(optimizer_name,),
                                      show_output=False):
        torch.testing.assert_close(losses[1], losses[0])
        for name, param in alone.items():
            torch.testing.assert_close(sharded[name], param, msg=labelled(name))
