"""Lesson 01 (helpers.processes_and_groups): workers, drawings and exercises, against values
computed here."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.distributed as dist
from checker import expect_acceptance, expect_rejection

from helpers import WorkerError, WorkerTimeout, run
from helpers.processes_and_groups import plots, workers


def test_busy_loop_computes_its_sum_and_each_rank_times_it():
    assert workers.busy_loop(10_000) == sum(i * i % 7 for i in range(10_000))
    seconds = run(workers.busy_worker, 3, args=(10_000,), show_output=False).results
    assert len(seconds) == 3 and all(0 < s < 10 for s in seconds)


def test_a_rank_that_skips_a_group_counts_differently_and_the_next_group_hangs():
    # torch 2.13 names a group by how many groups the rank has created (the world is group 0)
    counted = run(workers.skipped_group_worker, 4, args=(False,), show_output=False).results
    assert counted == [1 + 1, 1 + 2, 1 + 2, 1 + 2]
    with pytest.raises(WorkerTimeout) as caught:
        run(workers.skipped_group_worker, 4, args=(True,), timeout=3, show_output=False)
    for rank in range(4):
        assert caught.value.where[rank].startswith(
            "blocked in torch.distributed.new_group(), called from skipped_group_worker")


@pytest.mark.parametrize("world_size", [2, 4, 5])
def test_halves_sum_inside_each_half(world_size):
    out = run(workers.halves_worker, world_size, show_output=False)
    halves = [list(range(world_size // 2)), list(range(world_size // 2, world_size))]
    for rank, result in enumerate(out):
        half = halves[0] if rank in halves[0] else halves[1]
        assert result["group_ranks"] == half
        assert result["group_sum"] == sum(half)
        assert result["group_rank"] == half.index(rank)


@pytest.mark.parametrize("world_size, rows", [(6, 2), (4, 2), (3, 1), (6, 3)])
def test_grid_rows_and_columns_match_the_layout_and_device_mesh(world_size, rows):
    out = run(workers.grid_worker, world_size, args=(rows,), show_output=False)
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
        run(workers.grid_worker, 5, args=(2,), show_output=False)


def test_plot_groups_draws_one_box_per_rank_with_its_sum():
    results = [{"rank": r, "group": r // 2, "group_sum": 2 * (r // 2) * 2 + 1} for r in range(4)]
    axes = plots.plot_groups(results).axes[0]
    assert len(axes.patches) == 4
    labels = [text.get_text() for text in axes.texts]
    assert "rank 2\nsum = 5" in labels and "group 1: ranks [2, 3]" in labels


def test_plot_grid_draws_one_box_per_rank_and_names_every_group():
    out = run(workers.grid_worker, 4, args=(2,), show_output=False)
    axes = plots.plot_grid(out.results).axes[0]
    assert len(axes.patches) == 4
    labels = [text.get_text() for text in axes.texts]
    assert "rank 3\nrow sum 5\ncol sum 4" in labels
    assert {"row group 0", "row group 1", "column group 0", "column group 1"} <= set(labels)


# Typical wrong answers to the exercises, and what the checker says.


def sum_over_the_world(rank, world_size):  # even_odd_sum without groups
    total = torch.tensor([rank])
    dist.all_reduce(total)
    return int(total)


def only_my_own_group(rank, world_size):  # even_odd_sum: each rank creates one group only
    group = dist.new_group(list(range(rank % 2, world_size, 2)))
    total = torch.tensor([rank])
    dist.all_reduce(total, group=group)
    return int(total)


def even_ranks_skip_the_odd_group(rank, world_size):  # runs, but breaks new_group's rule
    evens = dist.new_group(list(range(0, world_size, 2)))
    odds = dist.new_group(list(range(1, world_size, 2))) if rank % 2 else None
    total = torch.tensor([rank])
    dist.all_reduce(total, group=evens if rank % 2 == 0 else odds)
    return int(total)


def a_tensor_for_an_int(rank, world_size):
    evens = dist.new_group(list(range(0, world_size, 2)))
    odds = dist.new_group(list(range(1, world_size, 2)))
    total = torch.tensor([rank])
    dist.all_reduce(total, group=evens if rank % 2 == 0 else odds)
    return total


def row_instead_of_column(rank, world_size, rows):
    cols = world_size // rows
    groups = [dist.new_group([r * cols + c for c in range(cols)]) for r in range(rows)]
    total = torch.tensor([rank])
    dist.all_reduce(total, group=groups[rank // cols])
    return int(total)


def total_over_the_world(rank, world_size, rows):  # grid_sums, the total the easy way
    cols = world_size // rows
    row_groups = [dist.new_group([r * cols + c for c in range(cols)]) for r in range(rows)]
    col_groups = [dist.new_group([r * cols + c for r in range(rows)]) for c in range(cols)]
    row_sum, col_sum, total = (torch.tensor([rank]) for _ in range(3))
    dist.all_reduce(row_sum, group=row_groups[rank // cols])
    dist.all_reduce(col_sum, group=col_groups[rank % cols])
    dist.all_reduce(total)
    return int(row_sum), int(col_sum), int(total)


GROUP_RULE = "every rank must create every group, in the same order"


@pytest.mark.parametrize("name, mistake, says", [
    ("even_odd_sum", sum_over_the_world, "On 2 ranks, rank 0: expected 0, got 1"),
    ("even_odd_sum", only_my_own_group,
     f"On 2 ranks: {GROUP_RULE} (rank 0 created [[0]]; rank 1 created [[1]])."),
    ("even_odd_sum", even_ranks_skip_the_odd_group,
     f"On 2 ranks: {GROUP_RULE} (rank 0 created [[0]]; rank 1 created [[0], [1]])."),
    ("even_odd_sum", a_tensor_for_an_int,
     "On 2 ranks, rank 0: expected a Python int (tensor.item() gives one), got Tensor"),
    ("column_sum", row_instead_of_column, "On 4 ranks, rank 0: expected 2, got 1"),
    ("grid_sums", total_over_the_world,
     "rank 0 broke a rule: the task says: every all_reduce names a row or a column group, never "
     "the whole world. Your code called dist.all_reduce()."),
])
def test_checker_rejects_a_typical_mistake(name, mistake, says):
    expect_rejection(name, mistake, says)


def members_only_with_local_synchronization(rank, world_size):  # a right answer, another way
    mine = list(range(rank % 2, world_size, 2))
    group = dist.new_group(mine, use_local_synchronization=True)  # named by its members
    total = torch.tensor([rank])
    dist.all_reduce(total, group=group)
    return int(total)


def test_groups_created_by_their_members_only_pass_the_group_rule():
    expect_acceptance("even_odd_sum", members_only_with_local_synchronization)
