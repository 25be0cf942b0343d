"""Watching a rank's communication and memory from inside it, without changing the code watched.

    CommCounter()              while active, counts the calls of all_reduce, all_gather_single
                               and reduce_scatter_single, the bytes each sends on a ring and
                               the seconds spent inside them; restores torch.distributed on exit,
                               a raise included
    saved_activations(module)  while active, records the tensors autograd saves for backward
    saved_bytes(saved)         their bytes, each storage once

Both are rank-side: they import neither matplotlib nor ipywidgets.
"""

from __future__ import annotations

import contextlib
import inspect
import time

import torch
import torch.distributed as dist
from torch import nn

from helpers.cost_model import bus_bytes


class CommCounter:
    """While active, counts the bytes this rank sends in all_reduce, all_gather_single and
    reduce_scatter_single (called as torch.distributed.<name>), by collective:
    `counter.sent["all_reduce"]`. Bytes are the ring's (cost_model.bus_bytes), on the whole
    array S: for all_gather the gathered output, for reduce_scatter the input."""

    # The argument that holds the whole array S.
    ARRAY = {"all_reduce": "tensor", "all_gather_single": "output_tensor",
             "reduce_scatter_single": "input"}

    def __init__(self):
        self.sent = dict.fromkeys(self.ARRAY, 0.0)
        self.calls = dict.fromkeys(self.ARRAY, 0)
        # seconds inside the calls: the whole collective for gloo's synchronous calls, only the
        # launch for one called with async_op=True
        self.seconds = dict.fromkeys(self.ARRAY, 0.0)
        self._saved = {}

    @property
    def total(self) -> float:
        return sum(self.sent.values())

    def __enter__(self):
        for name in self.ARRAY:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._counting(name, self._saved[name]))
        return self

    def __exit__(self, *exc_info):
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def _counting(self, name, original):
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            array = arguments[self.ARRAY[name]]
            world_size = dist.get_world_size(arguments.get("group"))
            size = array.numel() * array.element_size()
            self.sent[name] += bus_bytes(name, world_size, size)
            self.calls[name] += 1
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        return counted


@contextlib.contextmanager
def saved_activations(module: nn.Module):
    """While active, records every tensor autograd saves for backward, except `module`'s
    parameters (the weights a layer keeps are not activations): yields a list of
    (storage pointer, bytes); count each storage once (`saved_bytes`)."""
    parameters = {param.untyped_storage().data_ptr() for param in module.parameters()}
    saved = []

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved.append((storage.data_ptr(), storage.nbytes()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


def saved_bytes(saved: list) -> int:
    """The bytes of the distinct storages in a `saved_activations` record."""
    return sum(dict(saved).values())
