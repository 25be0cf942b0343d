"""Lesson 02's exercises, checked by `helpers.exercises.check(name, your_function)`."""

import torch

from helpers.exercises import Exercise
from helpers.reference import seeded_randn
from helpers.rules import POINT_TO_POINT, AtMostSends, Only, Rule, log2_ceil, sends


class InRounds(Rule):
    """Rank 0's data reaches every rank within ⌈log2 n⌉ rounds, one send per rank per round.

    A rank that receives in round t and then sends k times reaches its k-th peer in round t + k
    (rank 0 has the data in round 0); a chain 0 -> 1 -> 2 ... needs n - 1 rounds."""

    def broken_by(self, logs, world_size, args=(), finished=True):
        arrival, pending = {0: 0}, [0]
        while pending:
            sender = pending.pop()
            for k, peer in enumerate(sends(logs.get(sender, [])), start=1):
                if peer not in arrival:
                    arrival[peer] = arrival[sender] + k
                    pending.append(peer)
        rounds, allowed = max(arrival.values()), log2_ceil(0, world_size)
        if rounds > allowed:
            last = max(arrival, key=arrival.get)
            return (f"{self.text}: rank {last} got the data in round {rounds} on "
                    f"{world_size} ranks, where {allowed} rounds are enough.")
        return None


def _zeros_off_rank_0(rank, n, tensor):
    return (tensor if rank == 0 else torch.zeros_like(tensor),)


EXERCISES = {
    "broadcast_from_p2p": Exercise(
        "rank 0 gets `tensor`, the others a tensor of zeros of the same shape; using only send "
        "and recv, give every rank rank 0's values, and return them",
        [(2, (seeded_randn(1, 8),)), (3, (seeded_randn(2, 8),)), (5, (seeded_randn(3, 5),))],
        lambda rank, n, tensor: tensor,
        inputs=_zeros_off_rank_0,
        rules=(Only("send", "recv", text="use only send and recv"),)),
    "ring_shift": Exercise(
        "you get `tensor` = full((3,), rank); with point-to-point calls, send it to rank + 1 and "
        "receive from rank - 1 (wrapping around), without deadlock; return what you received "
        "(a tensor you isend must stay unchanged until its wait returns)",
        [(2, ()), (3, ()), (4, ())],
        lambda rank, n: torch.full((3,), float((rank - 1) % n)),
        inputs=lambda rank, n: (torch.full((3,), float(rank)),),
        rules=(Only(*POINT_TO_POINT, text="use point-to-point calls only"),)),
    "tree_broadcast": Exercise(
        "rank 0 gets `tensor`, the others zeros of the same shape; using only send and recv, give "
        "every rank rank 0's values in ⌈log2 n⌉ rounds (in round k, each rank that has the data "
        "sends it 2**k ranks further on), and return them",
        [(2, (seeded_randn(4, 6),)), (5, (seeded_randn(5, 6),)), (8, (seeded_randn(6, 3),))],
        lambda rank, n, tensor: tensor,
        inputs=_zeros_off_rank_0,
        rules=(Only("send", "recv", text="use only send and recv"),
               AtMostSends(log2_ceil, text="a rank sends at most ⌈log2 n⌉ times"),
               InRounds("every rank has the data after ⌈log2 n⌉ rounds")), points=2),
}
