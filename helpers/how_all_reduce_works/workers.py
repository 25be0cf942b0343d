"""Lesson 05's workers and models: ring and tree all-reduce from point-to-point calls, their
cost in the alpha-beta model, and a bandwidth model of topologies.

All-reduce built from point-to-point calls, twice: the bandwidth-optimal ring (Patarasuk & Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009), and a binary tree
(and NCCL's double binary tree, Sanders, Speck & Träff 2009). Each counts the bytes it sends, so
the formulas can be checked, and the ring records a trace for the notebook's stepper. The ring
here is the plain one, to read; `pipelined_ring` beside this file is the fast one, for
benchmarks/ring.py.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from helpers.reference import seeded_randn


def ring_all_reduce(tensor, trace=None) -> int:
    """Sum `tensor` across all ranks, in place, with a ring; return the bytes this rank sent.
    Steps 0 .. n-2 reduce-scatter (add what arrives), steps n-1 .. 2n-3 all-gather (copy it).
    If `trace` is a list, (step, chunk sent, copy of the tensor) is appended after each step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.tensor_split(n)  # n views into `tensor`, whatever its size
    right, left = (rank + 1) % n, (rank - 1) % n
    bytes_sent = 0
    for step in range(2 * (n - 1)):
        send, receive = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[receive])
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[send], right),
                                               dist.P2POp(dist.irecv, incoming, left)]):
            request.wait()
        if step < n - 1:
            chunks[receive].add_(incoming)  # reduce-scatter: add
        else:
            chunks[receive].copy_(incoming)  # all-gather: copy
        bytes_sent += chunks[send].numel() * tensor.element_size()
        if trace is not None:
            trace.append((step, send, tensor.clone()))
    return bytes_sent


def ring_all_reduce_worker(rank, world_size, numel, seed, pipelined=False):
    """Ring all-reduce of random data (the plain ring, or with `pipelined` the fast one), checked
    against dist.all_reduce of the same data. Returns the ring's result, the reference and the
    bytes this rank sent."""
    from helpers.how_all_reduce_works.pipelined_ring import pipelined_ring_all_reduce

    data = seeded_randn(seed + rank, numel)
    reference = data.clone()
    dist.all_reduce(reference)
    bytes_sent = (pipelined_ring_all_reduce if pipelined else ring_all_reduce)(data)
    return {"result": data, "reference": reference, "bytes_sent": bytes_sent}


def ring_trace_worker(rank, world_size):
    """The ring on n chunks of one number each, rank r starting with 10**r everywhere: a sum's
    digits show which ranks it contains (1111 = all four). Returns the start and every step."""
    data = torch.full((world_size,), 10.0**rank, dtype=torch.float64)
    trace = [(-1, None, data.clone())]  # step -1: the start
    ring_all_reduce(data, trace)
    return trace


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


def tree_all_reduce(tensor, tree) -> int:
    """Sum `tensor` across all ranks, in place, on `tree` ({rank: (parent, children)}): reduce up to
    the root, then broadcast down. Returns the bytes this rank sent.

    It takes about 2 log2 n rounds instead of the ring's 2(n-1). But an interior rank sends the
    whole tensor once up and once to each child: 3 times the tensor for a rank with a parent and two
    children, against the ring's 2(n-1)/n for everyone, and the leaves send it only once.
    """
    parent, children = tree[dist.get_rank()]
    size = tensor.numel() * tensor.element_size()
    bytes_sent = 0
    incoming = torch.empty_like(tensor)
    for child in children:  # reduce: wait for the children's partial sums
        dist.recv(incoming, src=child)
        tensor += incoming
    if parent is not None:
        dist.send(tensor, dst=parent)
        bytes_sent += size
        dist.recv(tensor, src=parent)  # broadcast: the total comes back down
    for child in children:
        dist.send(tensor, dst=child)
        bytes_sent += size
    return bytes_sent


def tree_all_reduce_worker(rank, world_size, numel, seed, double):
    """Tree all-reduce of random data, checked against dist.all_reduce.

    `double=False`: one heap tree. `double=True`: NCCL's double binary tree, each tree carrying half
    of the tensor (NCCL also runs both at once and pipelines the chunks; here they run one after the
    other). Returns the result, the reference and the bytes this rank sent.
    """
    data = seeded_randn(seed + rank, numel)
    reference = data.clone()
    dist.all_reduce(reference)
    if double:
        first, second = nccl_double_tree(world_size)
        half, other_half = data.chunk(2)
        bytes_sent = tree_all_reduce(half, first) + tree_all_reduce(other_half, second)
    else:
        bytes_sent = tree_all_reduce(data, heap_tree(world_size))
    return {"result": data, "reference": reference, "bytes_sent": bytes_sent}


def ring_seconds(n, size_bytes, alpha, beta):
    """alpha-beta model of the ring: 2(n-1) steps, each a latency plus one chunk of S/n bytes."""
    return 2 * (n - 1) * (alpha + size_bytes / n / beta)


def tree_seconds(n, size_bytes, alpha, beta):
    """alpha-beta model of a pipelined (double) binary tree, as NCCL runs it: about 2 log2(n)
    latencies, and the data crosses each link about twice, whatever n."""
    return 2 * math.log2(n) * alpha + 2 * size_bytes / beta


def recursive_doubling_seconds(n, size_bytes, alpha, beta):
    """alpha-beta model of recursive doubling (n a power of two): log2(n) steps, each exchanging
    the whole partial sum with the rank 2**k away. Few latencies, but log2(n) times the data."""
    return math.log2(n) * (alpha + size_bytes / beta)


def halving_doubling_seconds(n, size_bytes, alpha, beta):
    """alpha-beta model of recursive halving then doubling (Rabenseifner; n a power of two): a
    reduce-scatter that halves the data at each of log2(n) steps, then an all-gather that doubles
    it back. 2 log2(n) latencies and the ring's 2(n-1)/n of the data."""
    return 2 * math.log2(n) * alpha + 2 * (n - 1) / n * size_bytes / beta


def all_reduce_on(topology, n, size_bytes, device_bandwidth):
    """Bandwidth-only time of an all-reduce of `size_bytes` on `n` devices that can each send
    `device_bandwidth` bytes/s in total, split over their links.

    Rings can be laid over any of these topologies so as to use all of a device's links at once
    (both directions of a ring; rows and columns of a torus), so the time is the same everywhere:
    2(n-1)/n * S / B.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; choose one of {TOPOLOGIES}")
    return 2 * (n - 1) / n * size_bytes / device_bandwidth


def all_to_all_on(topology, n, size_bytes, device_bandwidth):
    """Bandwidth-only time of an all-to-all in which each device sends (n-1)/n of `size_bytes`,
    each device able to send `device_bandwidth` bytes/s in total.

    A message that crosses h hops occupies a link at each hop, so on average every byte costs h
    bytes of some device's bandwidth: switch 1 hop; 2-D torus (sqrt(n) x sqrt(n), wrapped)
    about sqrt(n)/2 hops; ring about n/4 hops (going the shorter way round).
    """
    hops = {"switch": 1, "2-D torus": max(1, math.sqrt(n) / 2), "ring": max(1, n / 4)}[topology]
    return (n - 1) / n * size_bytes * hops / device_bandwidth


TOPOLOGIES = ["switch", "2-D torus", "ring"]
