"""Lesson 14's baselines: every layout that `profiled.layout_step` times trains the capstone's
recipe (one step of it equals one process's in float64), and what the ranks compute in under
FSDP2's mixed precision against autocast."""

import dataclasses

import pytest
import torch

from helpers.capstone import profiled
from helpers.capstone.corpus import python_source
from helpers.capstone.train import Config, one_process, whole_weights
from helpers.launcher import run

# 2 blocks of width 64, 8 sequences of 32 bytes, in float64: one process's step is the reference
TINY = Config(layers=2, dim=64, heads=4, kv_heads=2, seq_len=32, batch=8, micro_batches=2,
              steps=4, warmup=1, lr=1e-2, bf16=False, float64=True, eval_every=0,
              eval_sequences=8, save_every=0, recompute="op")


def one_step_worker(rank, world_size, config, layout):
    """One timed step of `layout`, as step_seconds_worker runs it; then the whole weights."""
    batch = python_source().batch("train", 0, config.batch, config.seq_len, seed=config.seed)
    step = profiled.layout_step(config, layout, world_size, batch)
    step()
    model = step.args[0]
    if layout == "ddp":
        return {name: value.detach().clone() for name, value in model.module.state_dict().items()}
    if layout == "one_process":
        return {name: value.detach().clone() for name, value in model.state_dict().items()}
    return whole_weights(model)


@pytest.mark.numerical
@pytest.mark.parametrize(("layout", "ranks"), [("one_process", 1), ("ddp", 2), ("fsdp2", 2),
                                               ("fsdp2_tp", 4)])
def test_each_baseline_trains_the_recipe_one_process_trains(layout, ranks):
    got = run(one_step_worker, ranks, args=(TINY, layout), show_output=False, timeout=120)[0]
    # float64 over one AdamW step: rounding ~1e-16 of each sum, far below assert_close's 1e-7
    torch.testing.assert_close(got, one_process(TINY, steps=1).weights)


def test_a_layout_that_cannot_run_says_so():
    batch = python_source().batch("train", 0, TINY.batch, TINY.seq_len)
    with pytest.raises(ValueError, match="'one_process' on 1 rank only"):
        profiled.layout_step(TINY, "one_process", 2, batch)
    with pytest.raises(ValueError, match="the layouts are"):
        profiled.layout_step(TINY, "ZeRO-5", 1, batch)


def test_step_seconds_times_every_layout_asked():
    found = run(profiled.step_seconds_worker, 2, args=(TINY, ("ddp", "fsdp2")),
                kwargs={"rounds": 1}, show_output=False, timeout=120)
    assert found[0] == found[1]  # the slowest rank's seconds, the same on every rank
    assert sorted(found[0]) == ["ddp", "fsdp2"] and all(s > 0 for s in found[0].values())


def test_fsdp2_mixed_precision_casts_what_autocast_keeps_in_float32():
    config = dataclasses.replace(TINY, float64=False, bf16=True, dp=2, tp=1)
    ranks = run(profiled.precision_worker, 2, args=(config,), show_output=False, timeout=120)
    assert set(ranks[0].values()) == {"bfloat16"} and len(ranks[0]) == 3
    assert profiled.precision_one_process(config) == {
        "the residual stream (a block's output)": "float32", "a norm's output": "float32",
        "the norm's weight, as used": "float32"}


def test_communication_by_owner_adds_up_every_ranks_seconds():
    def rank(scale):
        parts = {"communication": 2.0 * scale, "overlap": 0.5 * scale, "exposed": 1.5 * scale,
                 "waiting": 1.0 * scale}
        return {"breakdown": {"owners": {"FSDP2": parts, "DTensor": parts, "exposed_where": {
            "FSDP2": scale, "DTensor": 2 * scale, "elsewhere": 0.0}}}}

    summed = profiled.communication_by_owner([rank(1), rank(3)])
    assert summed["DTensor"] == {"communication": 8.0, "overlap": 2.0, "exposed": 6.0,
                                 "waiting": 4.0}
    assert summed["exposed_where"] == {"FSDP2": 4, "DTensor": 8, "elsewhere": 0.0}


def test_the_matmul_rate_is_measured_in_windows_on_every_rank():
    rates = run(profiled.matmul_rate_worker, 2, kwargs={"size": 64, "seconds": 0.02,
                                                        "windows": 3}, show_output=False)
    assert [len(found) for found in rates] == [3, 3] and min(map(min, rates)) > 0


def test_the_scaling_figure_draws_tokens_per_second_and_efficiency_from_the_seconds():
    from helpers.capstone import plots

    seconds = {1: {"one_process": 2.0}, 2: {"ddp": 1.25, "fsdp2": 2.0}, 4: {"ddp": 1.0}}
    figure = plots.plot_scaling(seconds, tokens_per_step=1000,
                                labels={"ddp": "DDP", "fsdp2": "FSDP2"})
    rate, efficiency = figure.axes
    lines = {line.get_label(): line for line in rate.get_lines()}
    assert list(lines["DDP"].get_xdata()) == [1, 2, 4]
    assert list(lines["DDP"].get_ydata()) == [500, 800, 1000]  # 1000 tokens / seconds
    assert list(lines["perfect scaling"].get_ydata()) == [500, 1000, 2000]
    ddp = next(line for line in efficiency.get_lines() if line.get_label() == "DDP")
    assert list(ddp.get_ydata()) == [1.0, 0.8, 0.5]  # tokens/s / (ranks x 500)
    fsdp2 = next(line for line in efficiency.get_lines() if line.get_label() == "FSDP2")
    assert list(fsdp2.get_xdata()) == [1, 2] and list(fsdp2.get_ydata()) == [1.0, 0.5]
