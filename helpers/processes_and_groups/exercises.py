"""Lesson 01's exercises, checked by `helpers.exercises.check(name, your_function)`."""

from helpers.exercises import Exercise

EXERCISES = {
    "even_odd_sum": Exercise(
        "put the even ranks in one group and the odd ranks in another (dist.new_group); "
        "return the sum of the ranks in your own group, as a Python int",
        [(2, ()), (4, ()), (5, ())],
        lambda rank, n: sum(r for r in range(n) if r % 2 == rank % 2)),
    "column_sum": Exercise(
        "with the ranks in a grid of `rows` rows (rank r at row r // cols, column r % cols), "
        "return the sum of the ranks in your column, using one group per column",
        [(4, (2,)), (6, (2,)), (6, (3,))],
        lambda rank, n, rows: sum(r for r in range(n) if r % (n // rows) == rank % (n // rows))),
}
