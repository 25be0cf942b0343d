"""Which combination of data, tensor and pipeline parallelism fits, for real model sizes: a
projection from the formulas lessons 06-10 verified on small models (lesson 10).

Nothing here is measured: it is arithmetic on published model shapes and the course's formulas,
and every output is a projection. Per GPU, for a layout dp x tp x pp (and a ZeRO stage over dp),
on the first pipeline stage, which holds the embedding and keeps the most micro-batches:

    model states   lesson 07's bytes_per_rank (Rajbhandari et al. 2020, mixed precision: 2 + 2 + 12
                   bytes per parameter) for the stage's parameters: 1/pp of the layers and the
                   token embedding (Korthikanti et al. 2022, section 4.2.3: the first stage also
                   holds it), each cut over tp (Megatron-LM's vocabulary-parallel embedding),
                   sharded over dp from the ZeRO stage on
    activations    Korthikanti et al. 2022, Table 2, per layer and micro-batch, with tensor and
                   sequence parallelism: without recomputation s b h (34 / t + 5 a s / (h t))
                   bytes (the 5as/h term is attention's s x s softmax output, 2 bytes, its dropout
                   mask, 1 byte, and the dropout's output, 2 bytes);
                   with selective recomputation 34 s b h / t; with full recomputation 2 s b h
                   (the layer's input only) and, while one layer is recomputed in backward, its
                   34 s b h / t once. For the L / pp layers of the stage, times the micro-batches
                   in flight on the first stage under 1F1B (lesson 09: pp - r on rank r, so pp).
                   Table 2 counts 2-byte activations and 1-byte dropout masks: in float32
                   training (precision="float32") the projection doubles all of it, an upper
                   bound
    data parallel  the gradients (2 bytes, or 4 in float32 or with reduce_bytes=4), on a ring:
                   ZeRO 0 and 1 accumulate whole gradients over the m micro-batches of a step and
                   send them once (an all-reduce, or a reduce-scatter and an all-gather of the
                   updated weights: 2 (dp - 1)/dp Psi' 2); ZeRO 2 keeps only its gradient shard,
                   so it reduce-scatters after every micro-batch's backward (m (dp - 1)/dp Psi' 2,
                   as lesson 07's stage-2 hook and DeepSpeed's stage 2 do) and all-gathers the
                   weights once; ZeRO 3 also all-gathers the weights in every micro-batch's
                   forward and backward (3 m (dp - 1)/dp Psi' 2). sync="last_micro_batch" is
                   lesson 11's other choice for 2 and 3 (FSDP2's set_requires_gradient_sync):
                   whole gradients held until the last micro-batch, one reduce-scatter per step
                   (ZeRO 3 still gathers 2m times). ZeRO 2 and 3 only without pipeline stages:
                   DeepSpeed refuses them with its pipeline ("ZeRO-2 and ZeRO-3 are incompatible
                   with pipeline parallelism", microsoft/DeepSpeed@38327e0,
                   deepspeed/runtime/pipe/engine.py), and torch.distributed.pipelining keeps an
                   FSDP stage's weights and gradients whole between micro-batches
                   (torch/distributed/pipelining/stage.py)
    tensor         lesson 08's layer_bytes_sent (four all-reduces of s b h per layer) for each layer
                   of the stage and each micro-batch
    pipeline       each micro-batch's activation forward and its gradient back, this rank's s / t
                   tokens of it (with sequence parallelism, as Megatron-LM sends them), 2 bytes
                   each; a stage with neighbours on both sides sends both, an end stage one (the
                   busiest GPU is counted)
The model shapes are torchtitan's (pytorch/torchtitan, torchtitan/models/llama3/__init__.py,
llama3_configs "8B" and "70B"; the vocabulary from Llama3Model.Config in model.py), with their
SwiGLU hidden size from compute_ffn_hidden_dim: int(1.3 int(2 4d / 3)) rounded up to a multiple of
1024 (8B) or 4096 (70B). The memory per GPU is the H100 SXM's 80 GiB (S. Bekman, "Machine
Learning Engineering", stas00/ml-engineering@744d01e, compute/accelerator/README.md: "the 80GiB
H100-SXM").
`seconds` divides each kind's bytes by a published link (lesson 04's table): tensor parallelism
inside a machine over NVLink 4, the rest between machines over one InfiniBand NDR400 port per GPU
(all of it over NVLink when the layout fits in one machine of 8 GPUs); bandwidth only, nothing
overlapped. It ranks the layouts; it is not a step time. Gradients are reduced in 2 bytes
(Megatron Core's DistributedDataParallelConfig default, grad_reduce_in_fp32=False); Megatron-LM's
training script with --bf16 reduces them in float32 unless given --grad-reduce-in-bf16, which
doubles the data-parallel bytes.
The activation count is Korthikanti et al.'s for a GPT block (a 4h GeLU MLP, LayerNorm, dropout,
multi-head attention); Llama's SwiGLU MLP, grouped-query attention and RMSNorm differ from it, so
for Llama it is an approximation.
Left out: temporary buffers, the all-gathered weights of ZeRO-3, fragmentation, the embedding's
and head's extra activations, and the wait of a pipeline's bubble.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from helpers.published import PUBLISHED_LINKS
from helpers.strategies import SYNC  # when ZeRO-2 and 3 reduce-scatter
from helpers.tensor_parallelism.cost import layer_bytes_sent
from helpers.zero_and_fsdp.memory import bytes_per_rank

GPU_MEMORY = 80 * 2**30  # H100 SXM, bytes (ml-engineering, compute/accelerator/README.md)
RECOMPUTATION = ("none", "selective", "full")
RECOMPUTATION_LABELS = {"none": "no recomputation", "selective": "selective recomputation",
                        "full": "full recomputation"}
INSIDE, BETWEEN = "NVLink 4 (H100, H200)", "InfiniBand NDR400, one port"  # lesson 04's labels
GPUS_PER_MACHINE = 8


def _link(label: str) -> float:
    return next(value for name, value, _ in PUBLISHED_LINKS if name == label)


def swiglu_hidden(dim: int, multiple_of: int, multiplier: float) -> int:
    """torchtitan's compute_ffn_hidden_dim, as its llama3 configs call it."""
    hidden = int(multiplier * int(2 * 4 * dim / 3))
    return multiple_of * math.ceil(hidden / multiple_of)


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    def parameters(self) -> int:
        """Token embedding and output head (untied), and per layer: q and o (d x d), k and v
        (d x kv_heads head_dim), SwiGLU's three matrices (d x ffn), two RMSNorm weights; a final
        RMSNorm."""
        return 2 * self.embedding() + self.layers * self.layer() + self.dim

    def layer(self) -> int:
        kv = self.kv_heads * self.dim // self.heads
        return 2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.ffn + 2 * self.dim

    def embedding(self) -> int:
        return self.vocab * self.dim

    def first_stage(self, tp: int, pp: int) -> float:
        """The parameters one GPU of the first pipeline stage holds: its layers and the token
        embedding (with one stage, every parameter), cut over tp."""
        if pp == 1:
            return self.parameters() / tp
        return (self.layers / pp * self.layer() + self.embedding()) / tp


