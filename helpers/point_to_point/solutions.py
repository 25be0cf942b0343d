"""Reference solutions of lesson 02's exercises. Try the exercise first."""

import torch
import torch.distributed as dist


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


def tree_broadcast(rank, world_size, tensor):
    step = 1  # in the round where `step` ranks have the data, rank r < step sends to r + step
    while step < world_size:
        if rank < step and rank + step < world_size:
            dist.send(tensor, dst=rank + step)
        elif step <= rank < 2 * step:
            dist.recv(tensor, src=rank - step)
        step *= 2
    return tensor
