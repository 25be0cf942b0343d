"""Lesson 11's exercises, checked by `helpers.exercises.check(name, your_function)`."""

import contextlib
from unittest import mock

import torch
import torch.utils.checkpoint
from torch import nn

from helpers import reference
from helpers.exercises import Exercise
from helpers.fitting_a_model.precision import moved
from helpers.instrument import saved_activations, saved_bytes
from helpers.launcher.result import get_device

EXERCISES = {}

WIDTH = 8
CHECKPOINT_CASES = [(0, 4), (1, 6), (2, 3)]  # (seed, batch)


def _layer(seed):
    """An MLP with dropout between its layers, in float64 (comparisons exact to rounding)."""
    return reference.seeded(seed, lambda: nn.Sequential(
        nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Dropout(0.5),
        nn.Linear(4 * WIDTH, WIDTH))).double()


def _run(function, seed, batch):
    """function(layer, x) on a seeded layer, with x computed from a leaf (so its gradient flows
    back), dropout drawing from a seeded generator; then backward of a weighted sum. Returns
    the output, the leaf's gradient, the layer's gradients by name, and the bytes of floating-point
    tensors that autograd saved during the call, x's own storage left out."""
    layer = _layer(seed)
    leaf = reference.seeded_randn(seed + 1, batch, WIDTH).double().requires_grad_()
    x = leaf * 2
    x_storage = x.untyped_storage().data_ptr()

    def floating_not_x(tensor):
        wanted = tensor.is_floating_point() and tensor.untyped_storage().data_ptr() != x_storage
        return "kept" if wanted else None

    torch.manual_seed(seed + 2)  # what dropout draws
    with saved_activations(layer, classify=floating_not_x) as kept, \
            _without_torch_checkpoint():
        output = function(layer, x)
    torch.manual_seed(seed + 3)  # backward must not depend on the generator's state now
    weights = reference.seeded_randn(seed + 4, batch, WIDTH).double()
    (output * weights).sum().backward()
    return (output.detach(), leaf.grad,
            {name: param.grad for name, param in layer.named_parameters()}, saved_bytes(kept))


@contextlib.contextmanager
def _without_torch_checkpoint():
    """torch.utils.checkpoint refuses to run, however it was imported: both of its ways in
    (reentrant or not) go through these two module attributes."""
    def refuse(*args, **kwargs):
        raise RuntimeError("the task says: write the checkpointing yourself, without "
                           "torch.utils.checkpoint")
    with mock.patch.object(torch.utils.checkpoint, "CheckpointFunction", mock.Mock(apply=refuse)), \
            mock.patch.object(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator",
                              refuse):
        yield


def _expected(seed, batch):
    """Without checkpointing, and nothing kept."""
    output, grad_x, grads, _ = _run(lambda layer, x: layer(x), seed, batch)
    return output, grad_x, grads, 0


EXERCISES["checkpointed"] = Exercise(
    "checkpointed(function, x) returns function(x), a module applied to a tensor, so that "
    "autograd keeps nothing that function computes inside (0 bytes of floating-point tensors "
    "saved for backward, other than x itself) and backward still gives x and function's "
    "parameters the gradients they get without checkpointing, even when function draws random "
    "numbers (dropout), without torch.utils.checkpoint",
    CHECKPOINT_CASES,
    _expected,
    distributed=False,
    harness=_run,
    names=("the output", "the gradient of x", "the gradients of function's parameters",
           "the bytes of what autograd saved during the call, other than x"),
    hint="is anything recorded while forward runs function the first time? And when backward "
         "runs it again: from which input, for which parameters, drawing which random numbers?",
    points=3,
)


KEPT_CASES = [(16, 2, 32, 4, "none", "flash"), (128, 2, 64, 4, "none", "math"),
              (24, 3, 48, 6, "selective", "math"), (40, 1, 16, 2, "full", "flash"),
              (64, 4, 32, 8, "selective", "flash"), (32, 1, 64, 2, "full", "math")]


def _kept(s, b, h, a, mode, kernel):
    from helpers.fitting_a_model.checkpointing import kept_formula

    return kept_formula(s, b, h, a, mode, kernel)


