"""Lesson 11, FSDP2's knobs (helpers.fitting_a_model.fsdp2_knobs): reshard_after_forward's
gathered bytes and all-gathers equal their formulas for True, False and an int; explicit
prefetching issues each all-gather a block early; HSDP trains like one process and sends, on each
mesh dimension, the bytes of its formula."""

import pytest
import torch
from compare import labelled

from helpers import reference, run
from helpers.fitting_a_model import fsdp2_knobs

BLOCKS = 4


def model_and_batch():
    return (reference.make_lm(seed=0, layers=BLOCKS),
            reference.lm_data(seed=1, batch_size=8)[0])


def weight_bytes(model):
    block = 4 * sum(param.numel() for param in model.blocks[0].parameters())
    return block, 4 * sum(param.numel() for param in model.parameters()) - BLOCKS * block


@pytest.mark.parametrize("setting", [True, False, 2])
def test_reshard_after_forward_holds_and_gathers_what_the_formula_says(setting):
    model, batch = model_and_batch()
    block, root = weight_bytes(model)
    out = run(fsdp2_knobs.reshard_worker, 4, show_output=False, kwargs=dict(
        model=model, batch=batch, reshard_after_forward=setting))
    expected = fsdp2_knobs.reshard_formula(block, root, BLOCKS, 4, setting)
    # counted independently: a block is B bytes, gathered whole or held in 1/k pieces; in
    # backward FSDP2 prefetches the next block's whole weights beside this one's (but with False,
    # which gathers nothing in backward). The expert review of 2026-11-27 measured the same
    # peaks (E1: 120,064, 221,440 and 196,096 bytes)
    by_hand = {True: root + 2 * block, False: root + 4 * block,
               2: root + 2 * block + 3 * block // 2}
    assert expected["peak"] == by_hand[setting]
    for result in out:
        assert result["peak"] == expected["peak"]
        assert result["all-gathers"] == expected["all-gathers"]
        # each gather over k ranks sends (k-1)/k of what it gathers: all of the weights per pass
        passes = {size: count // (BLOCKS + 1) for size, count in result["all-gathers"].items()}
        assert result["sent"] == {size: pytest.approx(passes[size] * (size - 1) / size
                                                      * (root + BLOCKS * block))
                                  for size in passes}


@pytest.mark.parametrize("prefetch", [1, 2])
def test_explicit_prefetch_issues_each_all_gather_blocks_early(prefetch):
    model, batch = model_and_batch()
    default, ahead = (run(fsdp2_knobs.prefetch_worker, 2, show_output=False, kwargs=dict(
        model=model, batch=batch, prefetch=depth))[0] for depth in (0, prefetch))
    # by default, before block i's forward: the root's all-gather and blocks 0..i's
    assert default["ahead"] == [index + 2 for index in range(BLOCKS)]
    assert ahead["ahead"] == [min(index + 2 + prefetch, BLOCKS + 1) for index in range(BLOCKS)]
    for result in (default, ahead):
        labels = [label for label, _, _ in result["events"]]
        assert labels.count("forward") == labels.count("backward") == BLOCKS
        assert all(start <= end for _, start, end in result["events"])


# float64: runs once (Makefile)
def test_hsdp_trains_like_one_process_and_sends_its_formulas_bytes():
    model, batches = reference.in_float64(reference.make_lm(seed=0, layers=2),
                                          reference.lm_data(seed=1, batch_size=8, steps=2))
    out = run(fsdp2_knobs.hsdp_worker, 4, args=(model, batches), show_output=False)
    alone = reference.train(model, batches, reference.lm_loss)
    element = 8  # float64
    block = element * sum(param.numel() for param in model.blocks[0].parameters())
    whole = element * sum(param.numel() for param in model.parameters())
    expected = fsdp2_knobs.hsdp_formula(whole, block, 2)
    for result in out:
        for name, param in alone.parameters.items():
            torch.testing.assert_close(result["parameters"][name], param, msg=labelled(name))
        assert result["sent"] == pytest.approx(expected)
        # two ranks a group: half of what is gathered or reduce-scattered, and the 1/2 piece of
        # the gradients all-reduced between the two replicas (2 (2-1)/2 of it)
        assert result["sent"]["all_reduce", "replicate"] == pytest.approx(whole / 2)
        assert result["calls"]["reduce_scatter_single", "shard"] == 3  # 2 blocks and the root
