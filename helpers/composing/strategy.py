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
    activations    counted as Korthikanti et al. 2022 count them (section 4: the tensors each
                   operation keeps for its backward, per layer and micro-batch; section 4.1 does it
                   for a GPT layer), for the Llama layer that is named: no dropout, and an attention
                   kernel that keeps nothing of size s x s (a flash kernel, or FlexAttention,
                   torchtitan's default attention backend at b5bcd76,
                   torchtitan/models/llama3/__init__.py, model_registry); RMSNorm, q and grouped k
                   and v, SwiGLU's four tensors of width ffn (Model.kept_widths), in 16-bit
                   elements, and float32 statistics. With tensor and sequence parallelism every one
                   of them is cut t ways (by tokens outside the parallel regions, by heads or
                   columns inside), as Megatron-LM keeps them, gathering the column-parallel layers'
                   inputs again in backward (Korthikanti et al., section 4.2.2); layers that keep
                   the gathered inputs whole, as this course's sequence-parallel block does (lesson
                   08), keep 2 (1 - 1/t) sbh elements more per layer. Without recomputation, and
                   with selective recomputation (which recomputes attention's s x s core; a flash
                   kernel keeps none), a layer keeps all of them; with attention="math" the
                   softmax's output is kept too (heads x s per token). With torchtitan's op-level
                   policy ("op", pytorch/torchtitan@9dec370, parallelize_llama.py, _save_list:
                   every other matrix product's output and the attention kernel's) a layer keeps
                   its input, the outputs of wq, wv, w1 and w2, and attention's output, 16-bit,
                   and its log-sum-exp in float32: 2 (4h + kv + ffn) + 4 heads bytes a token,
                   the count lesson 13 checks against a fake run. With tensor and sequence
                   parallelism each is cut t ways but w2's output, a partial sum over every token
                   before its reduce-scatter, and the policy keeps the two reduce-scatters'
                   outputs too: 2 ((5h + kv + ffn)/t + h) + 4 heads/t bytes a token of the
                   micro-batch (tests/test_at_scale.py checks both on fake ranks, in the course's
                   layout, which is torchtitan's). With full recomputation a
                   layer keeps only its input, s/t tokens of it with sequence parallelism
                   (torchtitan's plan reduce-scatters each block's output to a shard of the tokens,
                   torchtitan@b5bcd76, torchtitan/models/llama3/sharding.py; Megatron-LM refuses
                   distribute_saved_activations with sequence parallelism, the input being split
                   already, NVIDIA/Megatron-LM@d98e8a6,
                   megatron/core/transformer/transformer_config.py), and while one layer is
                   recomputed in backward, that layer's tensors once. For the L / pp layers of the
                   stage, times the micro-batches in flight on the first stage under 1F1B (lesson
                   09: pp - r on rank r, so pp). In float32 training (precision="float32") every
                   16-bit tensor is 4 bytes
    data parallel  the gradients (2 bytes, or 4 in float32 or with reduce_bytes=4), on a ring:
                   ZeRO 0 and 1 accumulate whole gradients over the m micro-batches of a step and
                   send them once (an all-reduce, or a reduce-scatter and an all-gather of the
                   updated weights: 2 (dp - 1)/dp Psi' 2); ZeRO 2 keeps only its gradient shard,
                   so it reduce-scatters after every micro-batch's backward (m (dp - 1)/dp Psi' 2,
                   as lesson 07's stage-2 hook and DeepSpeed's stage 2 do) and all-gathers the
                   weights once; ZeRO 3 also all-gathers the weights in every micro-batch's
                   forward and backward (3 m (dp - 1)/dp Psi' 2). sync="last_micro_batch" is
                   lesson 11's other choice for 2 and 3 (FSDP2's set_requires_gradient_sync):
                   whole gradients held until the last micro-batch, in the reduce dtype (FSDP2
                   accumulates them in reduce_dtype), one reduce-scatter per step (ZeRO 3 still
                   gathers 2m times). ZeRO 2 and 3 only without pipeline stages:
                   DeepSpeed refuses them with its pipeline ("ZeRO-2 and ZeRO-3 are incompatible
                   with pipeline parallelism", microsoft/DeepSpeed@38327e0,
                   deepspeed/runtime/pipe/engine.py), and torch.distributed.pipelining keeps an
                   FSDP stage's weights and gradients whole between micro-batches
                   (torch/distributed/pipelining/stage.py)
    tensor         lesson 08's layer_bytes_sent (four all-reduces of s b h per layer: with sequence
                   parallelism, an all-gather and a reduce-scatter for each) and one more, the
                   all-gather of each column-parallel layer's input that Megatron-LM repeats in
                   backward (Korthikanti et al., section 4.2.2), so five, for each layer of the
                   stage and each micro-batch; under full recomputation the forward's two run
                   again in backward, seven in all. These are Megatron-LM's counts: DTensor's
                   layers (torchtitan's plan) keep the gathered inputs, and send 4, 5 and 5.5
                   without, with op-level and with full recomputation (lesson 13 measures them)
    pipeline       each micro-batch's activation forward and its gradient back, this rank's s / t
                   tokens of it (with sequence parallelism, as Megatron-LM sends them), 2 bytes
                   each; a stage with neighbours on both sides sends both, an end stage one (the
                   busiest GPU is counted)
The model shapes are torchtitan's (pytorch/torchtitan@b5bcd76, torchtitan/models/llama3/
__init__.py, llama3_configs "8B" and "70B", _8b() and _70b(), vocabulary 128,256), with their
SwiGLU hidden size from compute_ffn_hidden_dim: int(1.3 int(2 4d / 3)) rounded up to a multiple of
1024 (8B) or 4096 (70B). The memory per GPU is the H100 SXM's 80 GiB (S. Bekman, "Machine
Learning Engineering", stas00/ml-engineering@744d01e, compute/accelerator/README.md: "the 80GiB
H100-SXM").
`seconds` divides each kind's bytes by a published link (lesson 04's table): tensor parallelism
inside a machine over NVLink 4, the rest between machines over one InfiniBand NDR400 port per GPU
(all of it over NVLink when the layout fits in one machine of 8 GPUs); bandwidth only, nothing
overlapped. It ranks the layouts; it is not a step time. Gradients are reduced in 2 bytes
(Megatron Core's DistributedDataParallelConfig default, grad_reduce_in_fp32=False,
NVIDIA/Megatron-LM@d98e8a6, megatron/core/distributed/distributed_data_parallel_config.py);
Megatron-LM's training script with --bf16 reduces them in float32, twice the bytes on the wire,
unless given --grad-reduce-in-bf16 (megatron/training/arguments.py).
Left out, and sized by `left_out`: the logits, their float32 upcast and gradient, and ZeRO-3's
gathered layers, whole gradients, embedding and head. Not sized: each operation's backward
temporaries, what a GPU's caching allocator reserves beyond the tensors alive (a pool per stream,
fragmentation; lesson 13), and the wait of a pipeline's bubble. The CUDA and NCCL contexts lie
outside the allocator: they take from the GPU's memory, not from what the allocator reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from helpers.llama import Shape, swiglu_hidden
from helpers.published import PUBLISHED_LINKS
from helpers.strategies import SYNC  # when ZeRO-2 and 3 reduce-scatter
from helpers.tensor_parallelism.cost import layer_bytes_sent
from helpers.zero_and_fsdp.memory import bytes_per_rank

