"""Lesson 04 (helpers.bench): the bandwidth formulas, the alpha-beta fit, the benchmark worker."""

import math
import types

import pytest

from helpers import WorkerError, bench, run


@pytest.mark.parametrize("op, factor", [
    ("all_reduce", lambda n: 2 * (n - 1) / n), ("reduce_scatter", lambda n: (n - 1) / n),
    ("all_gather", lambda n: (n - 1) / n), ("all_to_all", lambda n: (n - 1) / n),
    ("broadcast", lambda n: 1), ("reduce", lambda n: 1),
])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_algbw_and_busbw_follow_nccl_tests(op, factor, world_size):
    record = bench.bandwidths(op, world_size, 3 * 2**20, 0.002)
    assert record["algbw"] == pytest.approx(3 * 2**20 / 0.002)
    assert record["busbw"] == pytest.approx(3 * 2**20 / 0.002 * factor(world_size))


def test_reduce_scatter_on_the_output_size_is_n_times_too_low():
    on_input = bench.bandwidths("reduce_scatter", 4, 2**24, 0.01)["busbw"]
    on_output = bench.bandwidths("reduce_scatter", 4, 2**24 // 4, 0.01)["busbw"]
    assert on_input / on_output == pytest.approx(4)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_alpha_beta_fit_recovers_the_parameters_of_synthetic_data(op):
    alpha, beta, n = 250e-6, 3.5e9, 4
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n}[op]
    records = [bench.bandwidths(op, n, size, alpha + size * factor / beta)
               for size in (2**k for k in range(10, 27, 2))]
    fitted_alpha, fitted_beta = bench.fit_alpha_beta(records)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted_beta == pytest.approx(beta, rel=1e-6)
    assert bench.model_seconds(fitted_alpha, fitted_beta, op, n, 2**20) == pytest.approx(
        alpha + 2**20 * factor / beta)


@pytest.mark.parametrize("op", bench.OPERATIONS)
def test_benchmark_worker_times_every_operation(op):
    out = run(bench.benchmark_worker, 2, args=(op, 4096, 1, 3), show_output=False)
    assert out[0] == out[1]  # the MAX across ranks makes every rank report the same median
    assert 0 < out[0] < 10


def test_unknown_operation_is_an_error():
    with pytest.raises(WorkerError, match="unknown operation 'allreduce'"):
        run(bench.benchmark_worker, 2, args=("allreduce", 4096, 1, 1), show_output=False)


def test_sweep_records_every_size_and_advances_the_progress():
    progress = types.SimpleNamespace(value=0)
    records = bench.sweep("all_gather", 2, [1024, 8192], warmup=1, iterations=2, progress=progress)
    assert progress.value == 2
    assert [r["size_bytes"] for r in records] == [1024, 8192]
    for r in records:
        assert r["busbw"] == pytest.approx(r["size_bytes"] / r["seconds"] * 0.5)


def test_memory_copy_bandwidth_is_a_finite_rate():
    assert math.isfinite(bench.memory_copy_bandwidth(2**20, 3)) and bench.memory_copy_bandwidth(2**20, 3) > 0


def test_published_sweeps_are_drawn_and_labelled_as_not_measured():
    import matplotlib

    matplotlib.use("Agg")
    from helpers import plots

    measured = {"here": [bench.bandwidths("all_reduce", 2, size, size / 1e9) for size in (2**20, 2**24)]}
    axes = plots.plot_against_published(measured, bench.PUBLISHED_SWEEPS).axes[0]
    labels = [line.get_label() for line in axes.get_lines()]
    assert labels[0] == "here (measured here)"
    assert len(labels) == 1 + len(bench.PUBLISHED_SWEEPS)
    assert all(label.endswith("(published, not measured here)") for label in labels[1:])
    for _, source, points in bench.PUBLISHED_SWEEPS:
        assert "github.com" in source
        assert [size for size, _ in points] == sorted(size for size, _ in points)
