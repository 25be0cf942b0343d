"""Lesson 03's exercises, checked by `helpers.exercises.check(name, your_function)`."""

import torch

from helpers.exercises import Exercise
from helpers.reference import seeded_randn
from helpers.rules import AtMostCollectives, Only


def _my_shard(rank, n, vector):
    return (vector.tensor_split(n)[rank],)  # n pieces whose lengths differ by at most one


def _argmax(rank, n, vector):
    index = int((vector == vector.max()).nonzero()[0])  # the first index of the largest value
    return float(vector[index]), index


def _with_ties(seed, length):
    """Values rounded to one decimal, so that the largest one occurs more than once."""
    vector = (seeded_randn(seed, length) * 3).round(decimals=1)
    vector[length - 2] = vector[1] = vector.max()
    return vector


EXERCISES = {
    "mean_and_variance": Exercise(
        "you get `shard`, piece `rank` of a vector that no rank holds whole (the pieces may differ "
        "in length); return the mean and the (population) variance of the whole vector, as a "
        "pair of Python floats, with one collective call",
        [(2, (seeded_randn(4, 12),)), (3, (seeded_randn(5, 10),)), (4, (seeded_randn(6, 10),)),
         (5, (seeded_randn(7, 11),))],
        lambda rank, n, vector: (float(vector.mean()), float(vector.var(unbiased=False))),
        inputs=_my_shard,
        rules=(AtMostCollectives(1, text="one collective call"),),
        names=("the mean", "the variance")),
    "all_gather_from_all_reduce": Exercise(
        "you get `mine` = tensor([10.0 * rank - 15]); using only all_reduce, return the "
        "tensor of every rank's number, in rank order",
        [(2, ()), (3, ()), (4, ())],
        lambda rank, n: 10.0 * torch.arange(n, dtype=torch.float32) - 15,
        inputs=lambda rank, n: (torch.tensor([10.0 * rank - 15]),),
        rules=(Only("all_reduce", text="use only all_reduce"),)),
    "global_argmax": Exercise(
        "you get `shard`, piece `rank` of a vector split with tensor_split (the pieces may differ "
        "in length, and you do not know the others' lengths); return (the largest value of the "
        "whole vector, its index in the whole vector) as (float, int), the smallest such index "
        "when the largest value occurs more than once",
        [(2, (_with_ties(8, 9),)), (3, (_with_ties(9, 10),)), (4, (_with_ties(10, 11),)),
         (5, (_with_ties(11, 7),))],
        _argmax,
        inputs=_my_shard,
        names=("the largest value", "its index"), points=2),
}
