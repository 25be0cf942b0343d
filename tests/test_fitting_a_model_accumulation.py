"""Lesson 11 (helpers.fitting_a_model.accumulation): gradient accumulation under every strategy
(DDP with no_sync, ZeRO-1, ZeRO-2, ZeRO-3, FSDP2 syncing on the last micro-batch) trains like
one process on the whole batch; the bytes each rank sends in a step and the gradients it holds
equal their formulas to the byte; the formulas compare as the lesson says."""

import functools

import pytest
import torch
from compare import labelled

from helpers import reference, run, strategies
from helpers.fitting_a_model import accumulation

# Lesson 07's MLP without biases: 4 Linears of 16 x 16, Psi = 1024, every weight divisible by
# 2 and 4 (no padding). 16 rows a batch: 4 ranks x 4 micro-batches of one row.
DIM, LAYERS, BATCH = 16, 4, 16
PSI = LAYERS * DIM * DIM
MICRO_BATCHES = (1, 2, 4)


def model_and_batches(float64):
    model = reference.make_mlp(dim=DIM, num_layers=LAYERS, seed=0)
    batches = reference.mlp_data(seed=1, batch_size=BATCH, dim=DIM, steps=2)
    return reference.in_float64(model, batches) if float64 else (model, batches)


def cases_worker(rank, world_size, cases, model, batches):
    """strategies.accumulation_worker for each (key, micro_batches) in turn: one launch, many
    cases."""
    return [strategies.accumulation_worker(rank, world_size, model=model, batches=batches,
                                           micro_batches=m, **accumulation.STRATEGIES[key])
            for key, m in cases]


@functools.cache
def results(strategy, float64, world_size=2, micro_batches=MICRO_BATCHES):
    """{m: every rank's result}, from one launch per strategy (cached: the tests share them)."""
    cases = [(strategy, m) for m in micro_batches]
    out = run(cases_worker, world_size, args=(cases, *model_and_batches(float64)),
              show_output=False)
    return {m: [out[rank][index] for rank in range(world_size)]
            for index, m in enumerate(micro_batches)}


# float64: runs once (Makefile)
@pytest.mark.parametrize("world_size, micro_batches", [(2, MICRO_BATCHES), (4, (2,))],
                         ids=["n=2, m=1,2,4", "n=4, m=2"])
@pytest.mark.parametrize("strategy", list(accumulation.STRATEGIES))
def test_every_strategy_accumulates_to_one_process_on_the_whole_batch(strategy, world_size,
                                                                      micro_batches):
    """float64, where AdamW cannot amplify rounding into a visible difference
    (helpers.tolerance): assert_close's float64 default."""
    model, batches = model_and_batches(float64=True)
    single = reference.train(model, batches, reference.mse_loss, optimizer="adamw", lr=1e-2)
    for m, ranks in results(strategy, True, world_size, micro_batches).items():
        for result in ranks:
            parameters = result["parameters"]
            assert list(parameters) == list(single.parameters)
            for name, param in single.parameters.items():
                torch.testing.assert_close(parameters[name], param,
                                           msg=labelled(f"m={m} {name}"))


@pytest.mark.parametrize("strategy", list(accumulation.STRATEGIES))
def test_bytes_sent_and_gradients_held_equal_the_formulas(strategy):
    for m, ranks in results(strategy, False).items():
        for result in ranks:
            formula = accumulation.sent_formula(strategy, PSI, 2, m)
            assert result["sent"] == pytest.approx(formula), f"m={m}"
            assert result["gradient bytes"] == \
                accumulation.gradient_bytes_formula(strategy, PSI, 2, m), f"m={m}"


@pytest.mark.parametrize("micro_batches", MICRO_BATCHES)
def test_zero_3_and_fully_shard_gather_every_layer_twice_per_micro_batch(micro_batches):
    """fully_shard reshards every Linear after its forward (the root holds no parameter), as
    the hand-built FSDP does; with sync on the last micro-batch only, it reduce-scatters once."""
    m = micro_batches
    hand = results("zero_3", False)[m][0]["calls"]
    torch_ = results("fsdp2_sync_on_last", False)[m][0]["calls"]
    assert hand == {"all_gather_single": 2 * m * LAYERS, "reduce_scatter_single": m * LAYERS}
    assert torch_ == {"all_gather_single": 2 * m * LAYERS, "reduce_scatter_single": LAYERS}


def total(strategy, m, psi=7.5e9, n=64):
    return sum(accumulation.sent_formula(strategy, psi, n, m).values())


def test_the_formulas_compare_as_the_lesson_says():
    psi, n = 7.5e9, 64
    dp = total("ddp_no_sync", 1)
    assert dp == pytest.approx(2 * (n - 1) / n * 4 * psi)
    assert total("zero_3", 1) == pytest.approx(1.5 * dp)  # the ZeRO paper's 1.5x
    assert total("fsdp2_sync_on_last", 1) == pytest.approx(total("zero_3", 1))
    for m in (2, 4, 8):
        # deferring the reduction costs nothing more per step; ZeRO-1 sends what DDP does
        assert total("ddp_no_sync", m) == total("zero_1", m) == pytest.approx(dp)
        # one more reduce-scatter of the gradients (half DP's bytes) per micro-batch
        assert total("zero_2", m) == pytest.approx(dp + (m - 1) * dp / 2)
        assert total("zero_3", m) == pytest.approx(m * 1.5 * dp)
        # FSDP2 without sync saves ZeRO-3's m - 1 reduce-scatters, not its gathers
        assert total("zero_3", m) - total("fsdp2_sync_on_last", m) == \
            pytest.approx((m - 1) * dp / 2)
    whole, pieces = 4 * PSI, 4 * PSI // n
    held = {strategy: accumulation.gradient_bytes_formula(strategy, PSI, n, 4)
            for strategy in accumulation.STRATEGIES}
    assert held == {"ddp_no_sync": whole, "zero_1": whole, "zero_2": pieces, "zero_3": pieces,
                    "fsdp2_sync_on_last": whole}
    assert accumulation.gradient_bytes_formula("fsdp2_sync_on_last", PSI, n, 1) == pieces
    assert all(total(strategy, 4, n=1) == 0 for strategy in accumulation.STRATEGIES)
    with pytest.raises(ValueError, match="strategy"):
        accumulation.sent_formula("ZeRO-4", PSI, n, 1)


def test_the_picture_draws():
    import matplotlib

    matplotlib.use("Agg")
    from helpers.fitting_a_model import plots

    sent = {strategy: {1: 10.0, 2: 20.0} for strategy in accumulation.STRATEGIES}
    held = {strategy: 4096 for strategy in accumulation.STRATEGIES}
    fig = plots.plot_accumulation(sent, sent, held, parameter_bytes=8192)
    assert len(fig.axes[0].lines) == 2 * len(accumulation.STRATEGIES)  # formula and measured
    assert [patch.get_width() for patch in fig.axes[1].patches] == [0.5] * len(held)