MODELS = {
    "Llama 3 8B": Model("Llama 3 8B", 32, 4096, 32, 8, swiglu_hidden(4096, 1024, 1.3), 128256),
    "Llama 3 70B": Model("Llama 3 70B", 80, 8192, 64, 8, swiglu_hidden(8192, 4096, 1.3),
                         128256),
}


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: int = 0

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self):
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp}, ZeRO-{self.zero}"


def project(model: Model, layout: Layout, seq_len: int = 4096, micro_batch: int = 1,
            global_batch: int = 1024, recomputation: str = "selective", precision: str = "mixed",
            reduce_bytes: int | None = None, sync: str = "each_micro_batch") -> dict:
    """Per GPU, in bytes: {"weights", "gradients", "optimizer", "activations", "memory", "fits",
    "data parallel", "tensor parallel", "pipeline", "sent", "seconds"}; `global_batch` sequences
    per step, cut into micro-batches of `micro_batch` on each data-parallel rank. `precision`:
    "mixed" or "float32" (lesson 07's bytes per parameter); `reduce_bytes`: the gradients'
    bytes on the wire (default: 2 in mixed precision, 4 in float32); `sync`: when ZeRO-2 and 3
    reduce-scatter (SYNC). A projection (see the module docstring)."""
    if recomputation not in RECOMPUTATION:
        raise ValueError(f"recomputation is one of {RECOMPUTATION}, not {recomputation!r}")
    if sync not in SYNC:
        raise ValueError(f"sync is one of {SYNC}, not {sync!r}")
    shard = model.first_stage(layout.tp, layout.pp)
    states = bytes_per_rank(shard, layout.dp, layout.zero, precision=precision)
    element = 2 if precision == "mixed" else 4  # a 16-bit or a float32 weight or activation
    deferred = sync == "last_micro_batch" and layout.zero >= 2
    if deferred:  # whole gradients accumulate until the last micro-batch
        states["gradients"] = bytes_per_rank(shard, layout.dp, 1, precision)["gradients"]
    layers = model.layers / layout.pp
    micro_batches = global_batch / (layout.dp * micro_batch)
    in_flight = min(layout.pp, micro_batches)
    sbh = seq_len * micro_batch * model.dim
    selective = 34 * sbh / layout.tp * element / 2  # one layer, one micro-batch
    if recomputation == "none":
        scores = 5 * model.heads * seq_len / model.dim
        activations = (34 + scores) * sbh / layout.tp * element / 2 * layers * in_flight
    elif recomputation == "selective":
        activations = selective * layers * in_flight
    else:
        activations = 2 * sbh * element / 2 * layers * in_flight + selective
    ring = (layout.dp - 1) / layout.dp * shard  # elements one ring pass sends
    gradients, weights = ring * (reduce_bytes or element), ring * element
    reduce_scatters = 1 if deferred else micro_batches
    data = {0: 2 * gradients, 1: gradients + weights, 2: reduce_scatters * gradients + weights,
            3: 2 * micro_batches * weights + reduce_scatters * gradients}[layout.zero]
    tensor = layer_bytes_sent(seq_len, micro_batch, model.dim, layout.tp, element) * layers \
        * micro_batches
    messages = 0 if layout.pp == 1 else (1 if layout.pp == 2 else 2)
    pipeline = messages * sbh / layout.tp * element * micro_batches
    memory = states["weights"] + states["gradients"] + states["optimizer"] + activations
    return {"weights": states["weights"], "gradients": states["gradients"],
            "optimizer": states["optimizer"], "activations": activations, "memory": memory,
            "fits": memory <= GPU_MEMORY, "data parallel": data, "tensor parallel": tensor,
            "pipeline": pipeline, "sent": data + tensor + pipeline,
            "seconds": tensor / _link(INSIDE) + (data + pipeline) / _link(
                INSIDE if layout.gpus <= GPUS_PER_MACHINE else BETWEEN)}


