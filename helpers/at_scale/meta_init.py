"""A model too big for one device, built without its memory: the meta device, then `to_empty` and
an initialisation that gives every layout the same weights.

The initialisation that does it is the model's own, `helpers.llama.init_weights` (torchtitan's
is a method of its model): each parameter drawn whole from a generator of its own, each rank
keeping its piece, so that every layout gets the same weights, one parameter's memory at a time.

- `reset_parameters_worker(rank, world_size, shape)`: what goes wrong with the usual recipe on
  the CPU: each module's `reset_parameters()` on FSDP's pieces; returns this rank's piece of the
  output head and the head gathered whole.
"""

from __future__ import annotations

import warnings

import torch


def reset_parameters_worker(rank, world_size, shape):
    from helpers import layouts
    from helpers.launcher.result import get_device
    from helpers.llama import Llama

    with torch.device("meta"):
        model = Llama(shape)
    layouts.apply_fsdp(model, layouts.make_mesh(layouts.Plan(dp=world_size)))
    model.to_empty(device=get_device())
    torch.manual_seed(0)  # every rank the same seed, as a training script sets it
    with warnings.catch_warnings():  # the warning, once, is in the lesson's text
        warnings.filterwarnings("ignore", "DTensor random operators")
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()  # nn.Linear's own initialisation, on this piece
    head = model.output.weight
    return head.to_local().detach().cpu(), head.full_tensor().detach().cpu()
