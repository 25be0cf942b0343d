"""Lesson 04 (helpers.measuring_communication): the benchmark worker, the sweep, the published
figures and the exercises. The formulas they use are helpers.cost_model's (test_cost_model)."""

import math
import types

import matplotlib

matplotlib.use("Agg")

import pytest
from checker import expect_rejection

from helpers import WorkerError, cost_model, published, run
from helpers.measuring_communication import experiments, plots
from helpers.measuring_communication import workers as bench
from helpers.measuring_communication.solutions import bus_bandwidth


@pytest.mark.parametrize("op", cost_model.OPERATIONS)
def test_benchmark_worker_times_every_operation(op):
    out = run(bench.benchmark_worker, 2, kwargs=dict(
        op=op, size_bytes=4096, warmup=1, iterations=3), show_output=False)
    assert out[0] == out[1]  # the MAX across ranks makes every rank report the same median
    assert 0 < out[0] < 10


def test_unknown_operation_is_an_error():
    with pytest.raises(WorkerError, match="unknown operation 'allreduce'"):
        run(bench.benchmark_worker, 2, kwargs=dict(
            op="allreduce", size_bytes=4096, warmup=1, iterations=1), show_output=False)


def test_sweep_records_every_size_and_advances_the_progress():
    progress = types.SimpleNamespace(value=0)
    records = experiments.sweep("all_gather", 2, [1024, 8192], warmup=1, iterations=2,
                                progress=progress)
    assert progress.value == 2
    assert [r["size_bytes"] for r in records] == [1024, 8192]
    for r in records:
        assert r["busbw"] == pytest.approx(r["size_bytes"] / r["seconds"] * 0.5)


def test_a_sweep_times_fewer_calls_where_each_moves_many_bytes():
    # at most 40 MiB of timed calls a size, never under 3 calls, never over the iterations asked
    assert [experiments.iterations_at(2**k, 10) for k in range(10, 27, 2)] == [
        10, 10, 10, 10, 10, 10, 10, 3, 3]  # 1 KiB ... 4 MiB: 10; 16 MiB: 40 // 16 = 2, so 3
    assert experiments.iterations_at(2**23, 10) == 5  # 8 MiB: 40 // 8
    assert experiments.iterations_at(2**10, 2) == 2


def test_memory_copy_bandwidth_is_a_finite_rate():
    bandwidth = bench.memory_copy_bandwidth(2**20, 3)
    assert math.isfinite(bandwidth) and bandwidth > 0


def test_published_sweeps_are_drawn_and_labelled_as_not_measured():
    measured = {"here": [cost_model.bandwidths("all_reduce", 2, size, size / 1e9)
                         for size in (2**20, 2**24)]}
    axes = plots.plot_against_published(measured, published.PUBLISHED_SWEEPS).axes[0]
    labels = [line.get_label() for line in axes.get_lines()]
    assert labels[0] == "here (measured here)"
    assert len(labels) == 1 + len(published.PUBLISHED_SWEEPS)
    assert all(label.endswith("(published, not measured here)") for label in labels[1:])
    for _, source, conditions, points in published.PUBLISHED_SWEEPS:
        assert "github.com/stas00/ml-engineering" in source and "all_reduce_bench.py" in conditions
        assert [size for size, _ in points] == [2**k for k in range(15, 35)]  # 32 KiB ... 16 GiB


# Typical wrong answers to the exercises, and what the checker says.


def algbw_not_busbw(op, world_size, size_bytes, seconds):
    return size_bytes / seconds


def input_taken_for_the_whole_array(op, world_size, input_bytes, seconds):
    return input_bytes / seconds * cost_model.BUSBW_FACTORS[op](world_size)  # wrong for all_gather


def alpha_and_beta_swapped(size1, seconds1, size2, seconds2):
    beta = (size2 - size1) / (seconds2 - seconds1)
    return beta, seconds1 - size1 / beta


def alpha_taken_as_the_first_time(size1, seconds1, size2, seconds2):  # size1 / beta left in
    return seconds1, (size2 - size1) / (seconds2 - seconds1)


def all_to_all_counted_twice(op, world_size, size_bytes, seconds):  # as if it were all_reduce
    if op == "all_to_all":
        return size_bytes / seconds * 2 * (world_size - 1) / world_size
    return bus_bandwidth(op, world_size, size_bytes, seconds)


def whole_array_across_the_nodes(size_bytes, nodes, gpus_per_node, intra_bandwidth,
                                 inter_bandwidth):  # forgets that each GPU sends only S/g out
    g, n = gpus_per_node, nodes
    inside = (g - 1) / g * size_bytes / intra_bandwidth
    return 2 * inside + 2 * (n - 1) / n * size_bytes / inter_bandwidth


@pytest.mark.parametrize("name, mistake, says", [
    ("bus_bandwidth", algbw_not_busbw,
     "For the input op='all_reduce', world_size=4, size_bytes=67108864, seconds=0.05: expected"),
    ("bus_bandwidth", input_taken_for_the_whole_array,
     "For the input op='all_gather', world_size=3, input_bytes=1048576, seconds=0.002"),
    ("bus_bandwidth", all_to_all_counted_twice,
     "For the input op='all_to_all', world_size=4, size_bytes=4194304, seconds=0.004"),
    ("alpha_beta_from_two_points", alpha_and_beta_swapped, "alpha: expected 0.00100000, got"),
    ("alpha_beta_from_two_points", alpha_taken_as_the_first_time,
     "alpha: expected 0.00100000, got 0.00600000"),
    ("two_level_all_reduce_seconds", whole_array_across_the_nodes,
     "For the input size_bytes=1073741824, nodes=4, gpus_per_node=8, "
     "intra_bandwidth=450000000000.0, inter_bandwidth=50000000000.0: expected"),
])
def test_checker_rejects_a_typical_mistake(name, mistake, says):
    expect_rejection(name, mistake, says)


@pytest.mark.parametrize("mistake, hint", [
    (algbw_not_busbw, "Hint: that is algbw, S / t."),
    (input_taken_for_the_whole_array, "Hint: all_gather's input is one rank's piece; "
                                      "nccl-tests' S is the gathered output, 3 pieces"),
    (all_to_all_counted_twice, "Hint: which factor does nccl-tests give this collective?"),
])
def test_the_bus_bandwidth_checker_names_the_usual_mistake(mistake, hint):
    text = expect_rejection("bus_bandwidth", mistake, "For the input")
    assert hint in text, text
