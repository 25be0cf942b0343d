"""Mixed precision (lesson 11, notebooks/11_fitting_a_model.ipynb): compute in 16 bits, keep the
weights, their gradients and the optimizer's state in float32.

Under `torch.autocast(device, dtype)` each operation on autocast's lower-precision list (matrix
products: linear, matmul, bmm, scaled_dot_product_attention, ...) casts its inputs to `dtype` and
computes there; operations on its float32 list run in float32 (on the CPU the losses,
cross_entropy among them; on CUDA also softmax, log_softmax, layer_norm); every other operation
runs in its inputs' dtype (here a LayerNorm of the float32 residual stream runs in float32, the
softmax inside bfloat16 attention in bfloat16). The parameters
stay float32 ("master weights"): autocast casts each weight to `dtype` once per forward and
autograd keeps that copy for backward, so the gradients reach the float32 parameters in float32.

bfloat16 has float32's 8 exponent bits and 7 fraction bits (8 significant bits with the implicit
one), so it covers float32's range; float16 has 5 exponent bits: no value above 65504, and none
below 2**-24 but zero. Small float16
gradients underflow, so float16 training multiplies the loss by a scale before backward and
divides the gradients by it before the step (Micikevicius et al., "Mixed Precision Training",
ICLR 2018, section 3.2). `torch.amp.GradScaler` chooses the scale: when a gradient is inf or NaN
it skips the optimizer's step and multiplies the scale by backoff_factor (0.5); after
growth_interval (2000) steps in a row without one it multiplies it by growth_factor (2).

    losses(model, batches, dtype)              single-process AdamW, forward and loss under autocast
                                               (dtype None: float32), the loss of each step
    bytes_by_kind(model, batch, dtype)         the bytes of the weights and their gradients, and
                                               what autograd keeps for backward: autocast's copies
                                               of the weights, and the rest by dtype
    scaler_steps(model, batches, init_scale)   float16 autocast with a GradScaler: per step the
                                               scale, whether every gradient was finite, and
                                               whether the optimizer stepped (its step count)
    reduction_worker                           one backward, its gradients averaged over the ranks
                                               in float32 and in bfloat16: the bytes sent, the
                                               results and each rank's own gradients
    policy_worker                              lesson 07's FSDP(compute_dtype=bfloat16) or
                                               fully_shard with MixedPrecisionPolicy(bfloat16,
                                               reduce_dtype=float32): parameters and bytes sent
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from helpers import reference
from helpers.instrument import Observer, saved_activations, saved_bytes_by_kind
from helpers.launcher.result import get_device
from helpers.layouts import apply_fsdp
from helpers.strategies import default_mesh, full_parameters
from helpers.timing import observed_training
from helpers.zero_and_fsdp.fsdp import FSDP


def losses(model, batches, dtype=None, device=None) -> list:
    """Train a copy of `model` with the course's AdamW, one step per batch, forward and loss
    under torch.autocast(device, dtype) (dtype None: plain float32; device None: get_device(),
    the CPU outside a rank). The loss of each step."""
    device = device or get_device()
    model = copy.deepcopy(model).to(device)
    optimizer = reference.make_optimizer("adamw", model.parameters())
    found = []
    for batch in batches:
        batch = batch.to(device)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = reference.lm_loss(model(batch.inputs), batch.targets)
        loss.backward()  # outside autocast, as PyTorch's AMP examples do
        optimizer.step()
        found.append(loss.item())
    return found


def is_weight_copy(tensor: torch.Tensor, parameters: set) -> bool:
    """Whether `tensor` (or the tensor it views: a Linear keeps its weight transposed) is
    autocast's cast of a parameter: made by a copy (ToCopyBackward0) straight from one of
    `parameters`' gradient accumulators."""
    function = (tensor._base if tensor._is_view() else tensor).grad_fn
    if function is None or type(function).__name__ != "ToCopyBackward0":
        return False
    source = function.next_functions[0][0]
    return getattr(source, "variable", None) is not None and id(source.variable) in parameters


def bytes_by_kind(model, batch, dtype=None, device=None) -> dict:
    """One forward, loss and backward of a copy of `model` on `batch` under autocast to `dtype`
    (None: float32). The bytes of the parameters ("weights") and of their gradients
    ("gradients"), and of the distinct storages autograd kept for backward, split into autocast's
    copies of the weights ("weight copies") and the rest by dtype ("activations, bfloat16",
    "activations, float32", and the token ids, "activations, int64"). `device`: as in losses."""
    device = device or get_device()
    model, batch = copy.deepcopy(model).to(device), batch.to(device)
    parameters = {id(param) for param in model.parameters()}

    def kind(tensor):
        if is_weight_copy(tensor, parameters):
            return "weight copies"
        return f"activations, {str(tensor.dtype).removeprefix('torch.')}"

    with saved_activations(model, classify=kind) as saved, \
            torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = reference.lm_loss(model(batch.inputs), batch.targets)
    loss.backward()
    return {"weights": sum(param.nbytes for param in model.parameters()),
            "gradients": sum(param.grad.nbytes for param in model.parameters()),
            **saved_bytes_by_kind(saved)}


