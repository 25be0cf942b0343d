"""Lesson 01 workers (helpers.groups) and their drawings, against values computed here."""

import matplotlib

matplotlib.use("Agg")

import pytest

from helpers import WorkerError, groups, plots, run


def test_busy_worker_computes_the_loop_on_every_rank():
    expected = sum(i * i % 7 for i in range(10_000))
    out = run(groups.busy_worker, 3, args=(10_000,), show_output=False)
    assert out.results == [expected] * 3


@pytest.mark.parametrize("world_size", [2, 4, 5])
def test_halves_sum_inside_each_half(world_size):
    out = run(groups.halves_worker, world_size, show_output=False)
    halves = [list(range(world_size // 2)), list(range(world_size // 2, world_size))]
    for rank, result in enumerate(out):
        half = halves[0] if rank in halves[0] else halves[1]
        assert result["group_ranks"] == half
        assert result["group_sum"] == sum(half)
        assert result["group_rank"] == half.index(rank)


@pytest.mark.parametrize("world_size, rows", [(6, 2), (4, 2), (3, 1), (6, 3)])
def test_grid_rows_and_columns_match_the_layout_and_device_mesh(world_size, rows):
    out = run(groups.grid_worker, world_size, args=(rows,), show_output=False)
    cols = world_size // rows
    for rank, result in enumerate(out):
        row, col = rank // cols, rank % cols
        row_members = list(range(row * cols, (row + 1) * cols))
        col_members = list(range(col, world_size, cols))
        assert (result["row"], result["col"]) == (row, col)
        assert result["row_ranks"] == row_members == result["mesh_tp_ranks"]
        assert result["col_ranks"] == col_members == result["mesh_dp_ranks"]
        assert result["row_sum"] == sum(row_members)
        assert result["col_sum"] == sum(col_members)


def test_grid_that_does_not_fit_is_an_error_on_every_rank():
    with pytest.raises(WorkerError, match="5 ranks do not fill a grid with 2 rows"):
        run(groups.grid_worker, 5, args=(2,), show_output=False)


def test_plot_groups_draws_one_box_per_rank_with_its_sum():
    results = [{"rank": r, "group": r // 2, "group_sum": 2 * (r // 2) * 2 + 1} for r in range(4)]
    axes = plots.plot_groups(results).axes[0]
    assert len(axes.patches) == 4
    labels = [text.get_text() for text in axes.texts]
    assert "rank 2\nsum = 5" in labels and "group 1: ranks [2, 3]" in labels


def test_plot_grid_draws_one_box_per_rank_and_names_every_group():
    out = run(groups.grid_worker, 4, args=(2,), show_output=False)
    axes = plots.plot_grid(out.results).axes[0]
    assert len(axes.patches) == 4
    labels = [text.get_text() for text in axes.texts]
    assert "rank 3\nrow sum 5\ncol sum 4" in labels
    assert {"row group 0", "row group 1", "column group 0", "column group 1"} <= set(labels)
