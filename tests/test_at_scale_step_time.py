"""Lesson 13's second half of sizing a run: FLOPs counted as torchtitan and PyTorch count them, the
step-time model's arithmetic, its calibration on a published run, and the margin the published
memory sets."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import layouts
from helpers.at_scale import fits, step_time
from helpers.composing.strategy import MODELS
from helpers.layouts import Plan
from helpers.llama import Llama, Shape, flops_per_token
from helpers.published import TORCHTITAN_MFU, TORCHTITAN_RUNS

GiB = 2**30


def test_flops_per_token_is_torchtitans_count_of_llama_3_8b():
    """6 x the published parameters less the token embedding (128,256 x 4,096), and 12 l h q t."""
    parameters = 8_030_261_248 - 128_256 * 4_096
    assert flops_per_token(MODELS["Llama 3 8B"], 8192) == \
        6 * parameters + 12 * 32 * 32 * 128 * 8192


def test_the_8b_runs_without_float8_have_the_mfu_torchtitan_states():
    """The benchmark: "the 1D Llama 3.1 8B model training on 8 or 128 H100 GPUs without Float8
    achieves 33% to 39% MFU", against the SXM's 989 TFLOP/s: Tables 1 and 3, each eager and
    compiled."""
    rows = [run for run in TORCHTITAN_RUNS if run.model == "Llama 3 8B" and "Float8" not in
            run.techniques]
    mfus = [flops_per_token(MODELS[run.model], 8192) * run.tokens_per_second / 989e12
            for run in rows]
    assert len(rows) == 4
    assert (round(min(mfus), 2), round(max(mfus), 2)) == TORCHTITAN_MFU


@pytest.mark.parametrize("mode", ["op", "full"])
def test_recomputation_adds_the_products_it_runs_again(mode):
    """FlopCounterMode counts the matrix products of a forward and backward with and without
    recomputation; it counts none for the CPU's attention kernel, so the model's attention term
    (4 d seq_len a token and layer, under full recomputation) is left out of the comparison."""
    shape = Shape(layers=2, dim=64, heads=4, kv_heads=2, ffn=192, vocab=256)
    tokens = torch.randint(0, shape.vocab, (2, 33), generator=torch.Generator().manual_seed(0))

    def counted(recompute):
        model = layouts.apply_ac(Llama(shape), recompute)
        with FlopCounterMode(display=False) as counter:
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) \
                .backward()
        return counter.get_total_flops()

    attention = 4 * shape.dim * 32 * shape.layers if mode == "full" else 0
    per_token = step_time.recomputed_flops_per_token(shape, 32, mode) - attention
    assert counted(mode) - counted("none") == per_token * 2 * 32


TOY = step_time.Hardware("toy", peak=1e12, inside=1e10, between=1e9, gpus_per_host=4)
SHAPE = Shape(layers=2, dim=64, heads=4, kv_heads=2, ffn=192, vocab=256)


def test_fsdp_is_hidden_under_compute_and_tensor_parallelism_is_not():
    plan = Plan(dp=2, tp=2, micro_batch=2, seq_len=64, recompute="op")
    flops = (flops_per_token(SHAPE, 64) + step_time.recomputed_flops_per_token(SHAPE, 64, "op")) \
        * 2 * 64 / 2
    sent = {"all_gather_single": 1e5, "reduce_scatter_single": 2e5, "DTensor all_reduce": 5e4}
    time = step_time.estimate(SHAPE, plan, sent, efficiency=0.5, hardware=TOY)
    assert time.compute == pytest.approx(flops / 0.5e12, rel=1e-12)
    assert time.fsdp == pytest.approx(3e5 / 1e10, rel=1e-12)  # 4 GPUs: one host
    assert time.tp == pytest.approx(5e4 / 1e10, rel=1e-12)
    assert time.compute > time.fsdp
    assert time.seconds == pytest.approx(time.compute + time.tp, rel=1e-12)
    assert time.tokens_per_second == pytest.approx(64 / time.seconds, rel=1e-12)


def test_fsdp_longer_than_compute_sets_the_step_and_crosses_hosts_on_their_link():
    plan = Plan(dp=8, micro_batch=1, seq_len=64)  # 8 GPUs: two hosts of 4
    sent = {"all_gather_single": 4e9, "reduce_scatter_single": 4e9}
    time = step_time.estimate(SHAPE, plan, sent, efficiency=0.5, hardware=TOY)
    assert time.fsdp == pytest.approx(8e9 / 1e9, rel=1e-12)
    assert time.seconds == pytest.approx(time.fsdp, rel=1e-12)


def test_calibration_gives_back_the_throughput_it_was_given():
    plan = Plan(dp=2, tp=2, micro_batch=2, seq_len=64, recompute="full")
    sent = {"all_gather_single": 1e3, "DTensor all_gather_into_tensor": 1e5}
    efficiency = step_time.calibrate(SHAPE, plan, sent, 1e4, hardware=TOY)
    time = step_time.estimate(SHAPE, plan, sent, efficiency, hardware=TOY)
    assert time.tokens_per_second == pytest.approx(1e4, rel=1e-12)
    with pytest.raises(ValueError, match="no more than its communication"):
        step_time.calibrate(SHAPE, plan, {"all_gather_single": 1e12}, 1e4, hardware=TOY)


def test_the_margin_is_the_most_a_published_run_reserved_per_byte_of_its_fake_peak():
    """Tables 1 and 3 (8B, FSDP 8 and 128, each with and without compile and Float8) and Table
    4 (70B, FSDP 32 x TP 8, 16 sequences a data-parallel rank, full recomputation)."""
    with open(fits.AT_SIZE_RUNS) as file:
        runs = json.load(file)["runs"]
    peaks = {(row["model"], row["plan"]["dp"], row["plan"]["tp"]): row["found"]["peak"]["Total"]
             for row in runs}
    reserved = [(("Llama 3 8B", 8, 1), gib) for gib in (82.4, 77.0, 76.8)] + \
        [(("Llama 3 8B", 128, 1), gib) for gib in (67.0, 62.0, 61.8)] + \
        [(("Llama 3 70B", 32, 8), 71.9)]
    assert fits.reserved_ratio() == max(gib * GiB / peaks[run] for run, gib in reserved)


def estimated(run):
    plan = fits.published_plan(run)
    return step_time.estimate(MODELS[run.model], plan, fits.recorded(run.model, plan)["sent"],
                              fits.efficiency())


def test_the_calibrated_model_hides_fsdp_under_compute_in_tables_1_and_3():
    """Calibrated on Table 1, it gives Table 3 within the 3 % the lesson prints; there FSDP
    crosses hosts and still hides, so the model predicts no loss against Table 1."""
    table_1, table_3 = (next(run for run in TORCHTITAN_RUNS if run.where == f"Table {n}, row FSDP")
                        for n in (1, 3))
    for run in (table_1, table_3):
        time = estimated(run)
        assert time.fsdp < time.compute and time.tp == 0
    assert 0 < estimated(table_3).tokens_per_second / table_3.tokens_per_second - 1 < 0.03


def test_table_4_is_within_a_tenth_once_scaled_by_what_compile_and_float8_gave_the_8b():
    """As the lesson prints: -36 % as it stands, -5 % scaled by Table 1's 8,532 / 5,762."""
    table_4 = next(run for run in TORCHTITAN_RUNS if run.model == "Llama 3 70B")
    error = estimated(table_4).tokens_per_second / table_4.tokens_per_second - 1
    assert -0.40 < error < -0.30
    assert abs((1 + error) * 8532 / 5762 - 1) < 0.10
