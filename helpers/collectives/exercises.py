"""Lesson 03's exercises, checked by `helpers.exercises.check(name, your_function)`."""

import torch

from helpers.exercises import Exercise
from helpers.reference import seeded_randn

EXERCISES = {
    "mean_and_variance": Exercise(
        "you get `shard`, chunk `rank` of a vector that no rank holds whole; return the mean "
        "and the (population) variance of the whole vector, as a pair of floats",
        [(2, (seeded_randn(4, 12),)), (3, (seeded_randn(5, 12),)), (4, (seeded_randn(6, 10),))],
        lambda rank, n, vector: (float(vector.mean()), float(vector.var(unbiased=False))),
        inputs=lambda rank, n, vector: (vector.chunk(n)[rank],)),
    "all_gather_from_all_reduce": Exercise(
        "you get `mine` = tensor([10.0 * rank]); using only all_reduce, return the "
        "tensor of every rank's number, in rank order",
        [(2, ()), (3, ()), (4, ())],
        lambda rank, n: 10.0 * torch.arange(n, dtype=torch.float32),
        inputs=lambda rank, n: (torch.tensor([10.0 * rank]),)),
}
