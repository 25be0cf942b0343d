"""Reference solutions to lesson 13's exercises (helpers.at_scale.exercises)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from helpers.at_scale import fits


@functools.cache
def _extrapolated(shape, plan):
    """(peak, {collective: bytes sent}) of `plan` for the whole model, from fake steps of 2 and 3
    blocks: a step's peak and its bytes grow by the same amount with every block (its weights,
    what it keeps for backward, its collectives), as long as the peak stays at the same moment of
    the step."""
    two, three = (fits.fake_step(dataclasses.replace(shape, layers=layers), plan)
                  for layers in (2, 3))

    def grown(at_two, at_three):
        return at_two + (at_three - at_two) * (shape.layers - 2)

    return (grown(two["peak"]["Total"], three["peak"]["Total"]),
            {name: grown(two["sent"][name], three["sent"][name]) for name in three["sent"]})


def choose_plan(shape, gpus, memory, sequences, seq_len):
    """Every layout of the question, fastest first by the step-time estimate, each sized from two
    small fake steps (seconds, where a step of the whole model takes many); the first that a GPU
    holds by its small steps is run whole to confirm it (a peak may move to another moment of a
    deeper model's step, never below the small steps' line), and the first confirmed is the
    answer."""
    ratio = fits.reserved_ratio()
    guesses = sorted((fits.verdict(shape, plan, *_extrapolated(shape, plan), memory)
                      for plan in fits.candidates(gpus, sequences, seq_len)),
                     key=lambda verdict: verdict.step.tokens_per_second, reverse=True)
    for guess in guesses:
        if guess.peak * ratio <= memory and \
                fits.fits(shape, guess.plan, memory).peak * ratio <= memory:
            return guess.plan
    raise ValueError(f"no layout of the question can be held in {memory / 2**30:.0f} GiB")


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