def layouts(model: Model, gpus: int, max_tp: int = 8) -> list:
    """Every dp x tp x pp = gpus with tp a power of two up to `max_tp` (one machine's GPUs) that
    divides the heads, pp dividing the layers, and each ZeRO stage an implementation offers:
    only 0 without dp, and 2 and 3 only without pipeline stages (see the module docstring)."""
    found = []
    tp = 1
    while tp <= min(max_tp, gpus):
        for pp in range(1, gpus // tp + 1):
            if (gpus // tp) % pp or model.layers % pp or model.heads % tp:
                continue
            dp = gpus // (tp * pp)
            stages = (0,) if dp == 1 else (0, 1) if pp > 1 else (0, 1, 2, 3)
            for zero in stages:
                found.append(Layout(dp, tp, pp, zero))
        tp *= 2
    return found


def table(model: Model, gpus: int, **kwargs) -> list:
    """(layout, projection) for every layout that fits in GPU_MEMORY, least link time first."""
    rows = [(layout, project(model, layout, **kwargs)) for layout in layouts(model, gpus)]
    return sorted(((layout, row) for layout, row in rows if row["fits"]),
                  key=lambda item: item[1]["seconds"])


def describe(model: Model, gpus: int, top: int = 5, **kwargs) -> str:
    """The `top` fitting layouts as text: memory, bytes sent and link seconds per GPU per step;
    when none fits, what is short, computed from the layout that needs the least memory."""
    fitting, every = table(model, gpus, **kwargs), layouts(model, gpus)
    recomputation = kwargs.get("recomputation", "selective")
    lines = [f"{model.name} ({model.parameters() / 1e9:.2f} B parameters) on {gpus} GPUs of "
             f"{GPU_MEMORY / 2**30:.0f} GiB, {RECOMPUTATION_LABELS[recomputation]}: "
             f"{len(fitting)} of {len(every)} layouts fit (a projection, not a measurement)"]
    for layout, row in fitting[:top]:
        lines.append(f"  {str(layout):34s} {row['memory'] / 2**30:5.1f} GiB; sends dp "
                     f"{row['data parallel'] / 1e9:6.1f} + tp {row['tensor parallel'] / 1e9:6.1f}"
                     f" + pp {row['pipeline'] / 1e9:5.1f} GB: {row['seconds']:5.2f} s on links")
    if not fitting:
        lines.append("  none: " + shortfall(model, gpus, **kwargs))
    return "\n".join(lines)


def shortfall(model: Model, gpus: int, **kwargs) -> str:
    """Why no layout fits: the model states alone, or the activations on top of them."""
    rows = [project(model, layout, **kwargs) for layout in layouts(model, gpus)]
    states = min(row["memory"] - row["activations"] for row in rows)
    if states > GPU_MEMORY:
        return (f"the model states alone need at least {states / 2**30:.0f} GiB per GPU in every "
                "layout: more GPUs, or fewer bytes of state per parameter (offloading them to "
                "CPU memory); neither recomputation nor a smaller micro-batch can help")
    least = min(rows, key=lambda row: row["memory"])
    return (f"the least memory, {least['memory'] / 2**30:.0f} GiB, is "
            f"{least['activations'] / 2**30:.0f} GiB of activations on the states: a smaller "
            "micro-batch, or full recomputation")
