"""Lesson 05's all-reduce algorithms, built from point-to-point calls; they run in the ranks.

The bandwidth-optimal ring (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for
clusters of workstations", 2009), and a binary tree (and NCCL's double binary tree, Sanders,
Speck & Träff 2009). The ring's step is a function of its own, so that the notebook's stepper
can look at the tensor after each; the bytes each sends are counted from outside
(helpers.instrument.Observer), against the formulas. The ring here is
the plain one, to read; `pipelined_ring` beside this file is the fast one, for benchmarks/ring.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ring_all_reduce(tensor) -> None:
    """Sum `tensor` across all ranks, in place, with a ring: 2(n-1) steps on n chunks."""
    n = dist.get_world_size()
    chunks = tensor.tensor_split(n)  # n views into `tensor`, whatever its size
    for step in range(2 * (n - 1)):
        ring_step(chunks, step)


def ring_step(chunks, step: int) -> int:
    """One step of the ring: send one chunk to the right, receive one from the left and add it
    (steps 0 .. n-2, the reduce-scatter) or copy it (steps n-1 .. 2n-3, the all-gather).
    Returns the index of the chunk sent."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    send, receive = (rank - step) % n, (rank - step - 1) % n
    incoming = torch.empty_like(chunks[receive])
    for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[send], right),
                                           dist.P2POp(dist.irecv, incoming, left)]):
        request.wait()
    if step < n - 1:
        chunks[receive].add_(incoming)  # reduce-scatter: add
    else:
        chunks[receive].copy_(incoming)  # all-gather: copy
    return send


def heap_tree(world_size) -> dict:
    """The tree of a heap: rank p's children are 2p+1 and 2p+2. {rank: (parent, children)}."""
    return {rank: ((rank - 1) // 2 if rank else None,
                   [child for child in (2 * rank + 1, 2 * rank + 2) if child < world_size])
            for rank in range(world_size)}


def nccl_binary_tree(world_size) -> dict:
    """NCCL's binary tree (src/graph/trees.cc, ncclGetBtree): rank 0 is the root, with one child;
    below it the ranks form an in-order tree in which every odd rank is a leaf.
    {rank: (parent, children)}."""
    tree = {0: (None, [1 << (world_size - 1).bit_length() - 1] if world_size > 1 else [])}
    for rank in range(1, world_size):
        bit = rank & -rank  # the lowest set bit says how high up the tree the rank sits
        parent = (rank ^ bit) | (bit << 1)
        if parent >= world_size:
            parent = rank ^ bit
        children, step = [], bit >> 1
        if step:
            children.append(rank - step)
            while step and rank + step >= world_size:  # the right subtree may be cut short
                step >>= 1
            if step:
                children.append(rank + step)
        tree[rank] = (parent, children)
    return tree


def nccl_double_tree(world_size) -> tuple:
    """NCCL's two trees (src/graph/trees.cc, ncclGetDtree): the binary tree, and the same tree
    mirrored (rank r takes the place of n-1-r) when n is even, or shifted by one rank when n is
    odd. Every odd rank is a leaf of the first tree, and mirroring or shifting swaps odd and even,
    so no rank is a leaf in both: the ranks that send little in one tree send more in the other."""
    first = nccl_binary_tree(world_size)

    def move(rank):  # mirror when n is even, shift by one when n is odd
        return world_size - 1 - rank if world_size % 2 == 0 else (rank + 1) % world_size

    second = {move(rank): (None if parent is None else move(parent), [move(c) for c in children])
              for rank, (parent, children) in first.items()}
    return first, second


def tree_all_reduce(tensor, tree) -> None:
    """Sum `tensor` across all ranks, in place, on `tree` ({rank: (parent, children)}): reduce up to
    the root, then broadcast down.

    It takes about 2 log2 n rounds instead of the ring's 2(n-1). But an interior rank sends the
    whole tensor once up and once to each child: 3 times the tensor for a rank with a parent and two
    children, against the ring's 2(n-1)/n for everyone, and the leaves send it only once.
    """
    parent, children = tree[dist.get_rank()]
    incoming = torch.empty_like(tensor)
    for child in children:  # reduce: wait for the children's partial sums
        dist.recv(incoming, src=child)
        tensor += incoming
    if parent is not None:
        dist.send(tensor, dst=parent)
        dist.recv(tensor, src=parent)  # broadcast: the total comes back down
    for child in children:
        dist.send(tensor, dst=child)
