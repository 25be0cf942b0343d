"""A model too big for one device, built without its memory: the meta device, then `to_empty` and
an initialisation that gives every layout the same weights.

- `init_weights(model, seed=0)`: torchtitan's Llama initialisation (pytorch/torchtitan@9dec370,
  torchtitan/models/llama/model.py, `init_weights` with depth_init): the token embedding N(0, 1),
  the projections into attention and the MLP (wq, wk, wv, w1) a normal of std 0.02 truncated at
  ±2, those out of them (wo, w2) and w3 std 0.02 / sqrt(2 (layer + 1)), the output head std
  dim^-1/2 truncated at ±3 std, the norms' weights ones. Each parameter is drawn whole, on the
  CPU, from a generator seeded by `seed` and the parameter's name, and each rank keeps its own
  piece of it (`distribute_tensor` with src_data_rank=None: no communication): the same weights
  under every layout, one parameter's memory at a time.
- `reset_parameters_worker(rank, world_size, shape)`: what goes wrong with the usual recipe on
  the CPU: each module's `reset_parameters()` on FSDP's pieces; returns this rank's piece of the
  output head and the head gathered whole.
"""

from __future__ import annotations

import math
import warnings
import zlib

import torch
from torch import nn


def _depth(name: str) -> int:
    """The block index in a parameter name "layers.7.attention.wo.weight"."""
    return int(name.split(".")[1])


def initial_value(name: str, shape: torch.Size, dim: int, seed: int = 0) -> torch.Tensor:
    """The whole initial value of the Llama parameter `name`, drawn from its own generator."""
    generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    value = torch.empty(shape)
    if name.endswith("norm.weight"):
        return value.fill_(1.0)
    if name == "tok_embeddings.weight":
        return nn.init.normal_(value, generator=generator)
    if name == "output.weight":
        std = dim ** -0.5
        return nn.init.trunc_normal_(value, std=std, a=-3 * std, b=3 * std, generator=generator)
    if name.endswith(("wo.weight", "w2.weight", "w3.weight")):
        std = 0.02 / math.sqrt(2 * (_depth(name) + 1))
        return nn.init.trunc_normal_(value, std=std, generator=generator)
    return nn.init.trunc_normal_(value, std=0.02, generator=generator)  # wq, wk, wv, w1


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every parameter of a Llama its initial value (whole, or this rank's piece of it, for a
    DTensor laid out on a mesh). Returns the model."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, parameter in model.named_parameters():
        value = initial_value(name, parameter.shape, model.shape.dim, seed)
        if isinstance(parameter, DTensor):
            value = distribute_tensor(value, parameter.device_mesh, parameter.placements,
                                      src_data_rank=None)
        parameter.copy_(value)
    return model


def reset_parameters_worker(rank, world_size, shape):
    from torch.distributed.device_mesh import init_device_mesh

    from helpers import layouts
    from helpers.launcher.result import get_device
    from helpers.llama import Llama

    with torch.device("meta"):
        model = Llama(shape)
    layouts.apply_fsdp(model, init_device_mesh(get_device().type, (world_size,)))
    model.to_empty(device=get_device())
    torch.manual_seed(0)  # every rank the same seed, as a training script sets it
    with warnings.catch_warnings():  # the warning, once, is in the lesson's text
        warnings.filterwarnings("ignore", "DTensor random operators")
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()  # nn.Linear's own initialisation, on this piece
    head = model.output.weight
    return head.to_local().detach().cpu(), head.full_tensor().detach().cpu()
