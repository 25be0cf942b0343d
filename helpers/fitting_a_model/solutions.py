"""Reference solutions of lesson 11's exercises. Try the exercise first."""

import torch


class Checkpointed(torch.autograd.Function):
    """Forward without recording; backward runs function again, from the same random state."""

    @staticmethod
    def forward(ctx, x, function, *parameters):
        ctx.function, ctx.rng_state = function, torch.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():  # nothing inside is recorded, so nothing is kept
            return function(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(ctx.rng_state)  # the same dropout masks as in forward
            output = ctx.function(x)
        parameters = [param for param in ctx.function.parameters() if param.requires_grad]
        grads = torch.autograd.grad(output, [x, *parameters], grad_output)
        return grads[0], None, *grads[1:]


def checkpointed(function, x):
    return Checkpointed.apply(x, function, *function.parameters())


def kept_bytes_per_block(s, b, h, a, mode, kernel):
    if mode == "full":
        return 4 * s * b * h  # the block's input
    tensors = 16 * s * b * h  # lesson 08's count: 4 h-wide outside the core's region, 12 inside
    statistics = 2 * 2 * b * s  # two LayerNorms: mean and 1/std per token
    core = 0 if mode == "selective" else (a * s * s * b if kernel == "math" else b * a * s)
    return 4 * (tensors + statistics + core)


def scaled_step(model, optimizer, loss, scale, good_steps, growth_interval=3):
    (loss * scale).backward()  # every gradient times the scale: small ones survive float16
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    if not all(grad.isfinite().all() for grad in grads):
        return scale / 2, 0  # overflow: skip the step, halve the scale
    for grad in grads:
        grad.div_(scale)  # exact: the scale is a power of two
    optimizer.step()
    good_steps += 1
    if good_steps == growth_interval:
        return scale * 2, 0
    return scale, good_steps
