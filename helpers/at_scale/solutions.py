"""Reference solutions to lesson 13's exercises (helpers.at_scale.exercises)."""

from __future__ import annotations

import dataclasses

import torch

from helpers.at_scale.accounting import RECOMPUTE, Plan
from helpers.at_scale.fits import fits

SPARE = 0.10


def choose_plan(shape, gpus, memory, sequences, seq_len):
    """Every layout of the question, cheapest on the wire first; the first whose fake peak leaves
    10% free. The bytes a step sends grow by the same amount with every block (each block's
    all-gathers, reduce-scatters and tensor-parallel collectives), so two fake steps of 1 and 2
    blocks give them exactly for any depth, in seconds; only the peak needs the whole model."""
    layouts = []
    tp = 1
    while tp <= min(8, gpus):
        if gpus % tp == 0 and sequences % (gpus // tp) == 0:
            layouts += [Plan(dp=gpus // tp, tp=tp, recompute=recompute,
                             micro_batch=sequences // (gpus // tp), seq_len=seq_len, bf16=True)
                        for recompute in RECOMPUTE]
        tp *= 2

    def sent(plan):
        one, two = (fits(dataclasses.replace(shape, layers=layers), plan, memory).sent
                    for layers in (1, 2))
        return one + (two - one) * (shape.layers - 1)

    for plan in sorted(layouts, key=sent):
        if fits(shape, plan, memory).spare >= SPARE:
            return plan
    raise ValueError("no layout leaves 10% free")


def meta_built(rank, world_size, shape):
    from torch.distributed.device_mesh import init_device_mesh

    from helpers import layouts
    from helpers.at_scale.meta_init import init_weights
    from helpers.launcher.result import get_device
    from helpers.llama import Llama

    with torch.device("meta"):
        model = Llama(shape)  # shapes only
    layouts.apply_fsdp(model, init_device_mesh(get_device().type, (world_size,)))
    model.to_empty(device=get_device())  # memory for this rank's pieces only
    return init_weights(model)  # each piece cut from its parameter's one-process value
