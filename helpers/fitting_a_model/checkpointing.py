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
                                            (recompute_in_backward: torch.utils.checkpoint), or
                                            "op", PyTorch's selective checkpointing with
                                            torchtitan's policy (layouts.keep_products)
    kept_bytes(block, x, mode, attention)   what autograd keeps in one block's forward, measured
    kept_alive(module, x, mode, every)      what a forward leaves alive, measured (instrument.
                                            created_storages: the selective-checkpointing cache
                                            too, which saved-tensor hooks do not see)
    kept_formula(s, b, h, a, mode, attention)   what a block keeps, by formula
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
import warnings

import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from helpers import reference, strategies
from helpers.instrument import alive_bytes, created_storages, saved_activations, saved_bytes
from helpers.launcher.result import get_device
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


def kept_alive(module, x, mode: str, every: int = 1, attention: str = "flash") -> int:
    """The bytes one forward of `module` (a copy, checkpointed by `mode` and `every`) leaves
    alive for backward, on `x` (a Block's input, or a batch of tokens for a TinyLM, whose loss
    is computed): the storages created in forward that still exist when it returns, whoever
    holds them, less the parameters and the output; the input counts where it is kept."""
    module = apply_ac(copy.deepcopy(module), mode, every=every)
    with sdpa_kernel(KERNELS[attention]), created_storages() as created:
        if isinstance(module, reference.TinyLM):
            out = reference.lm_loss(module(x.inputs), x.targets)
        else:
            out = module(x.clone())  # (created here, so kept only where the block keeps it)
    return alive_bytes(created, leave_out=[out, *module.parameters()])


def kept_formula(s: int, b: int, h: int, a: int, mode: str, attention: str = "flash") -> int:
    """What the course's Block keeps, in bytes (float32). none: lesson 08's block_formula, whose
    statistics include the flash kernel's log-sum-exp (b a s); the math kernel keeps the
    probabilities (a s x s per sequence) instead. selective: the core keeps nothing of its own
    (its inputs q, k, v are kept, and its output is the next layer's input). full: the input.
    op (layouts.keep_products): the input, and the outputs the policy keeps: of the six Linear
    products q, k, v, out, up, down the first, third and fifth (q, v and up's 4h), and with the
    flash kernel its output and log-sum-exp (the math kernel's products are not kept)."""
    if mode == "full":
        return 4 * s * b * h
    if mode == "op" and attention == "flash":  # one rank of one: no all-reduce to keep
        return int(kept_under_tensor_parallelism(s, b, h, a, 1, "op"))
    if mode == "op":  # without the flash kernel's output and log-sum-exp
        return 4 * s * b * h * (1 + 1 + 1 + 4)
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


def step_flops(model, batch, mode: str, early_stop: bool = True, every: int = 1) -> dict:
    """FLOPs of one forward and one backward of `model` (a copy, checkpointed by `mode`) on
    `batch`, counted by torch.utils.flop_counter.FlopCounterMode: {"forward", "total", "blocks"
    (the forward's FLOPs inside the blocks)}. Attention runs the math kernel, whose matrix
    products the counter sees (it has no formula for the CPU's flash kernel). `early_stop`:
    torch.utils.checkpoint's default, which stops recomputing once backward has every tensor it
    needs (set_checkpoint_early_stop)."""
    model = apply_ac(copy.deepcopy(model), mode, every=every)
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
    """The FLOPs backward adds per Block by recomputing: the block's forward (full), its core's
    (selective), or the products the op policy does not keep (op: k, out and down of the six
    Linear products, and the math kernel's two). Early stop ends the recomputation once every
    tensor the checkpointed function saved has been produced again; its last product saved its
    inputs before running, and nothing inside the function saves that product's output, so it
    is not run again: the MLP's `down` (2 b s 4h^2), the core's P v (2 b s^2 h) under selective
    recomputation. (Under op, P v's output is `out`'s input, which `out`, recomputed, keeps.)"""
    if mode == "none":
        return 0
    if mode == "op":  # k, out and down, and the math kernel's two products; early stop: no down
        return 2 * b * s * h * h * 2 + 4 * b * s * s * h + (0 if early_stop else 8 * b * s * h * h)
    if mode == "selective":
        return 2 * b * s * s * h * (1 if early_stop else 2)
    return block_forward_flops(s, b, h) - (8 * b * s * h * h if early_stop else 0)


