"""helpers.cost_model: nccl-tests' bus factors and bytes, algbw and busbw, the alpha-beta fit and
model, against their formulas."""

import pytest

from helpers import cost_model

# nccl-tests' doc/PERFORMANCE.md: all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all
# (n-1)/n; broadcast, reduce 1. Their values at n = 4 and n = 8:
FACTOR_AT = {4: {"all_reduce": 1.5, "reduce_scatter": 0.75, "all_gather": 0.75, "all_to_all": 0.75,
                 "broadcast": 1.0, "reduce": 1.0},
             8: {"all_reduce": 1.75, "reduce_scatter": 0.875, "all_gather": 0.875,
                 "all_to_all": 0.875, "broadcast": 1.0, "reduce": 1.0}}


@pytest.mark.parametrize("world_size", [4, 8])
@pytest.mark.parametrize("op", cost_model.OPERATIONS)
def test_algbw_and_busbw_follow_nccl_tests(op, world_size):
    record = cost_model.bandwidths(op, world_size, 3 * 2**20, 0.002)
    assert record["algbw"] == pytest.approx(3 * 2**20 / 0.002)
    assert record["busbw"] == pytest.approx(3 * 2**20 / 0.002 * FACTOR_AT[world_size][op])


def test_reduce_scatter_on_the_output_size_is_n_times_too_low():
    on_input = cost_model.bandwidths("reduce_scatter", 4, 2**24, 0.01)["busbw"]
    on_output = cost_model.bandwidths("reduce_scatter", 4, 2**24 // 4, 0.01)["busbw"]
    assert on_input / on_output == pytest.approx(4)


@pytest.mark.parametrize("relative", [True, False])
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_alpha_beta_fit_recovers_the_parameters_of_synthetic_data(op, relative):
    alpha, beta, n = 250e-6, 3.5e9, 4
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n}[op]
    records = [cost_model.bandwidths(op, n, size, alpha + size * factor / beta)
               for size in (2**k for k in range(10, 27, 2))]
    fitted_alpha, fitted_beta = cost_model.fit_alpha_beta(records, relative=relative)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted_beta == pytest.approx(beta, rel=1e-6)
    assert cost_model.model_seconds(fitted_alpha, fitted_beta, op, n, 2**20) == pytest.approx(
        alpha + 2**20 * factor / beta)


def test_the_fit_in_seconds_lets_one_slow_small_call_move_alpha_less():
    alpha, beta, n = 1e-3, 2e9, 2
    sizes = [2**k for k in range(10, 25, 2)]
    seconds = [alpha + size / beta for size in sizes]
    seconds[0] *= 0.2  # one small size that happened to be five times quicker
    records = [cost_model.bandwidths("all_reduce", n, size, t) for size, t in zip(sizes, seconds)]
    on_relative = cost_model.fit_alpha_beta(records)[0]
    in_seconds = cost_model.fit_alpha_beta(records, relative=False)[0]
    assert abs(in_seconds - alpha) < abs(on_relative - alpha)


@pytest.mark.parametrize("torch_name, op", [("all_gather_single", "all_gather"),
                                            ("reduce_scatter_single", "reduce_scatter"),
                                            ("all_to_all_single", "all_to_all"),
                                            ("all_reduce", "all_reduce")])
def test_bus_bytes_take_torch_names_too(torch_name, op):
    assert cost_model.bus_bytes(torch_name, 4, 1000) == pytest.approx(FACTOR_AT[4][op] * 1000)
