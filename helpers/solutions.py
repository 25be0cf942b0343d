"""Reference solutions of the exercises in `helpers.exercises` (lessons 01-05).

Try the exercise first: each notebook's exercise cells say which function here solves it.
tests/test_exercises.py checks that every checker passes these and fails typical mistakes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def even_odd_sum(rank, world_size):
    evens = dist.new_group(list(range(0, world_size, 2)))  # every rank creates both groups
    odds = dist.new_group(list(range(1, world_size, 2)))
    total = torch.tensor([rank])
    dist.all_reduce(total, group=evens if rank % 2 == 0 else odds)
    return int(total)


def column_sum(rank, world_size, rows):
    cols = world_size // rows
    groups = [dist.new_group([r * cols + c for r in range(rows)]) for c in range(cols)]
    total = torch.tensor([rank])
    dist.all_reduce(total, group=groups[rank % cols])
    return int(total)


def broadcast_from_p2p(rank, world_size, tensor):
    if rank == 0:
        for other in range(1, world_size):
            dist.send(tensor, dst=other)
    else:
        dist.recv(tensor, src=0)
    return tensor


def ring_shift(rank, world_size, tensor):
    received = torch.empty_like(tensor)
    requests = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, (rank + 1) % world_size),
        dist.P2POp(dist.irecv, received, (rank - 1) % world_size),
    ])
    for request in requests:
        request.wait()
    return received


def mean_and_variance(rank, world_size, shard):
    # One all_reduce of (count, sum, sum of squares): enough for both moments.
    moments = torch.stack([torch.tensor(float(shard.numel())), shard.sum(), shard.square().sum()])
    dist.all_reduce(moments)
    count, total, squares = moments.tolist()
    mean = total / count
    return mean, squares / count - mean**2


def all_gather_from_all_reduce(rank, world_size, mine):
    everyone = torch.zeros(world_size)
    everyone[rank] = mine  # my slot; the others' slots are zero, and SUM fills them in
    dist.all_reduce(everyone)
    return everyone


def bus_bandwidth(op, world_size, size_bytes, seconds):
    factor = {"all_reduce": 2 * (world_size - 1) / world_size, "broadcast": 1.0, "reduce": 1.0}
    return size_bytes / seconds * factor.get(op, (world_size - 1) / world_size)


def alpha_beta_from_two_points(size1, seconds1, size2, seconds2):
    beta = (size2 - size1) / (seconds2 - seconds1)
    return seconds1 - size1 / beta, beta


def ring_all_reduce(rank, world_size, data):
    chunks = list(data.chunk(world_size))
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(2 * (world_size - 1)):
        send, receive = (rank - step) % world_size, (rank - step - 1) % world_size
        incoming = torch.empty_like(chunks[receive])
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[send], right),
                                           dist.P2POp(dist.irecv, incoming, left)])
        for request in requests:
            request.wait()
        if step < world_size - 1:
            chunks[receive] += incoming  # reduce-scatter phase: add
        else:
            chunks[receive].copy_(incoming)  # all-gather phase: copy
    return data


def tree_reduce(rank, world_size, tensor):
    incoming = torch.empty_like(tensor)
    for child in (2 * rank + 1, 2 * rank + 2):
        if child < world_size:
            dist.recv(incoming, src=child)
            tensor += incoming
    if rank > 0:
        dist.send(tensor, dst=(rank - 1) // 2)
        return None
    return tensor