GPU_MEMORY = 80 * 2**30  # H100 SXM, bytes (ml-engineering, compute/accelerator/README.md)
RECOMPUTATION = ("none", "selective", "op", "full")
RECOMPUTATION_LABELS = {"none": "no recomputation", "selective": "selective recomputation",
                        "op": "op-level recomputation (torchtitan's)",
                        "full": "full recomputation"}
ATTENTION = ("flash", "math")
INSIDE, BETWEEN = "NVLink 4 (H100, H200)", "InfiniBand NDR400, one port"  # lesson 04's labels
GPUS_PER_MACHINE = 8
FLOAT32 = 4  # bytes: attention's log-sum-exp and RMSNorm's statistic stay in float32


def _link(label: str) -> float:
    return next(value for name, value, _ in PUBLISHED_LINKS if name == label)


@dataclass(frozen=True)
class Model(Shape):
    """A Llama 3 shape (helpers.llama.Shape: layers, dim, heads, kv_heads, ffn, vocab), named,
    and what the projection counts of it."""

    name: str = ""

    def parameters(self) -> int:
        """Token embedding and output head (untied), and per layer: q and o (d x d), k and v
        (d x kv_heads head_dim), SwiGLU's three matrices (d x ffn), two RMSNorm weights; a final
        RMSNorm."""
        return 2 * self.embedding() + self.layers * self.layer() + self.dim

    def layer(self) -> int:
        return (2 * self.dim * self.dim + 2 * self.dim * self.kv_dim
                + 3 * self.dim * self.ffn + 2 * self.dim)

    def embedding(self) -> int:
        return self.vocab * self.dim

    def first_stage(self, tp: int, pp: int) -> float:
        """The parameters one GPU of the first pipeline stage holds: its layers and the token
        embedding (with one stage, every parameter), cut over tp."""
        if pp == 1:
            return self.parameters() / tp
        return (self.layers / pp * self.layer() + self.embedding()) / tp

    def kept_per_token(self, element: int = 2, attention: str = "flash",
                       seq_len: int = 0) -> float:
        """Bytes one layer keeps for backward per token, without recomputation: the tensors of
        `kept_widths` in `element` bytes, and float32 statistics. With the "math" attention
        kernel, also the softmax's output, heads x seq_len per token."""
        if attention not in ATTENTION:
            raise ValueError(f"attention is one of {ATTENTION}, not {attention!r}")
        widths = sum(self.kept_widths().values())
        statistics = FLOAT32 * (self.heads + 2)  # log-sum-exp per head; two norms' 1/rms
        scores = self.heads * seq_len * element if attention == "math" else 0
        return widths * element + statistics + scores

    def kept_by_op_policy(self, element: int = 2, tp: int = 1) -> float:
        """Bytes one layer keeps for backward per token of the micro-batch under torchtitan's
        op-level policy (the module docstring): its input, the outputs of wq, wv, w1, w2 and
        attention, in `element` bytes, and attention's log-sum-exp per head in float32; over
        tp > 1, each cut tp ways but w2's output (whole before its reduce-scatter), and the two
        reduce-scatters' outputs besides."""
        d, kv, f = self.dim, self.kv_dim, self.ffn
        widths = 4 * d + kv + f if tp == 1 else (5 * d + kv + f) / tp + d
        return widths * element + FLOAT32 * self.heads / tp

    def kept_widths(self) -> dict:
        """The elements per token of each 16-bit tensor a Llama layer keeps for backward with a
        flash attention kernel and no dropout: what each operation's backward needs (a norm its
        input, a matmul its input, silu its input, a product both factors, the kernel q, k, v and
        its output); the residual additions keep nothing."""
        d, kv, f = self.dim, self.kv_dim, self.ffn
        return {"the two norms' inputs": 2 * d, "the two norms' outputs (the matmuls' input)":
                2 * d, "q": d, "k and v": 2 * kv, "attention's output": d,
                "SwiGLU: w1's and w3's outputs, silu's output, their product": 4 * f}


