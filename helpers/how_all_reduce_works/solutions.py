"""Reference solutions of lesson 05's exercises. Try the exercise first."""

import torch
import torch.distributed as dist

from helpers.how_all_reduce_works import workers


def ring_all_reduce(rank, world_size, data):
    workers.ring_all_reduce(data)  # the lesson's ring, read in the notebook
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