def kept_under_tensor_parallelism(s: int, b: int, h: int, a: int, t: int, mode: str,
                                  element: int = 4) -> float:
    """What one of the course's Blocks keeps per rank under lesson 08's tensor-parallel plan
    over t ranks (no sequence parallelism), the flash kernel, tensors of `element` bytes. none:
    lesson 08's block_formula; selective: less the log-sum-exp; full: the input, whole on every
    rank; op (layouts.keep_products): the input, q, v, attention's output and up's 4h (cut over
    t), the log-sum-exp, and the outputs of the two all-reduces, whole, which the policy keeps so
    that recomputation need not communicate."""
    sbh = s * b * h
    logsumexp = b * a * s / t * element
    if mode == "full":
        return element * sbh
    if mode == "op":
        reduced = 2 * sbh if t > 1 else 0
        return element * (sbh + (1 + 1 + 1 + 4) * sbh / t + reduced) + logsumexp
    none = sum(block_formula(s, b, h, a, t).values()) / 4 * element
    return none - (logsumexp if mode == "selective" else 0)


COMPOSED = {"none": ("none", True), "selective": ("selective", True), "full": ("full", True),
            "full, no early stop": ("full", False), "op": ("op", True)}


def composed_worker(rank, world_size, model, batches, settings=tuple(COMPOSED)):
    """{setting: composed_setting(...)} for each of `settings` (COMPOSED's keys), one after the
    other in the same ranks."""
    return {setting: composed_setting(rank, world_size, model, batches, setting)
            for setting in settings}


def composed_setting(rank, world_size, model, batches, setting):
    """dp x tp = world_size/2 x 2 (strategies.build "dp_tp": layouts.lay_out, tensor
    parallelism, then activation checkpointing as COMPOSED[setting] says, then FSDP2) trains on
    `batches` with SGD. Returns the whole parameters; the collectives of the last step, counted
    by CommDebugMode, {(kind, "forward" or "step")}: FSDP2's all-gathers and reduce-scatters,
    tensor parallelism's all-reduces; the all-reduces of block 0's layers in backward, each
    layer's own; and the bytes the last forward left alive on this rank (instrument.
    created_storages, the weights and the loss left out)."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode, early_stop = COMPOSED[setting]
    module, optimizer = strategies.build("dp_tp", copy.deepcopy(model), recompute=mode,
                                         optimizer="sgd")
    shard, shards = rank // 2, world_size // 2  # the "dp" coordinate (default_mesh("dp_tp"))
    kinds = {"c10d._allgather_base_": "all-gather", "c10d._reduce_scatter_base_": "reduce-scatter",
             "c10d_functional.all_reduce": "all-reduce"}
    for batch in batches:
        local = batch.shard(shard, shards).to(get_device())
        optimizer.zero_grad()
        with CommDebugMode() as counted, set_checkpoint_early_stop(early_stop), \
                warnings.catch_warnings():
            # the TinyLM never changes FSDP2's output in place; CommDebugMode's module hooks
            # fire on the embedding's output, its input being token ids
            warnings.filterwarnings("ignore", message=".*returned a view tensor")
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            with created_storages() as created:
                loss = reference.lm_loss(module(local.inputs), local.targets)
            in_forward = dict(counted.get_comm_counts())
            weights = [param.to_local() if isinstance(param, DTensor) else param
                       for param in module.parameters()]  # (the root's: gathered until backward)
            # Every rank's collectives done before reading: under CI's load one rank has twice
            # read a few kilobytes more than the others, never reproduced alone (nor with three
            # copies of this test at once); the barrier is a guard, its cause is not known.
            dist.barrier()
            kept = alive_bytes(created, leave_out=[loss, *weights])
            loss.backward()
        optimizer.step()
    calls = {}
    for op, count in counted.get_comm_counts().items():
        if str(op) not in kinds:  # the barrier above
            continue
        calls[kinds[str(op)], "step"] = count
        calls[kinds[str(op)], "forward"] = in_forward.get(op, 0)
    in_block = {}  # block 0's layers: the all-reduces of the last backward, each layer's own
    for name, phases in counted.comm_module_counts.items():
        layer = name.split(".blocks.0.")[-1] if ".blocks.0." in name else ""
        reduced = sum(count for op, count in phases.get("backward", {}).items()
                      if "all_reduce" in str(op))
        if layer.count(".") == 1 and reduced:
            in_block[layer] = reduced
    return {"parameters": strategies.full_parameters(module), "calls": calls, "kept": kept,
            "block 0's backward all-reduces": dict(sorted(in_block.items()))}  # (a fixed order)