MODELS = {model.name: model for model in (
    Model(layers=32, dim=4096, heads=32, kv_heads=8, ffn=swiglu_hidden(4096, 1024, 1.3),
          vocab=128256, name="Llama 3 8B"),
    Model(layers=80, dim=8192, heads=64, kv_heads=8, ffn=swiglu_hidden(8192, 4096, 1.3),
          vocab=128256, name="Llama 3 70B"))}


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
            reduce_bytes: int | None = None, sync: str = "each_micro_batch",
            attention: str = "flash", gpu_memory: float = GPU_MEMORY) -> dict:
    """Per GPU, in bytes: {"weights", "gradients", "optimizer", "activations", "memory", "fits",
    "data parallel", "tensor parallel", "pipeline", "sent", "seconds", "micro_batches"};
    `global_batch` sequences of `seq_len` tokens per step, cut into micro-batches of
    `micro_batch` sequences on each data-parallel rank. `precision`: "mixed" or "float32"
    (lesson 07's bytes per parameter); `reduce_bytes`: the gradients' bytes on the wire (default:
    2 in mixed precision, 4 in float32); `sync`: when ZeRO-2 and 3 reduce-scatter (SYNC);
    `attention`: a "flash" kernel, or "math", which keeps the softmax. A projection (see the
    module docstring)."""
    if recomputation not in RECOMPUTATION:
        raise ValueError(f"recomputation is one of {RECOMPUTATION}, not {recomputation!r}")
    if sync not in SYNC:
        raise ValueError(f"sync is one of {SYNC}, not {sync!r}")
    shard = model.first_stage(layout.tp, layout.pp)
    states = bytes_per_rank(shard, layout.dp, layout.zero, precision=precision)
    element = 2 if precision == "mixed" else 4  # a 16-bit or a float32 weight or activation
    deferred = sync == "last_micro_batch" and layout.zero >= 2
    if deferred:  # whole gradients accumulate until the last micro-batch, in the reduce dtype
        states["gradients"] = shard * (reduce_bytes or element)
    layers = model.layers / layout.pp
    micro_batches = global_batch / (layout.dp * micro_batch)
    in_flight = min(layout.pp, micro_batches)
    tokens = seq_len * micro_batch / layout.tp  # this rank's, with sequence parallelism
    kept = {kind: model.kept_per_token(element, kind, seq_len) * tokens for kind in ATTENTION}
    if recomputation == "none":
        activations = kept[attention] * layers * in_flight
    elif recomputation == "selective":  # attention's core recomputed: nothing s x s is kept
        activations = kept["flash"] * layers * in_flight
    elif recomputation == "op":  # per token of the micro-batch (the method says why)
        activations = (model.kept_by_op_policy(element, layout.tp) * seq_len * micro_batch
                       * layers * in_flight)
    else:  # each layer's input, s/t tokens of it, and one layer at a time while recomputed
        activations = tokens * model.dim * element * layers * in_flight + kept[attention]
    ring = (layout.dp - 1) / layout.dp * shard  # elements one ring pass sends
    gradients, weights = ring * (reduce_bytes or element), ring * element
    reduce_scatters = 1 if deferred else micro_batches
    data = {0: 2 * gradients, 1: gradients + weights, 2: reduce_scatters * gradients + weights,
            3: 2 * micro_batches * weights + reduce_scatters * gradients}[layout.zero]
    # four all-reduces' worth per layer, a fifth for the inputs gathered again in backward, and
    # two more where full recomputation runs the forward again (module docstring)
    all_reduces = 5 + (2 if recomputation == "full" else 0)
    tensor = layer_bytes_sent(seq_len, micro_batch, model.dim, layout.tp, element) * layers \
        * micro_batches * all_reduces / 4
    messages = 0 if layout.pp == 1 else (1 if layout.pp == 2 else 2)
    pipeline = messages * tokens * model.dim * element * micro_batches
    memory = states["weights"] + states["gradients"] + states["optimizer"] + activations
    return {"weights": states["weights"], "gradients": states["gradients"],
            "optimizer": states["optimizer"], "activations": activations, "memory": memory,
            "fits": memory <= gpu_memory, "data parallel": data, "tensor parallel": tensor,
            "pipeline": pipeline, "sent": data + tensor + pipeline,
            "micro_batches": micro_batches,
            "seconds": tensor / _link(INSIDE) + (data + pipeline) / _link(
                INSIDE if layout.gpus <= GPUS_PER_MACHINE else BETWEEN)}


