"""Lesson 11, mixed precision (helpers.fitting_a_model.precision): what autocast keeps, to the
byte; a float16 overflow that GradScaler skips and answers by halving its scale; gradients
reduced in bfloat16 send half the bytes and stay within bfloat16's bound; lesson 07's
FSDP(compute_dtype) and FSDP2's MixedPrecisionPolicy compute the same thing."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from compare import labelled

from helpers import reference, run
from helpers.fitting_a_model import plots, precision
from helpers.tolerance import EPSILON


def test_autocast_keeps_float32_weights_and_gradients_and_a_16_bit_copy_of_each_linear_weight():
    model = reference.make_lm(seed=0)
    batch = reference.lm_data(seed=1, batch_size=4)[0]
    parameters = sum(param.numel() for param in model.parameters())
    linear_weights = sum(module.weight.numel() for module in model.modules()
                         if isinstance(module, torch.nn.Linear))
    plain = precision.bytes_by_kind(model, batch)
    assert "weight copies" not in plain and "activations, bfloat16" not in plain
    for dtype in (torch.bfloat16, torch.float16):
        kept = precision.bytes_by_kind(model, batch, dtype)
        assert kept["weights"] == kept["gradients"] == plain["weights"] == 4 * parameters
        assert kept["weight copies"] == 2 * linear_weights  # a Linear's bias is not kept
        low = kept[f"activations, {str(dtype).removeprefix('torch.')}"]
        # the 16-bit activations are some of what float32 kept, at half the bytes each
        assert low + kept["activations, float32"] < plain["activations, float32"]
        assert kept["activations, int64"] == plain["activations, int64"]  # the token ids


def test_a_float16_overflow_is_skipped_and_the_scale_halves_until_the_gradients_are_finite():
    model = reference.make_lm(seed=0)
    batches = reference.lm_data(seed=1, batch_size=8, steps=8)
    steps = precision.scaler_steps(model, batches, init_scale=2.0 ** 24)
    assert not steps[0]["finite"]  # 2**24 times any gradient of size 2**-8 is past 65504
    for before, after in zip(steps, steps[1:]):
        if not before["finite"]:  # skipped: neither the optimizer's count nor a weight moved
            assert not before["stepped"] and not before["weights changed"]
            assert after["scale"] == before["scale"] / 2  # GradScaler's backoff_factor
        else:
            assert before["stepped"] and before["weights changed"]
            assert after["scale"] == before["scale"]  # no growth before 2000 good steps
    assert steps[-1]["finite"] and steps[-1]["stepped"]


def test_float16_without_scaling_would_lose_small_gradients():
    """Why a scale at all: float16's smallest subnormal is 2**-24; below half of it a value
    becomes 0, where bfloat16 (float32's exponent) keeps it."""
    tiny = torch.tensor([2.0 ** -26])
    assert tiny.half().item() == 0 and tiny.bfloat16().item() == 2.0 ** -26
    assert (tiny * 2.0 ** 10).half().float().item() / 2.0 ** 10 == 2.0 ** -26


@pytest.mark.numerical
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_bfloat16_reduction_sends_half_the_bytes_within_bfloat16s_bound(world_size):
    model = reference.make_lm(seed=0)
    batch = reference.lm_data(seed=1, batch_size=8)[0]
    out = run(precision.reduction_worker, world_size, args=(model, batch), show_output=False)
    parameters = sum(param.numel() for param in model.parameters())
    ring = 2 * (world_size - 1) / world_size * parameters  # elements a rank sends (lesson 05)
    local = [result["local"] for result in out]
    # each rank's own gradients are one process's on its slice
    for rank, grads in enumerate(local):
        expected = reference.gradients(model, batch.shard(rank, world_size), reference.lm_loss)
        for name, grad in expected.items():
            torch.testing.assert_close(grads[name], grad, msg=labelled(name))
    for result in out:
        assert result["sent"] == {"float32": 4 * ring, "bfloat16": 2 * ring}
        # n terms: each cast rounds by at most half an ε of its size, and each of n - 1
        # additions by half an ε of the partial sum's: within n ε of Σ|terms|
        float32 = precision.relative_errors(result["float32"], local)
        bfloat16 = precision.relative_errors(result["bfloat16"], local)
        assert float32.max() <= world_size * EPSILON
        assert bfloat16.max() <= world_size * torch.finfo(torch.bfloat16).eps
        assert bfloat16.max() > world_size * EPSILON  # and bfloat16 does round: a real test


def test_relative_errors_measure_against_the_terms_size():
    local = [{"w": torch.tensor([1.0, 0.0, -2.0])}, {"w": torch.tensor([1.0, 0.0, 2.0])}]
    averaged = {"w": torch.tensor([1.5, 0.0, 0.5])}  # errors 0.5, (left out), 0.5
    assert precision.relative_errors(averaged, local).tolist() == [0.5, 0.25]


@pytest.mark.numerical
def test_hand_built_compute_dtype_and_fsdp2s_mixed_precision_policy_compute_the_same():
    model = reference.make_mlp(dim=16, num_layers=4, seed=0)
    batches = reference.mlp_data(seed=1, batch_size=8, dim=16, steps=3)
    results = {kind: run(precision.policy_worker, 2, show_output=False, kwargs=dict(
        kind=kind, model=model, batches=batches)) for kind in precision.POLICIES}
    hand, torch_ = results.values()
    for rank in range(2):
        # the same casts, products and float32 reductions in the same order: identical
        for name, param in hand[rank]["parameters"].items():
            torch.testing.assert_close(torch_[rank]["parameters"][name], param, rtol=0, atol=0,
                                       msg=labelled(name))
        # per step: two all-gathers of 2-byte weights per layer, one reduce-scatter of 4-byte
        # gradients, each (n - 1)/n of the layer
        weights = sum(param.numel() for param in model.parameters())
        assert hand[rank]["sent"] == torch_[rank]["sent"] == {
            "all_gather_single": 2 * 2 * weights / 2, "reduce_scatter_single": 4 * weights / 2}
        assert hand[rank]["calls"] == torch_[rank]["calls"]
    # and bfloat16 compute matters: float32 training ends elsewhere
    float32 = reference.train(model, batches, reference.mse_loss, lr=1e-2)
    assert max((float32.parameters[name] - param).abs().max().item()
               for name, param in hand[0]["parameters"].items()) > 1e-4


def test_the_pictures_draw():
    fig = plots.plot_losses({"float32": [3.0, 2.0], "bfloat16": [3.0, 2.1]})
    assert len(fig.axes[0].lines) == 2
    errors = {"float32": torch.tensor([1e-8, 2e-8]), "bfloat16": torch.tensor([1e-3, 0.0])}
    fig = plots.plot_relative_errors(errors, {"float32": 1e-7, "bfloat16": 1e-2})
    assert len(fig.axes[0].lines) == 2  # the two bounds
