"""helpers.tolerance: the bound and the verdict the notebooks print, against their formulas."""

import pytest
import torch

from helpers import reference, tolerance

# Results that are numbers: `make test` runs these again on other CPU kernels (Makefile).
pytestmark = pytest.mark.numerical


def test_the_bound_is_epsilon_times_terms_times_scale_times_steps():
    assert tolerance.EPSILON == 2.0**-23
    assert tolerance.float32_bound(256) == 256 * 2.0**-23
    assert tolerance.float32_bound(24, scale=2.0, steps=8) == 24 * 2.0 * 8 * 2.0**-23


def test_the_bound_holds_for_sums_taken_in_other_orders():
    """Sum 256 unit-sized float32 terms forwards, backwards and in pairs: every order lies within
    the bound of every other, and of the float64 sum."""
    terms = reference.seeded_randn(0, 1000, 256).abs() / 256  # sizes add up to about 1 per row
    orders = [terms.sum(dim=1), terms.flip(1).sum(dim=1),
              terms.view(1000, 128, 2).sum(dim=2).sum(dim=1),
              torch.zeros(1000).add_(terms.T.cumsum(0)[-1])]
    exact = terms.double().sum(dim=1)
    scale = terms.sum(dim=1).max().item()
    for order in orders:
        assert (order.double() - exact).abs().max().item() <= tolerance.float32_bound(256, scale)


def test_the_verdict_shows_the_bound_and_never_the_difference():
    assert tolerance.within(1.234567e-9, tolerance.float32_bound(256)) == (
        "within 3.1 × 10⁻⁵: True")
    assert tolerance.within(0.5, 1e-3) == "within 10⁻³: False"
    assert tolerance.within(1e-3, 1e-3) == "within 10⁻³: True"
    assert tolerance.within(0.0, 1e-7) == "within 10⁻⁷: True"
    assert tolerance.power_of_ten(2.5e12) == "2.5 × 10¹²"


def test_in_float64_widens_weights_and_floats_and_keeps_token_ids():
    model, batches = reference.make_lm(), reference.lm_data(steps=2)
    wide, wide_batches = reference.in_float64(model, batches)
    for param, wide_param in zip(model.parameters(), wide.parameters()):
        assert wide_param.dtype == torch.float64
        torch.testing.assert_close(wide_param, param.double(), rtol=0, atol=0)
    assert all(torch.equal(a.inputs, b.inputs) and a.inputs.dtype == torch.int64
               for a, b in zip(wide_batches, batches))
    assert next(model.parameters()).dtype == torch.float32  # the original is left as it was
    _, (mlp_batch,) = reference.in_float64(reference.make_mlp(), reference.mlp_data())
    assert mlp_batch.inputs.dtype == mlp_batch.targets.dtype == torch.float64


def test_agree_measures_each_tensor_against_its_own_size():
    gradient = reference.seeded_randn(1, 64, 24) * 1e-6  # small, like a first layer's gradient
    reordered = (gradient.double().T.flip(0).cumsum(0)[-1]).float()
    summed = gradient.sum(dim=1)
    assert (reordered - summed).abs().max() > 0  # another order does round differently
    assert tolerance.agree([(reordered, summed)], terms=24)
    # a gradient lost altogether is far below an absolute 1e-5, but not within its own size
    assert tolerance.float32_bound(24, steps=8) > summed.abs().max()
    assert not tolerance.agree([(torch.zeros_like(summed), summed)], terms=24, steps=8)
    assert not tolerance.agree([(summed, summed), (2 * summed, summed)], terms=24)


def test_the_relative_verdict_names_the_bound_in_epsilons():
    assert tolerance.relative_verdict(True, 256) == (
        "within 256 ε of each tensor's largest magnitude: True")
    assert tolerance.relative_verdict(False, 24, steps=8) == (
        "within 192 ε of each tensor's largest magnitude: False")
