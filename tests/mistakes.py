"""Typical wrong answers to the exercises (helpers.exercises), for tests/test_exercises.py.

They run inside ranks, so this module imports only torch.
"""

import torch
import torch.distributed as dist


def not_started(rank, world_size, *inputs):
    raise NotImplementedError


def sum_over_the_world(rank, world_size):  # even_odd_sum without groups
    total = torch.tensor([rank])
    dist.all_reduce(total)
    return int(total)


def only_my_own_group(rank, world_size):  # even_odd_sum: each rank creates one group only
    group = dist.new_group(list(range(rank % 2, world_size, 2)))
    total = torch.tensor([rank])
    dist.all_reduce(total, group=group)
    return int(total)


def row_instead_of_column(rank, world_size, rows):
    cols = world_size // rows
    groups = [dist.new_group([r * cols + c for c in range(cols)]) for r in range(rows)]
    total = torch.tensor([rank])
    dist.all_reduce(total, group=groups[rank // cols])
    return int(total)


def broadcast_to_rank_one_only(rank, world_size, tensor):
    if rank == 0:
        dist.send(tensor, dst=1)
    else:
        dist.recv(tensor, src=0)
    return tensor


def return_without_communicating(rank, world_size, tensor):
    return tensor


def blocking_send_first(rank, world_size, tensor):  # ring_shift that deadlocks
    received = torch.empty_like(tensor)
    dist.send(tensor, dst=(rank + 1) % world_size)
    dist.recv(received, src=(rank - 1) % world_size)
    return received


def shift_the_wrong_way(rank, world_size, tensor):
    received = torch.empty_like(tensor)
    requests = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, (rank - 1) % world_size),
        dist.P2POp(dist.irecv, received, (rank + 1) % world_size),
    ])
    for request in requests:
        request.wait()
    return received


def average_of_local_variances(rank, world_size, shard):
    moments = torch.stack([shard.mean(), shard.var(unbiased=False)])
    dist.all_reduce(moments)
    return tuple((moments / world_size).tolist())


def forgot_to_divide(rank, world_size, shard):
    moments = torch.stack([shard.sum(), shard.square().sum()])
    dist.all_reduce(moments)
    return tuple(moments.tolist())


def slots_not_zeroed(rank, world_size, mine):
    everyone = torch.ones(world_size)
    everyone[rank] = mine
    dist.all_reduce(everyone)
    return everyone


def algbw_not_busbw(op, world_size, size_bytes, seconds):
    return size_bytes / seconds


def reduce_scatter_on_output_size(op, world_size, size_bytes, seconds):
    factor = {"all_reduce": 2 * (world_size - 1) / world_size, "broadcast": 1.0}
    size = size_bytes / world_size if op == "reduce_scatter" else size_bytes
    return size / seconds * factor.get(op, (world_size - 1) / world_size)


def alpha_and_beta_swapped(size1, seconds1, size2, seconds2):
    beta = (size2 - size1) / (seconds2 - seconds1)
    return beta, seconds1 - size1 / beta


def _ring_with_a_bug(rank, world_size, data, steps):
    """The exercise's ring, adding at every step (right only in the reduce-scatter phase)."""
    chunks = list(data.chunk(world_size))
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(steps):
        send, receive = (rank - step) % world_size, (rank - step - 1) % world_size
        incoming = torch.empty_like(chunks[receive])
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[send], right),
                                           dist.P2POp(dist.irecv, incoming, left)])
        for request in requests:
            request.wait()
        chunks[receive] += incoming
    return data


def ring_that_adds_in_both_phases(rank, world_size, data):
    return _ring_with_a_bug(rank, world_size, data, steps=2 * (world_size - 1))


def ring_without_all_gather(rank, world_size, data):
    return _ring_with_a_bug(rank, world_size, data, steps=world_size - 1)


def tree_with_wrong_parent(rank, world_size, tensor):
    incoming = torch.empty_like(tensor)
    for child in (2 * rank + 1, 2 * rank + 2):
        if child < world_size:
            dist.recv(incoming, src=child)
            tensor += incoming
    if rank > 0:
        dist.send(tensor, dst=rank // 2)  # should be (rank - 1) // 2
        return None
    return tensor