def scaler_steps(model, batches, init_scale: float, device=None) -> list:
    """float16 autocast training with torch.amp.GradScaler starting at `init_scale`: per step
    {"scale": the scale the loss was multiplied by, "finite": every unscaled gradient finite,
    "stepped": the optimizer's step count moved, "weights changed": any parameter moved}.
    `device`: as in losses."""
    device = device or get_device()
    model = copy.deepcopy(model).to(device)
    optimizer = reference.make_optimizer("adamw", model.parameters())
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale)
    found = []
    for batch in batches:
        batch = batch.to(device)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = reference.lm_loss(model(batch.inputs), batch.targets)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()  # the loss times the scale: every gradient times it too
        scaler.unscale_(optimizer)  # divide the gradients by the scale (checked for inf here)
        finite = all(param.grad.isfinite().all() for param in model.parameters())
        before = [param.detach().clone() for param in model.parameters()]
        steps = optimizer_steps(optimizer)
        scaler.step(optimizer)  # skipped if a gradient was inf or NaN
        scaler.update()  # halve the scale after a skipped step
        found.append({"scale": scale, "finite": finite,
                      "stepped": optimizer_steps(optimizer) > steps,
                      "weights changed": moved(before, model)})
    return found


def moved(before: list, model) -> bool:
    """Whether any parameter of `model` differs from its copy in `before` (same order)."""
    return any(not torch.equal(old, param) for old, param in zip(before, model.parameters()))


def optimizer_steps(optimizer) -> int:
    """The step count Adam keeps per parameter (0 before the first step)."""
    return max((int(state["step"]) for state in optimizer.state.values()), default=0)


def reduction_worker(rank, world_size, model, batch):
    """One forward and backward of `model` on this rank's slice of `batch`, in float32; its
    gradients summed over the ranks twice, in float32 and cast to bfloat16 (all_reduce, SUM),
    each divided by the ranks after. Returns {"local": this rank's gradients, "float32",
    "bfloat16": the averages (as float32), "sent": {dtype: bytes this rank sent}}."""
    local = batch.shard(rank, world_size).to(get_device())
    model = model.to(get_device())
    reference.lm_loss(model(local.inputs), local.targets).backward()
    grads = {name: param.grad for name, param in model.named_parameters()}
    result = {"local": {name: grad.cpu() for name, grad in grads.items()}, "sent": {}}
    for dtype in (torch.float32, torch.bfloat16):
        with Observer() as observed:
            summed = {name: grad.to(dtype, copy=True) for name, grad in grads.items()}
            for grad in summed.values():
                dist.all_reduce(grad)  # the one line that differs: the dtype of what is sent
        result[str(dtype).removeprefix("torch.")] = {
            name: grad.float().cpu() / world_size for name, grad in summed.items()}
        result["sent"][str(dtype).removeprefix("torch.")] = observed.sent()["all_reduce"]
    return result


# ZeRO-3 computing in bfloat16, reducing in float32: {key: the code that asks for it}, lesson
# 07's hand-built FSDP and PyTorch's FSDP2
POLICIES = {"hand_built": "FSDP(compute_dtype=bfloat16)",
            "fully_shard": "fully_shard(mp_policy=MixedPrecisionPolicy(...))"}


def policy_worker(rank, world_size, kind, model, batches):
    """Train a copy of `model` (an MLP of Linear layers) with ZeRO-3 computing in bfloat16 and
    reducing gradients in float32: `kind` is a key of POLICIES. Returns the full parameters after
    the last step, and the bytes and calls of the last step by collective."""
    if kind not in POLICIES:
        raise ValueError(f"unknown kind {kind!r}; choose one of {list(POLICIES)}")
    model = copy.deepcopy(model).to(get_device())
    if kind == "hand_built":
        module = FSDP(model, compute_dtype=torch.bfloat16)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      output_dtype=torch.float32)
        # each Linear its own unit, as the hand-built FSDP's
        module = apply_fsdp(model, default_mesh("fully_shard"), unit="layer", mp_policy=policy)
    optimizer = reference.make_optimizer("adamw", module.parameters())
    observed = observed_training(module, optimizer, reference.mse_loss, batches, rank, world_size)
    return {"parameters": full_parameters(module), "sent": observed.sent(),
            "calls": observed.calls()}


def relative_errors(averaged: dict, local: list) -> torch.Tensor:
    """Every element's error in `averaged` (name -> the ranks' average, as a reduction computed
    it) against the exact average of the ranks' gradients `local` (one dict per rank), computed in
    float64, relative to the size of the terms, Σ|g_r| / n (what a sum's rounding scales with,
    even where the terms cancel); elements whose terms are all zero left out."""
    errors = []
    for name, got in averaged.items():
        terms = torch.stack([grads[name].double() for grads in local])
        exact, size = terms.mean(0), terms.abs().mean(0)
        nonzero = size > 0
        errors.append(((got.double() - exact).abs()[nonzero] / size[nonzero]).flatten())
    return torch.cat(errors)
