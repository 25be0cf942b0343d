"""The course's MLP cut into pipeline stages (lesson 09)."""

from __future__ import annotations

import copy

import torch.nn.functional as F
from torch import nn


class LinearGelu(nn.Module):
    """One layer of the lecture's MLP stack: a Linear, then GeLU."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return F.gelu(self.linear(x))


def mlp_stage(model, stage: int, num_stages: int) -> nn.Sequential:
    """Stage `stage` of `num_stages` of a reference MLP (a copy): its share of consecutive layers,
    as an nn.Sequential of LinearGelu. The layers must divide evenly."""
    layers = list(model.layers)
    if len(layers) % num_stages:
        raise ValueError(f"{len(layers)} layers do not split into {num_stages} equal stages")
    size = len(layers) // num_stages
    return nn.Sequential(*(LinearGelu(copy.deepcopy(layer))
                           for layer in layers[stage * size:(stage + 1) * size]))


def stage_layer_names(stage: int, num_stages: int, num_layers: int) -> dict:
    """{name in the stage: name in the whole MLP}, e.g. {'0.linear.weight': 'layers.2.weight'}."""
    size = num_layers // num_stages
    return {f"{index}.linear.{kind}": f"layers.{stage * size + index}.{kind}"
            for index in range(size) for kind in ("weight", "bias")}
