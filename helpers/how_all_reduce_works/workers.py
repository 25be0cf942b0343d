"""Lesson 05's workers and models: the algorithms (algorithms.py, pipelined_ring.py) run on
random data and checked against dist.all_reduce, their cost in the alpha-beta model, and a
bandwidth model of topologies.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from helpers.how_all_reduce_works.algorithms import (
    heap_tree,
    nccl_double_tree,
    ring_all_reduce,
    ring_step,
    tree_all_reduce,
)
from helpers.how_all_reduce_works.pipelined_ring import pipelined_ring_all_reduce
from helpers.instrument import Observer
from helpers.reference import seeded_randn


def ring_all_reduce_worker(rank, world_size, numel, seed, pipelined=False):
    """Ring all-reduce of random data (the plain ring, or with `pipelined` the fast one), checked
    against dist.all_reduce of the same data. Returns the ring's result, the reference and the
    bytes this rank sent."""

    data = seeded_randn(seed + rank, numel)
    reference = data.clone()
    dist.all_reduce(reference)
    with Observer() as observed:
        (pipelined_ring_all_reduce if pipelined else ring_all_reduce)(data)
    return {"result": data, "reference": reference, "bytes_sent": sum(observed.sent().values())}


def ring_trace_worker(rank, world_size):
    """The ring on n chunks of one number each, rank r starting with 10**r everywhere: a sum's
    digits show which ranks it contains (1111 = all four). Returns the start and every step."""
    data = torch.full((world_size,), 10.0**rank, dtype=torch.float64)
    trace = [(-1, None, data.clone())]  # step -1: the start
    chunks = data.tensor_split(world_size)  # ring_all_reduce's loop, with a look after each step
    for step in range(2 * (world_size - 1)):
        sent = ring_step(chunks, step)
        trace.append((step, sent, data.clone()))
    return trace


def tree_all_reduce_worker(rank, world_size, numel, seed, double):
    """Tree all-reduce of random data, checked against dist.all_reduce.

    `double=False`: one heap tree. `double=True`: NCCL's double binary tree, each tree carrying half
    of the tensor (NCCL also runs both at once and pipelines the chunks; here they run one after the
    other). Returns the result, the reference and the bytes this rank sent.
    """
    data = seeded_randn(seed + rank, numel)
    reference = data.clone()
    dist.all_reduce(reference)
    with Observer() as observed:
        if double:
            first, second = nccl_double_tree(world_size)
            half, other_half = data.chunk(2)
            tree_all_reduce(half, first)
            tree_all_reduce(other_half, second)
        else:
            tree_all_reduce(data, heap_tree(world_size))
    return {"result": data, "reference": reference, "bytes_sent": sum(observed.sent().values())}


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
    hops = {"switch": 1, "torus_2d": max(1, math.sqrt(n) / 2), "ring": max(1, n / 4)}[topology]
    return (n - 1) / n * size_bytes * hops / device_bandwidth


TOPOLOGIES = ["switch", "torus_2d", "ring"]
TOPOLOGY_LABELS = {"switch": "switch", "torus_2d": "2-D torus", "ring": "ring"}
