"""Lesson 02's workers: send/recv chains, receive buffers, overlap, the deadlock and its fixes.

`send`/`recv` move one tensor from one rank to one other rank. The receiver must pre-allocate a
tensor of the sender's shape and dtype; blocking calls pair up in program order, so two ranks that
both send first wait for each other forever.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def chain_worker(rank, world_size, first_values):
    """0 -> 1 -> ... -> N-1: each rank receives, doubles, and passes on.

    Before: rank 0 holds `first_values`. After: rank r (r >= 1) received first_values * 2**(r-1)
    and holds first_values * 2**r.
    """
    if rank == 0:
        tensor, received = torch.tensor(first_values, dtype=torch.float32), None
    else:
        tensor = torch.empty(len(first_values), dtype=torch.float32)  # same shape and dtype as sent
        dist.recv(tensor, src=rank - 1)
        received = tensor.clone()
        tensor *= 2
    if rank < world_size - 1:
        dist.send(tensor, dst=rank + 1)
    return {"received": received, "holds": tensor}


def receive_into_worker(rank, world_size, sent_numel, received_numel, received_dtype):
    """Rank 0 sends `sent_numel` float32 numbers; rank 1 receives into a zero buffer of its own
    choosing. Returns rank 1's buffer: what a wrong shape or dtype does to the receiver."""
    if rank == 0:
        dist.send(torch.ones(sent_numel), dst=1)
        return None
    buffer = torch.zeros(received_numel, dtype=received_dtype)
    dist.recv(buffer, src=0)
    return buffer


def overlap_worker(rank, world_size, numel, matmuls, mode):
    """Rank 0 sends `numel` floats to rank 1; both ranks also have `matmuls` of compute to do.

    mode "compute alone": no transfer at all (the baseline). "blocking": transfer, then compute.
    "overlapped" (`isend`/`irecv`): start the transfer, compute while it runs, then `wait()`.
    Returns this rank's timeline, [(label, start_s, end_s), ...], from a common start (a barrier).
    """
    tensor = torch.randn(numel) if rank == 0 else torch.empty(numel)
    matrix = torch.randn(256, 256)
    events = []
    dist.barrier()
    start = time.perf_counter()

    def record(label, began):
        events.append((label, began - start, time.perf_counter() - start))

    def compute():
        began = time.perf_counter()
        for _ in range(matmuls):
            matrix @ matrix
        record("compute", began)

    began = time.perf_counter()
    if mode == "overlapped":
        request = dist.isend(tensor, dst=1) if rank == 0 else dist.irecv(tensor, src=0)
        record("isend" if rank == 0 else "irecv", began)
        compute()  # must not touch `tensor` here: the transfer may still be reading/writing it
        began = time.perf_counter()
        request.wait()
        record("wait", began)
    elif mode == "blocking":
        if rank == 0:
            dist.send(tensor, dst=1)
        else:
            dist.recv(tensor, src=0)
        record("send" if rank == 0 else "recv", began)
        compute()
    elif mode == "compute alone":
        compute()
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return events


def send_first_worker(rank, world_size):
    """The classic deadlock: both ranks send first. gloo's send waits for the matching recv,
    even for four numbers, so each rank waits for the other forever."""
    tensor = torch.full((4,), float(rank))
    dist.send(tensor, dst=1 - rank)
    dist.recv(tensor, src=1 - rank)
    return tensor


def ordered_exchange_worker(rank, world_size):
    """The fix: one side sends first, the other receives first. Rank r ends up with the other's
    tensor, full of 1 - r."""
    outgoing, incoming = torch.full((4,), float(rank)), torch.empty(4)
    if rank == 0:
        dist.send(outgoing, dst=1)
        dist.recv(incoming, src=1)
    else:
        dist.recv(incoming, src=0)
        dist.send(outgoing, dst=0)
    return incoming


def ring_worker(rank, world_size):
    """Every rank sends to its right neighbour and receives from its left, all at once.

    `batch_isend_irecv` posts all the operations together, so no ordering can deadlock. Before:
    rank r holds [r, r]. After: it has received [r-1, r-1] (mod world_size).
    """
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    outgoing, incoming = torch.full((2,), float(rank)), torch.empty(2)
    requests = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, outgoing, right),
        dist.P2POp(dist.irecv, incoming, left),
    ])
    for request in requests:
        request.wait()
    return incoming


def crossed_groups_worker(rank, world_size):
    """The same deadlock with collectives: two groups of the same two ranks, used in opposite
    orders. Rank 0 waits in group A for rank 1, which waits in group B for rank 0."""
    group_a, group_b = dist.new_group([0, 1]), dist.new_group([0, 1])
    tensor = torch.ones(1)
    for group in (group_a, group_b) if rank == 0 else (group_b, group_a):
        dist.all_reduce(tensor, group=group)
    return tensor


def mismatched_collectives_worker(rank, world_size):
    """A bug: rank 0 calls all_reduce while the others call broadcast. Without help this hangs;
    with TORCH_DISTRIBUTED_DEBUG=DETAIL every collective is checked first, and it fails at once."""
    tensor = torch.ones(3)
    if rank == 0:
        dist.all_reduce(tensor)
    else:
        dist.broadcast(tensor, src=0)
    return tensor


def late_rank_worker(rank, world_size, late_rank, barrier_timeout_s):
    """Rank `late_rank` is stuck (here: sleeping) while the others reach a `monitored_barrier`,
    which names the ranks that did not arrive in time (gloo only)."""
    from datetime import timedelta

    if rank == late_rank:
        time.sleep(barrier_timeout_s + 3)
    dist.monitored_barrier(timeout=timedelta(seconds=barrier_timeout_s))
