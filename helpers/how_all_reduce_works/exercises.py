"""Lesson 05's exercises, checked by `helpers.exercises.check(name, your_function)`."""

import torch

from helpers.exercises import Exercise
from helpers.reference import seeded_randn
from helpers.rules import POINT_TO_POINT, AtMostSends, Only, SendsTo, log2_ceil

POINT_TO_POINT_ONLY = Only(*POINT_TO_POINT, text="use point-to-point calls only (no collectives)")


def _pieces(rank, n, vector):
    pieces = vector.tensor_split(n)
    return pieces[rank], [len(piece) for piece in pieces]


EXERCISES = {
    "ring_all_gather": Exercise(
        "you get `piece`, your part of a vector cut with tensor_split, and `lengths`, every "
        "rank's part length; return the whole vector, gathered around a ring with point-to-point "
        "calls: in each of n - 1 steps, send the piece you got last to rank + 1 and receive one "
        "from rank - 1",
        [(2, (seeded_randn(12, 7),)), (3, (seeded_randn(13, 10),)), (4, (seeded_randn(14, 9),)),
         (5, (seeded_randn(15, 13),))],
        lambda rank, n, vector: vector,
        inputs=_pieces,
        rules=(POINT_TO_POINT_ONLY,
               AtMostSends(lambda rank, n: n - 1, text="a ring sends n - 1 pieces per rank"))),
    "binomial_tree_reduce": Exercise(
        "you get `tensor` = full((4,), rank + 1.0); sum it onto rank 0 along a binomial tree, "
        "with send and recv: in round k = 0, 1, ..., a rank whose lowest set bit is bit k sends "
        "its partial sum to rank - 2**k and is done; a rank whose bits 0..k are all zero "
        "receives from rank + 2**k, if that rank exists, and adds; rank 0 returns the sum, the "
        "others None",
        [(2, ()), (5, ()), (7, ()), (8, ())],
        lambda rank, n: torch.full((4,), n * (n + 1) / 2) if rank == 0 else None,
        inputs=lambda rank, n: (torch.full((4,), rank + 1.0),),
        rules=(Only("send", "recv", text="use only send and recv"),
               SendsTo(lambda rank, n, *args: [] if rank == 0 else [rank - (rank & -rank)],
                       text="in a binomial tree each rank sends once, to rank minus its lowest "
                            "set bit", who="the tree"))),
    "recursive_doubling_all_reduce": Exercise(
        "on a power-of-two number of ranks, you get `data`; sum it across the ranks by recursive "
        "doubling with point-to-point calls: in step k = 0, 1, ..., exchange your partial sum "
        "with rank `rank ^ 2**k` and add what you receive; return the sum after log2 n steps",
        [(2, (6,)), (4, (6,)), (8, (5,))],
        lambda rank, n, numel: sum(seeded_randn(r, numel) for r in range(n)),
        inputs=lambda rank, n, numel: (seeded_randn(rank, numel),),
        rules=(POINT_TO_POINT_ONLY,
               AtMostSends(log2_ceil, text="recursive doubling sends log2 n times per rank")),
               points=2),
}
