"""Lesson 11 (helpers.fitting_a_model): what a block keeps for backward with each kind of
recomputation equals its formula to the byte, on several shapes and both attention kernels, and
the paper's accounting to within the LayerNorms' statistics; recomputation leaves gradients
unchanged and adds the FLOPs of its formula; the exercise's checker rejects typical mistakes."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from checker import expect_acceptance, expect_rejection
from compare import labelled

from helpers import layouts, reference, run
from helpers.fitting_a_model import checkpointing, plots

# Byte and FLOP counts are exact integers, the same on any CPU; the gradients are the results
# that are numbers, which `make test` runs again on other CPU kernels (Makefile).

SHAPES = [(16, 2, 32, 4), (24, 3, 48, 6), (40, 1, 16, 2)]  # (s, b, h, a)


@pytest.mark.parametrize("s, b, h, a", SHAPES)
@pytest.mark.parametrize("kernel", list(checkpointing.KERNELS))
def test_the_bytes_a_block_keeps_equal_the_formula(s, b, h, a, kernel):
    block = reference.make_block(dim=h, heads=a, seed=0)
    x = reference.seeded_randn(1, b, s, h).requires_grad_()
    for mode in checkpointing.MODES:
        assert checkpointing.kept_bytes(block, x, mode, kernel) == \
            checkpointing.kept_formula(s, b, h, a, mode, kernel), mode


@pytest.mark.parametrize("s, b, h, a", SHAPES)
def test_the_papers_accounting_without_dropout_misses_only_the_layernorm_statistics(s, b, h, a):
    """Table 2 of Korthikanti et al. for a layer without dropout, in float32, against the math
    kernel (which keeps the probabilities, as the paper assumes): 2 LayerNorms x (mean, 1/std)
    per token, 4 bytes each; none for full recomputation."""
    block = reference.make_block(dim=h, heads=a, seed=0)
    x = reference.seeded_randn(1, b, s, h).requires_grad_()
    for mode, statistics in (("none", 16 * b * s), ("selective", 16 * b * s), ("full", 0)):
        kept = checkpointing.kept_bytes(block, x, mode, "math")
        assert kept - checkpointing.paper_bytes_as_the_block(s, b, h, a, mode) == statistics
    # and the table's own 16-bit rows, dropout included
    assert checkpointing.paper_bytes(s, b, h, a, "full") == 2 * s * b * h
    assert checkpointing.paper_bytes(s, b, h, a, "none") == \
        checkpointing.paper_bytes(s, b, h, a, "selective") + 5 * a * s * s * b


@pytest.mark.numerical
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_leaves_every_gradient_identical(mode):
    batch = reference.lm_data(seed=1, batch_size=4)[0]

    def gradients(mode):
        model = layouts.apply_ac(reference.make_lm(tie_weights=True, seed=0), mode)
        reference.lm_loss(model(batch.inputs), batch.targets).backward()
        return {name: param.grad for name, param in model.named_parameters()}

    plain, recomputed = gradients("none"), gradients(mode)
    assert list(recomputed) == list(plain)  # the same parameters, under the same names
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=0, msg=labelled(name))


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("layers, dim, seq_len, batch_size", [(2, 32, 16, 4), (3, 16, 24, 2)])
def test_the_flops_recomputation_adds_equal_the_formula(early_stop, layers, dim, seq_len,
                                                        batch_size):
    model = reference.make_lm(dim=dim, layers=layers, max_seq_len=seq_len, seed=0)
    batch = reference.lm_data(seed=1, batch_size=batch_size, seq_len=seq_len)[0]
    counted = {mode: checkpointing.step_flops(model, batch, mode, early_stop)
               for mode in checkpointing.MODES}
    blocks = layers * checkpointing.block_forward_flops(seq_len, batch_size, dim)
    assert counted["none"]["blocks"] == blocks
    for mode in checkpointing.MODES:
        extra = counted[mode]["total"] - counted["none"]["total"]
        assert extra == layers * checkpointing.recomputed_flops(seq_len, batch_size, dim, mode,
                                                                early_stop)
    if not early_stop:  # full recomputation is then exactly one more forward of the blocks
        assert counted["full"]["total"] - counted["none"]["total"] == blocks


@pytest.mark.parametrize("s, b, h, a", SHAPES)
@pytest.mark.parametrize("kernel", list(checkpointing.KERNELS))
def test_what_a_forward_leaves_alive_equals_the_formula_for_the_op_policy_too(s, b, h, a, kernel):
    """The storages alive after forward equal the saved-tensor hooks' count wherever those see
    everything, and the op policy's kept outputs, which sit in the selective-checkpointing cache:
    the input, q and v (h wide), up's output (4h), and the flash kernel's output and
    log-sum-exp, all float32."""
    block = reference.make_block(dim=h, heads=a, seed=0)
    x = reference.seeded_randn(1, b, s, h).requires_grad_()
    for mode in checkpointing.MODES:
        assert checkpointing.kept_alive(block, x, mode, attention=kernel) == \
            checkpointing.kept_bytes(block, x, mode, kernel), mode
    sbh = s * b * h
    flash = sbh + b * a * s if kernel == "flash" else 0
    assert checkpointing.kept_alive(block, x, "op", attention=kernel) == \
        4 * (sbh + 2 * sbh + 4 * sbh + flash)
    assert checkpointing.kept_bytes(block, x, "op", kernel) == 4 * sbh  # the hooks: the input


@pytest.mark.parametrize("early_stop", [True, False])
def test_the_op_policy_and_every_kth_block_recompute_what_their_formulas_say(early_stop):
    s, b, h, layers = 16, 4, 32, 4
    model = reference.make_lm(dim=h, layers=layers, max_seq_len=s, seed=0)
    batch = reference.lm_data(seed=1, batch_size=b, seq_len=s)[0]
    base = checkpointing.step_flops(model, batch, "none", early_stop)["total"]
    op = checkpointing.step_flops(model, batch, "op", early_stop)["total"] - base
    # k and out (h x h each), the math kernel's q k^T and P v, and down (4h x h) but for early stop
    assert op == layers * (2 * 2 * b * s * h * h + 2 * 2 * b * s * s * h
                           + (0 if early_stop else 2 * b * s * 4 * h * h))
    for every in (2, 4):
        added = checkpointing.step_flops(model, batch, "full", early_stop, every)["total"] - base
        assert added == layers // every * checkpointing.recomputed_flops(s, b, h, "full",
                                                                         early_stop)


def test_every_kth_block_keeps_what_its_blocks_keep():
    s, b, h, a, layers = 16, 4, 32, 4, 4
    model = reference.make_lm(dim=h, heads=a, layers=layers, max_seq_len=s, seed=0)
    batch = reference.lm_data(seed=1, batch_size=b, seq_len=s)[0]
    none = checkpointing.kept_alive(model, batch, "none")
    saved_per_block = (checkpointing.kept_formula(s, b, h, a, "none")
                       - checkpointing.kept_formula(s, b, h, a, "full"))
    for every in (1, 2, 4):
        assert checkpointing.kept_alive(model, batch, "full", every=every) == \
            none - layers // every * saved_per_block


@pytest.mark.numerical
@pytest.mark.soak  # 11 s; lesson 14's float64 tests run recomputation under both in make test
def test_recomputation_under_fsdp2_and_tensor_parallelism():
    """dp x tp = 2 x 2, float64: every setting equals one process; FSDP2 gathers the same in each
    (recomputation happens with the block's weights already gathered for backward); tensor
    parallelism's forward all-reduces are repeated by full recomputation (one per block with
    early stop, both without) and by nothing else; the bytes kept follow the formula."""
    model, batches = reference.in_float64(reference.make_lm(seed=0),
                                          reference.lm_data(seed=1, batch_size=8, steps=2))
    alone = reference.train(model, batches, reference.lm_loss, optimizer="sgd").parameters
    blocks, kept = 2, {}
    repeated = {"none": 0, "selective": 0, "full": blocks, "full, no early stop": 2 * blocks,
                "op": 0}
    runs = run(checkpointing.composed_worker, 4, args=(model, batches), show_output=False)
    for setting, extra in repeated.items():
        out = [by_setting[setting] for by_setting in runs]
        for result in out:
            for name, param in alone.items():  # float64: 2 steps of SGD, sums of 4 shards
                torch.testing.assert_close(result["parameters"][name], param, rtol=1e-12,
                                           atol=1e-12, msg=labelled(f"{setting}: {name}"))
        calls = out[0]["calls"]
        assert (calls["all-gather", "forward"], calls["all-gather", "step"]) == \
            (1 + blocks, 1 + 2 * blocks), setting  # the root once; each block twice
        assert calls["reduce-scatter", "step"] == 1 + blocks, setting
        # two per block in forward; in backward, q's, k's, v's and up's input gradients
        assert (calls["all-reduce", "forward"], calls["all-reduce", "step"]) == \
            (2 * blocks, 2 * blocks + 4 * blocks + extra), setting
        kept[setting] = {result["kept"] for result in out}
        assert len(kept[setting]) == 1, setting  # every rank the same
    sbh, lse = 4 * 16 * 32, 4 * 4 * 16 / 2  # this rank's 4 sequences of 16; a = 4 over t = 2
    per_block = {"none": 4 * sbh + 12 * sbh / 2 + 2 * 2 * 4 * 16 + lse,  # lesson 08's count
                 "full": sbh, "op": sbh + 7 * sbh / 2 + 2 * sbh + lse}
    per_block["selective"] = per_block["none"] - lse
    per_block["full, no early stop"] = per_block["full"]
    (none,) = kept["none"]
    for setting, elements in per_block.items():
        (bytes_kept,) = kept[setting]
        assert none - bytes_kept == 8 * blocks * (per_block["none"] - elements), setting
        assert 8 * blocks * (per_block["none"] - elements) == blocks * (
            checkpointing.kept_under_tensor_parallelism(16, 4, 32, 4, 2, "none", 8)
            - checkpointing.kept_under_tensor_parallelism(
                16, 4, 32, 4, 2, checkpointing.COMPOSED[setting][0], 8)), setting


def test_step_times_are_measured_for_every_mode():
    medians = run(checkpointing.step_times_worker, 1, show_output=False, kwargs=dict(
        model=reference.make_lm(seed=0), batch=reference.lm_data(seed=1, batch_size=4)[0],
        iterations=1))[0]
    assert set(medians) == set(checkpointing.MODES)
    assert all(seconds > 0 for seconds in medians.values())


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        layouts.apply_ac(reference.make_block(), "everything")


def test_the_key_figure_draws():
    fig = plots.key_figure()
    assert len(fig.axes[0].patches) == len(checkpointing.KERNELS) * len(checkpointing.MODES)


# --- the exercise: typical mistakes ---------------------------------------------------------


def recomputing(restore_rng: bool, parameters_as_inputs: bool):
    """A hand-written checkpoint: right, or without restoring the random state (dropout draws
    new masks in backward), or without the parameters among the Function's inputs (autograd
    then gives them no gradient)."""
    def checkpointed(function, x):
        parameters = list(function.parameters()) if parameters_as_inputs else []

        class Recomputed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, *parameters):
                ctx.save_for_backward(x)
                ctx.state = torch.get_rng_state()
                with torch.no_grad():
                    return function(x)

            @staticmethod
            def backward(ctx, grad_output):
                (x,) = ctx.saved_tensors
                x = x.detach().requires_grad_()
                with torch.random.fork_rng(devices=[]), torch.enable_grad():
                    if restore_rng:
                        torch.set_rng_state(ctx.state)
                    output = function(x)
                return torch.autograd.grad(output, [x, *parameters], grad_output)

        return Recomputed.apply(x, *parameters)

    return checkpointed


def recording_the_forward(function, x):
    """Right values, but forward is recorded: everything inside is kept."""
    return function(x)


def with_torch_checkpoint(function, x):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(function, x, use_reentrant=False)


@pytest.mark.parametrize("mistake, says", [
    (recomputing(restore_rng=False, parameters_as_inputs=True), "the gradient of x: elements"),
    (recording_the_forward, "the bytes of what autograd saved during the call, other than x: "
                            "expected 0, got"),
    (recomputing(restore_rng=True, parameters_as_inputs=False),
     "the gradients of function's parameters: '0.weight': expected a tensor, got NoneType "
     "None"),
    (with_torch_checkpoint, "without torch.utils.checkpoint"),
])
def test_checker_rejects_a_typical_mistake(mistake, says):
    expect_rejection("checkpointed", mistake, says)


def test_checker_accepts_another_right_answer():
    expect_acceptance("checkpointed", recomputing(restore_rng=True, parameters_as_inputs=True))


def kept_without_the_statistics(s, b, h, a, mode, kernel):
    if mode == "full":
        return 4 * s * b * h
    core = 0 if mode == "selective" else (a * s * s * b if kernel == "math" else b * a * s)
    return 4 * (16 * s * b * h + core)


def kept_with_the_core_in_selective_too(s, b, h, a, mode, kernel):
    if mode == "full":
        return 4 * s * b * h
    core = a * s * s * b if kernel == "math" else b * a * s
    return 4 * (16 * s * b * h + 4 * b * s + core)


@pytest.mark.parametrize("mistake, says", [
    (kept_without_the_statistics, "expected 66560, got 66048"),
    (kept_with_the_core_in_selective_too, "Hint: which tensors does each mode keep"),
])
def test_kept_bytes_checker_rejects_a_typical_mistake(mistake, says):
    expect_rejection("kept_bytes_per_block", mistake, says)


# --- loss scaling by hand: typical mistakes -------------------------------------------------


def scaling(skip_overflow=True, unscale=1, reset_on_overflow=True, grow=True):
    """The reference solution, or with one step of it left out (or, unscale=2, done twice)."""
    def scaled_step(model, optimizer, loss, scale, good_steps):
        (loss * scale).backward()
        grads = [param.grad for param in model.parameters()]
        if skip_overflow and not all(grad.isfinite().all() for grad in grads):
            return scale / 2, 0 if reset_on_overflow else good_steps
        for _ in range(unscale):
            for grad in grads:
                grad.div_(scale)
        optimizer.step()
        good_steps += 1
        if grow and good_steps == 3:
            return scale * 2, 0
        return scale, good_steps

    return scaled_step


def stepping_on_zeroed_gradients(model, optimizer, loss, scale, good_steps):
    """Overflow handled by zeroing the gradients, then stepping anyway: momentum still moves."""
    (loss * scale).backward()
    grads = [param.grad for param in model.parameters()]
    overflow = not all(grad.isfinite().all() for grad in grads)
    for grad in grads:
        grad.zero_() if overflow else grad.div_(scale)
    optimizer.step()
    if overflow:
        return scale / 2, 0
    return (scale * 2, 0) if good_steps + 1 == 3 else (scale, good_steps + 1)


def with_grad_scaler(model, optimizer, loss, scale, good_steps):
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    return scale, good_steps


@pytest.mark.parametrize("mistake, says", [
    (scaling(skip_overflow=False), "the scale at each step"),  # inf weights overflow again
    (scaling(unscale=0), "the scale at each step"),  # huge steps, then overflows
    (scaling(unscale=2), "the weights after the last step"),  # tiny steps
    (stepping_on_zeroed_gradients, "whether each step moved the weights"),
    (scaling(grow=False), "the scale at each step"),
    (with_grad_scaler, "without torch.amp.GradScaler"),
])
def test_scaled_step_checker_rejects_a_typical_mistake(mistake, says):
    expect_rejection("scaled_step", mistake, says)


def test_scaled_step_checker_needs_good_steps_reset_after_an_overflow():
    """Case (0, 10, 2**21): an overflow, two good steps, an overflow, good steps again: a count
    that runs on across the second overflow grows the scale a step early."""
    expect_rejection("scaled_step", scaling(reset_on_overflow=False), "the scale at each step")