EXERCISES["kept_bytes_per_block"] = Exercise(
    "kept_bytes_per_block(s, b, h, a, mode, kernel) returns, as an int, the bytes one of the "
    "course's Blocks keeps for backward in float32, for b sequences of s tokens of width h with "
    "a heads, mode 'none', 'selective' or 'full', kernel 'flash' or 'math': as the lesson "
    "measured them, the block's b x s x h tensors, the LayerNorms' statistics, and what the "
    "attention core keeps with each kernel",
    KEPT_CASES,
    _kept,
    distributed=False,
    hint="which tensors does each mode keep: the 16 of b x s x h, the two LayerNorms' mean and "
         "1/std per token, and the core's own (one log-sum-exp per query and head, or the "
         "probabilities, s x s per head and sequence)?",
)


# --- loss scaling by hand ------------------------------------------------------------------------

GROWTH_INTERVAL = 3  # GradScaler's default is 2000: 3 lets a short run show growth too
# (seed, steps, the first scale's power of two): overflows, growth, both
SCALING_CASES = [(0, 12, 24), (1, 8, 10), (0, 10, 21), (2, 10, 22)]


@contextlib.contextmanager
def _without_grad_scaler():
    """torch.amp.GradScaler refuses to be built, however it is reached."""
    def refuse(*args, **kwargs):
        raise RuntimeError("the task says: scale the loss yourself, without torch.amp.GradScaler")

    with mock.patch.object(torch.amp, "GradScaler", refuse), \
            mock.patch.object(torch.amp.grad_scaler, "GradScaler", refuse), \
            mock.patch.object(torch.cuda.amp, "GradScaler", refuse):
        yield


def _train_scaled(step, seed, steps, init_scale_power):
    """float16 autocast training of a seeded TinyLM with SGD (momentum 0.9: unlike Adam, its step
    grows with the gradient, so a gradient left scaled shows), one seeded batch per step: zero_grad,
    the loss under autocast, handed to `step(model, optimizer, loss, scale, good_steps) -> (scale,
    good_steps)`, starting from scale 2**init_scale_power. Returns the scale of each step, whether
    each step moved any weight, and the weights after the last."""
    model = reference.make_lm(seed=seed)
    optimizer = reference.make_optimizer("sgd", model.parameters(), lr=0.05)
    scale, good_steps, scales, stepped = 2.0 ** init_scale_power, 0, [], []
    for batch in reference.lm_data(seed=seed + 1, batch_size=8, steps=steps):
        optimizer.zero_grad()
        with torch.autocast(get_device().type, dtype=torch.float16):
            loss = reference.lm_loss(model(batch.inputs), batch.targets)
        scales.append(scale)
        before = [param.detach().clone() for param in model.parameters()]
        scale, good_steps = step(model, optimizer, loss, scale, good_steps)
        stepped.append(moved(before, model))
    return scales, stepped, reference.parameters(model)


def _scaled_by_hand(function, seed, steps, init_scale_power):
    with _without_grad_scaler():
        return _train_scaled(function, seed, steps, init_scale_power)


def _with_grad_scaler(seed, steps, init_scale_power):
    """The same training with torch.amp.GradScaler doing the scaling."""
    scaler = torch.amp.GradScaler(get_device().type, init_scale=2.0 ** init_scale_power,
                                  growth_interval=GROWTH_INTERVAL)

    def step(model, optimizer, loss, scale, good_steps):
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return scaler.get_scale(), 0

    return _train_scaled(step, seed, steps, init_scale_power)


EXERCISES["scaled_step"] = Exercise(
    "scaled_step(model, optimizer, loss, scale, good_steps) returns (the next scale, the next "
    "good_steps) after one float16 training step on `loss`, so that a whole run trains as "
    "torch.amp.GradScaler(init_scale=..., growth_factor=2, backoff_factor=0.5, "
    f"growth_interval={GROWTH_INTERVAL}) does: the same scale at every step, the same weights "
    "at the end (a step whose gradients are inf or NaN moves no weight and no optimizer state), "
    "without torch.amp.GradScaler",
    SCALING_CASES,
    _with_grad_scaler,
    distributed=False,
    harness=_scaled_by_hand,
    names=("the scale at each step", "whether each step moved the weights",
           "the weights after the last step"),
    hint="which gradients does the optimizer see: scaled, or divided by the scale again? Does a "
         "step whose gradients overflowed leave the weights, and SGD's momentum, untouched? "
         f"What happens to the scale, and to good_steps, after an overflow, and after "
         f"{GROWTH_INTERVAL} good steps in a row?",
    points=3,
)
