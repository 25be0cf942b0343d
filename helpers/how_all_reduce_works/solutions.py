"""Reference solutions of lesson 05's exercises. Try the exercise first."""

import torch
import torch.distributed as dist


def ring_all_gather(rank, world_size, piece, lengths):
    pieces = [torch.empty(length) for length in lengths]
    pieces[rank] = piece.clone()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - step - 1) % world_size
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, pieces[send], right),
                                               dist.P2POp(dist.irecv, pieces[receive], left)]):
            request.wait()
    return torch.cat(pieces)


def binomial_tree_reduce(rank, world_size, tensor):
    incoming = torch.empty_like(tensor)
    distance = 1
    while distance < world_size:
        if rank & distance:  # bit k is this rank's lowest set bit: send and leave
            dist.send(tensor, dst=rank - distance)
            return None
        if rank + distance < world_size:
            dist.recv(incoming, src=rank + distance)
            tensor += incoming
        distance *= 2
    return tensor


def recursive_doubling_all_reduce(rank, world_size, data):
    distance = 1
    while distance < world_size:
        partner = rank ^ distance
        incoming = torch.empty_like(data)
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, data, partner),
                                               dist.P2POp(dist.irecv, incoming, partner)]):
            request.wait()
        data = data + incoming  # a new tensor: the isend above may still read the old one
        distance *= 2
    return data
