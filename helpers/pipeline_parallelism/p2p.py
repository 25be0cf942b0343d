"""The pipeline's messages (lesson 09): activations to rank + 1, their gradients back to rank - 1.

Sends are isend, waited for at the end of the step: in 1F1B's steady phase neighbours send to
each other at the same moment, and a blocking send could deadlock. Receives are irecv, so that
a rank can compute while one is on its way (zb's W's). Before its first activation, each rank
sends the next one the activation's dtype and shape (every micro-batch has the same).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


class Incoming:
    """A message on its way into `buffer` (work None: nothing to receive, `buffer` is None)."""

    def __init__(self, buffer=None, work=None):
        self.buffer, self.work = buffer, work

    def ready(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self):
        if self.work is not None:
            self.work.wait()
        return self.buffer


class Messages:
    """One rank's messages to and from its neighbours in the pipeline `group` (None: the world)."""

    def __init__(self, group=None):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        # neighbours' global ranks (send and recv take those); the first and the last have one
        self.prev, self.next = (dist.get_global_rank(group, r) if group is not None
                                and 0 <= r < self.size else r
                                for r in (self.rank - 1, self.rank + 1))
        self.sends = []  # (work, tensor): kept until finish()
        self.input_spec = None  # the dtype and shape rank - 1 sends
        self.spec_sent = False

    def send_activation(self, tensor) -> None:
        if not self.spec_sent:
            self._send_spec(tensor)
        self._send(tensor, self.next)

    def receive_activation(self) -> Incoming:
        if self.first:
            return Incoming()
        if self.input_spec is None:
            self.input_spec = self._receive_spec()
        dtype, shape = self.input_spec
        return self._receive(torch.empty(shape, dtype=dtype), self.prev)

    def send_gradient(self, tensor) -> None:
        self._send(tensor, self.prev)

    def receive_gradient(self, like) -> Incoming:
        """The gradient of this rank's output `like`, from rank + 1 (the last rank: none)."""
        return Incoming() if self.last else self._receive(torch.empty_like(like), self.next)

    def finish(self) -> None:
        """Wait until every message this rank sent has gone."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()

    def _send(self, tensor, dst):
        tensor = tensor.detach().contiguous()
        self.sends.append((dist.isend(tensor, dst, group=self.group), tensor))

    def _receive(self, buffer, src) -> Incoming:
        return Incoming(buffer, dist.irecv(buffer, src, group=self.group))

    def _send_spec(self, tensor):
        spec = torch.zeros(8, dtype=torch.int64)
        spec[0], spec[1] = DTYPES.index(tensor.dtype), tensor.dim()
        spec[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.send(spec, self.next, group=self.group)
        self.spec_sent = True

    def _receive_spec(self):
        spec = torch.zeros(8, dtype=torch.int64)
        dist.recv(spec, self.prev, group=self.group)
        return DTYPES[spec[0]], tuple(spec[2:2 + spec[1]].tolist())
