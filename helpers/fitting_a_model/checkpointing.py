"""Activation checkpointing (lesson 11): what a transformer block keeps for backward without it,
with selective recomputation and with full recomputation, measured and by formula, and the
FLOPs it costs.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198) count, per layer and in 16-bit (s sequence, b batch, h hidden, a heads),
Table 2: no recomputation sbh(34 + 5as/h); selective recomputation (the attention core, whose
softmax and dropout make the 5as/h term, recomputed in backward) 34sbh; full recomputation (only
the layer's input kept) 2sbh. The course's Block keeps float32 activations and has no dropout, so
`kept_formula` counts its own tensors (lesson 08's `block_formula`) the same way.

    helpers.layouts.apply_ac(model, mode)   "none", "selective" or "full", on every block
                                            (recompute_in_backward: torch.utils.checkpoint)
    kept_bytes(block, x, mode, attention)   what autograd keeps in one block's forward, measured
    kept_formula(s, b, h, a, mode, attention)   the same, by formula
    paper_bytes(s, b, h, a, mode)           the paper's Table 2; paper_bytes_as_the_block: the
                                            same accounting without dropout, in float32
    step_flops(model, batch, mode)          FLOPs of forward + backward, FlopCounterMode
    recomputed_flops(s, b, h, mode)         what recomputation adds per block, by formula

`attention` picks scaled_dot_product_attention's kernel: "flash" (the CPU's default here, which
keeps only each row's log-sum-exp and recomputes the probabilities in its backward) or "math"
(which keeps the s x s probabilities of every head, as the paper's accounting assumes).
"""

from __future__ import annotations

import copy

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from helpers import reference, strategies
from helpers.instrument import saved_activations, saved_bytes
from helpers.layouts import AC_MODES, apply_ac
from helpers.tensor_parallelism.memory import block_formula

MODES = AC_MODES  # helpers.layouts.apply_ac's
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def kept_bytes(block, x, mode: str, attention: str = "flash") -> int:
    """The bytes of the distinct tensors autograd keeps for backward in one forward of `block`
    (a copy, checkpointed by `mode`), its parameters left out (instrument.saved_activations)."""
    block = apply_ac(copy.deepcopy(block), mode)
    with sdpa_kernel(KERNELS[attention]), saved_activations(block) as saved:
        block(x)
    return saved_bytes(saved)


def kept_formula(s: int, b: int, h: int, a: int, mode: str, attention: str = "flash") -> int:
    """What the course's Block keeps, in bytes (float32). none: lesson 08's block_formula, whose
    statistics include the flash kernel's log-sum-exp (b a s); the math kernel keeps the
    probabilities (a s x s per sequence) instead. selective: the core keeps nothing of its own
    (its inputs q, k, v are kept, and its output is the next layer's input). full: the input."""
    if mode == "full":
        return 4 * s * b * h
    whole = sum(block_formula(s, b, h, a).values())
    logsumexp, probabilities = 4 * b * a * s, 4 * b * a * s * s
    if mode == "selective":
        return int(whole - logsumexp)
    return int(whole - logsumexp + (probabilities if attention == "math" else logsumexp))


def paper_bytes(s: int, b: int, h: int, a: int, mode: str) -> float:
    """Korthikanti et al. 2022, Table 2, per layer, its rows at t = 1 (no tensor parallelism):
    16-bit activations, 1-byte dropout masks."""
    return {"none": s * b * h * (34 + 5 * a * s / h), "selective": 34 * s * b * h,
            "full": 2 * s * b * h}[mode]


def paper_bytes_as_the_block(s: int, b: int, h: int, a: int, mode: str) -> float:
    """The paper's accounting for a layer like the course's Block: without dropout (its two
    1-byte masks of sbh go, and so do the attention dropout's 1-byte mask and 2-byte output, a
    s^2 b elements each; the 2-byte softmax output stays) and with 4-byte tensors instead of
    2-byte ones: none 2 (32 sbh + 2 a s^2 b), selective 2 (32 sbh), full 2 (2 sbh). It leaves
    out the LayerNorms' statistics."""
    return {"none": 2 * (32 * s * b * h + 2 * a * s * s * b), "selective": 2 * 32 * s * b * h,
            "full": 2 * 2 * s * b * h}[mode]


def step_times_worker(rank, world_size, model, batch, iterations, kernel="math"):
    """One copy of `model` per mode (strategies.step_times_worker: "one_process" with
    recompute=mode, SGD), taking turns: each one's median seconds for a training step on this
    rank's slice of `batch`, attention on `kernel`."""
    contenders = {mode: ("one_process", {"recompute": mode, "optimizer": "sgd", "lr": 1e-3})
                  for mode in MODES}
    with sdpa_kernel(KERNELS[kernel]):
        return strategies.step_times_worker(rank, world_size, contenders, model, batch,
                                            iterations)["seconds"]


def step_flops(model, batch, mode: str, early_stop: bool = True) -> dict:
    """FLOPs of one forward and one backward of `model` (a copy, checkpointed by `mode`) on
    `batch`, counted by torch.utils.flop_counter.FlopCounterMode: {"forward", "total", "blocks"
    (the forward's FLOPs inside the blocks)}. Attention runs the math kernel, whose matrix
    products the counter sees (it has no formula for the CPU's flash kernel). `early_stop`:
    torch.utils.checkpoint's default, which stops recomputing once backward has every tensor it
    needs (set_checkpoint_early_stop)."""
    model = apply_ac(copy.deepcopy(model), mode)
    with sdpa_kernel(KERNELS["math"]), set_checkpoint_early_stop(early_stop):
        with FlopCounterMode(display=False) as forward:
            loss = reference.lm_loss(model(batch.inputs), batch.targets)
        with FlopCounterMode(display=False) as backward:
            loss.backward()
    blocks = sum(sum(counts.values()) for name, counts in forward.get_flop_counts().items()
                 if name.count(".") == 2 and ".blocks." in name)
    return {"forward": forward.get_total_flops(), "blocks": blocks,
            "total": forward.get_total_flops() + backward.get_total_flops()}


def block_forward_flops(s: int, b: int, h: int) -> int:
    """Matrix-product FLOPs of one Block's forward: its six Linear layers, 2 b s (4 h^2 + 8 h^2),
    and the attention core's two products, q k^T and P v, 2 b s^2 h each (the counter counts the
    causal core whole)."""
    return 2 * b * s * 12 * h * h + 4 * b * s * s * h


def recomputed_flops(s: int, b: int, h: int, mode: str, early_stop: bool = True) -> int:
    """The FLOPs backward adds per Block by recomputing: the block's forward (full), or its
    core's (selective). Early stop ends the recomputation once every tensor the checkpointed
    function saved has been produced again; its last product saved its inputs before running,
    and nothing inside the function saves that product's output, so it is not run again: the
    MLP's `down` (2 b s 4h^2), the core's P v (2 b s^2 h)."""
    if mode == "none":
        return 0
    if mode == "selective":
        return 2 * b * s * s * h * (1 if early_stop else 2)
    return block_forward_flops(s, b, h) - (8 * b * s * h * h if early_stop else 0)
