"""Reference solutions to lesson 13's exercises (helpers.at_scale.exercises)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from helpers.at_scale import fits, step_time


@functools.cache
def _extrapolated(shape, plan):
    """(peak, {collective: bytes sent}) of `plan` for the whole model, from fake steps of 1 and 2
    blocks: a step's peak and its bytes grow by the same amount with every block (its weights,
    what it keeps for backward, its collectives), as long as the peak stays at the same moment of
    the step."""
    one, two = (fits.fake_step(dataclasses.replace(shape, layers=layers), plan)
                for layers in (1, 2))

    def grown(at_one, at_two):
        return at_one + (at_two - at_one) * (shape.layers - 1)

    return (grown(one["peak"]["Total"], two["peak"]["Total"]),
            {name: grown(one["sent"][name], two["sent"][name]) for name in two["sent"]})


def choose_plan(shape, gpus, memory, sequences, seq_len):
    """The layouts of the question in the order of the most tokens per second they could reach
    (their compute alone, no run needed); each sized from two small fake steps (seconds, where
    a step of the whole model takes many) until the next could not beat the fastest held one.
    That one is run whole to confirm it (a peak may move to another moment of a deeper model's
    step, never below the small steps' line)."""
    efficiency = fits.efficiency()

    def bound(plan):  # no communication at all: no layout runs faster
        return step_time.estimate(shape, plan, {}, efficiency).tokens_per_second

    layouts = sorted(fits.candidates(gpus, sequences, seq_len), key=bound, reverse=True)
    while True:
        best = None
        for plan in layouts:
            if best is not None and bound(plan) <= best.step.tokens_per_second:
                break
            guess = fits.verdict(shape, plan, *_extrapolated(shape, plan), memory)
            if fits.reserved(guess.peak) <= memory and (
                    best is None or guess.step.tokens_per_second > best.step.tokens_per_second):
                best = guess
        if best is None:
            raise ValueError(f"no layout of the question can be held in {memory / 2**30:.0f} GiB")
        if fits.reserved(fits.fits(shape, best.plan, memory).peak) <= memory:
            return best.plan
        layouts.remove(best.plan)  # the whole model peaks higher: the next fastest, then


def meta_built(rank, world_size, shape):
    from helpers import layouts
    from helpers.launcher.result import get_device
    from helpers.llama import Llama, init_weights

    with torch.device("meta"):
        model = Llama(shape)  # shapes only
    layouts.apply_fsdp(model, layouts.make_mesh(layouts.Plan(dp=world_size)))
    model.to_empty(device=get_device())  # memory for this rank's pieces only
    return init_weights(model)  # each piece cut from its parameter's one-process value
