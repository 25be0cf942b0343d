"""Lesson 05's exercises, checked by `helpers.exercises.check(name, your_function)`."""

import torch

from helpers.exercises import Exercise
from helpers.reference import seeded_randn

EXERCISES = {
    "ring_all_reduce": Exercise(
        "you get `data`, a random tensor of your own; sum it across the ranks with a ring "
        "of send/recv or isend/irecv (no collectives), and return the sum",
        [(2, (24,)), (3, (24,)), (4, (24,))],
        lambda rank, n, numel: sum(seeded_randn(r, numel) for r in range(n)),
        inputs=lambda rank, n, numel: (seeded_randn(rank, numel),)),
    "tree_reduce": Exercise(
        "you get `tensor` = full((4,), rank + 1.0); sum it onto rank 0 along a binary tree "
        "(rank p's children are 2p+1 and 2p+2) with send/recv; rank 0 returns the sum, the "
        "others None",
        [(2, ()), (5, ()), (7, ())],
        lambda rank, n: torch.full((4,), n * (n + 1) / 2) if rank == 0 else None,
        inputs=lambda rank, n: (torch.full((4,), rank + 1.0),)),
}