def left_out(model: Model, layout: Layout, seq_len: int = 4096, micro_batch: int = 1,
             precision: str = "mixed", reduce_bytes: int | None = None,
             loss_parallel: bool = True) -> dict:
    """What `project` leaves out, sized by formula (bytes per GPU; these are not all alive at
    once): the output head's logits for one micro-batch (cut over tp when the loss is computed
    vocabulary-parallel, torchtitan's default), their float32 upcast and its gradient; and under
    ZeRO-3 the weights it gathers: the current layer and the one prefetched, one layer's whole
    gradients (and their copy in the reduce dtype), the embedding and the head."""
    element = 2 if precision == "mixed" else 4
    reduce = reduce_bytes or element
    vocab = model.vocab / (layout.tp if loss_parallel else 1)
    logits = seq_len * micro_batch * vocab
    parts = {"logits": logits * element, "logits upcast to float32": logits * FLOAT32,
             "the logits' float32 gradient": logits * FLOAT32}
    if layout.zero == 3:
        layer = model.layer() / layout.tp
        parts["the current and the prefetched layer, gathered"] = 2 * layer * element
        parts["one layer's whole gradients"] = layer * element
        if reduce != element:
            parts[f"the same in the reduce dtype ({reduce} bytes)"] = layer * reduce
        parts["the embedding and the head, gathered"] = 2 * model.embedding() / layout.tp * element
    return parts


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
    """(layout, projection) for every layout that fits in GPU_MEMORY, least link time first (on
    a tie, least memory first)."""
    rows = [(layout, project(model, layout, **kwargs)) for layout in layouts(model, gpus)]
    return sorted(((layout, row) for layout, row in rows if row["fits"]),
                  key=lambda item: (round(item[1]["seconds"], 9), item[1]["memory"]))


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
