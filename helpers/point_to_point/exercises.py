"""Lesson 02's exercises, checked by `helpers.exercises.check(name, your_function)`."""

import torch

from helpers.exercises import Exercise
from helpers.reference import seeded_randn

EXERCISES = {
    "broadcast_from_p2p": Exercise(
        "rank 0 gets `tensor`, the others a tensor of zeros of the same shape; using only send "
        "and recv, give every rank rank 0's values, and return them",
        [(2, (seeded_randn(1, 8),)), (3, (seeded_randn(2, 8),)), (5, (seeded_randn(3, 5),))],
        lambda rank, n, tensor: tensor,
        inputs=lambda rank, n, tensor: (tensor if rank == 0 else torch.zeros_like(tensor),)),
    "ring_shift": Exercise(
        "you get `tensor` = full((3,), rank); send it to rank + 1 and receive from rank - 1 "
        "(wrapping around), without deadlock; return what you received",
        [(2, ()), (3, ()), (4, ())],
        lambda rank, n: torch.full((3,), float((rank - 1) % n)),
        inputs=lambda rank, n: (torch.full((3,), float(rank)),)),
}
