"""Lesson 01's exercises, checked by `helpers.exercises.check(name, your_function)`."""

from helpers.exercises import Exercise
from helpers.rules import OffTheWorld, Only, SameGroups


def _grid(world_size, rows):
    """(the members of each row, the members of each column) of a rows x cols grid."""
    cols = world_size // rows
    return ([[r * cols + c for c in range(cols)] for r in range(rows)],
            [[r * cols + c for r in range(rows)] for c in range(cols)])


def _grid_sums(rank, world_size, rows):
    row_groups, col_groups = _grid(world_size, rows)
    cols = world_size // rows
    return (sum(row_groups[rank // cols]), sum(col_groups[rank % cols]), sum(range(world_size)))


EXERCISES = {
    "even_odd_sum": Exercise(
        "put the even ranks in one group and the odd ranks in another (dist.new_group); "
        "return the sum of the ranks in your own group, as a Python int",
        [(2, ()), (4, ()), (5, ())],
        lambda rank, n: sum(r for r in range(n) if r % 2 == rank % 2),
        rules=(SameGroups(),)),
    "column_sum": Exercise(
        "with the ranks in a grid of `rows` rows (rank r at row r // cols, column r % cols), "
        "return the sum of the ranks in your column, as a Python int, using one group per column",
        [(4, (2,)), (6, (2,)), (6, (3,))],
        lambda rank, n, rows: _grid_sums(rank, n, rows)[1],
        rules=(SameGroups(),)),
    "grid_sums": Exercise(
        "with the ranks in a grid of `rows` rows, return (the sum of your row, the sum of your "
        "column, the sum of all ranks) as Python ints, using all_reduce on row and column groups "
        "only: the total is the column-sum of the row sums, never an all_reduce over the world",
        [(4, (2,)), (6, (2,)), (6, (3,)), (8, (4,))],
        _grid_sums,
        rules=(SameGroups(), Only("all_reduce", text="use only all_reduce"),
               OffTheWorld("all_reduce", text="every all_reduce names a row or a column group, "
                                              "never the whole world")),
        names=("your row's sum", "your column's sum", "the total"), points=2),
}
