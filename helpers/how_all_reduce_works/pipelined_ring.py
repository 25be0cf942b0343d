"""The fast ring all-reduce, for benchmarks/ring.py: the plain ring of `algorithms.ring_all_reduce`,
pipelined in segments and with receive buffers kept between calls.

Read the plain ring first; this one does the same steps and sends the same bytes, 2(n-1)/n of the
tensor per rank. Tested against the plain ring and dist.all_reduce in tests/.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.how_all_reduce_works.algorithms import ring_all_reduce


def pipelined_ring_all_reduce(tensor, segments=4) -> None:
    """Sum `tensor` across all ranks, in place, with a pipelined ring.

    The chunk a rank receives at one step is the chunk it sends at the next. So each chunk travels
    in `segments` pieces, and every piece is forwarded as soon as it has arrived (and been added),
    as NCCL does: the ranks stop waiting for one another at every step. All the receives are posted
    at once, each into its own buffer with its own tag; a piece is added (or copied) into the tensor
    only at its step.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    if tensor.numel() < n * segments:  # too small to cut into pieces: the plain ring's job
        ring_all_reduce(tensor)
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    pieces = [list(chunk.tensor_split(segments)) for chunk in tensor.tensor_split(n)]
    steps = 2 * (n - 1)

    def received(step):  # the chunk that arrives at `step`, and is sent on at step + 1
        return (rank - step - 1) % n

    incoming = {}
    workspace = _workspace(steps * (tensor.numel() // n + 1), tensor.dtype)
    offset = 0
    for step in range(steps):
        for piece, target in enumerate(pieces[received(step)]):
            buffer = workspace[offset : offset + target.numel()]
            offset += target.numel()
            request = dist.irecv(buffer, src=left, tag=step * segments + piece)
            incoming[step, piece] = (buffer, request)
    sends = [dist.isend(piece, dst=right, tag=index) for index, piece in enumerate(pieces[rank])]
    for step in range(steps):
        for piece, target in enumerate(pieces[received(step)]):
            buffer, request = incoming[step, piece]
            request.wait()
            if step < n - 1:
                target += buffer
            else:
                target.copy_(buffer)
            if step + 1 < steps:
                sends.append(dist.isend(target, dst=right, tag=(step + 1) * segments + piece))
    for request in sends:
        request.wait()


_WORKSPACES = {}


def _workspace(numel, dtype):
    """Receive buffers, kept between calls like a communication library keeps its own: a fresh
    allocation every call costs page faults comparable to the copies themselves."""
    if _WORKSPACES.get(dtype) is None or _WORKSPACES[dtype].numel() < numel:
        _WORKSPACES[dtype] = torch.empty(numel, dtype=dtype)
    return _WORKSPACES[dtype]
