"""How long a step takes: the other half of sizing a run, estimated from FLOPs and bytes.

A model, not a measurement. Per GPU and step, for a layout (layouts.Plan) and the bytes a fake
run says rank 0 sends (accounting.account_worker's "sent", by collective):

    compute    the FLOPs this GPU computes: torchtitan's count per token (helpers.llama.
               flops_per_token: 6 x the parameters but the token embedding, and attention's
               12 l h q t) for its micro_batch x seq_len tokens, cut over tp, and what the
               recomputation runs again (`recomputed_flops_per_token`), at `efficiency` x the
               GPU's peak
    FSDP       the bytes of FSDP's collectives (its all-gathers and reduce-scatters, and HSDP's
               all-reduce) over the link they cross: within a host if every GPU of the layout is
               in one, else each GPU's own link between hosts. They overlap with compute: FSDP2
               prefetches the next block's weights and reduce-scatters the last one's gradients
               while this one computes
    TP         the bytes of DTensor's collectives over the link within a host: on the critical
               path, since each block's next operation needs what they bring

    step = max(compute, FSDP) + TP;  tokens per second per GPU = micro_batch x seq_len / (tp x step)

which is torchtitan's "TPS/GPU" (train.py at 9dec370: tokens / (seconds x non-data-parallel size)).
Left out: the first all-gather and the last reduce-scatter, which nothing hides; the optimizer's
step and the norm; kernels other than matrix products; the link's latency and the collectives'
own efficiency (the link's bytes per second are its peak); anything compile, Float8 or async TP
change.

- `Hardware(name, peak, inside, between, gpus_per_host)` and `TORCHTITAN_H100`: the hosts of
  torchtitan's December 2024 benchmark, each figure quoted from its source.
- `recomputed_flops_per_token(shape, seq_len, recompute)`: what backward runs again.
- `by_owner(sent)`: a fake run's bytes sent, (FSDP's, DTensor's).
- `estimate(shape, plan, sent, efficiency, hardware)`: a `StepTime`.
- `calibrate(shape, plan, sent, tokens_per_second, hardware)`: the efficiency at which the
  estimate equals a published throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from helpers.llama import flops_per_token


@dataclass(frozen=True)
class Hardware:
    name: str
    peak: float  # dense bfloat16 FLOP/s of one GPU
    inside: float  # bytes/s one GPU sends one way to the others of its host
    between: float  # bytes/s one GPU sends one way to other hosts
    gpus_per_host: int


# torchtitan's benchmark (pytorch/torchtitan@b5bcd76, benchmarks/llama3_h100_202412_torchtitan.md,
# "Hardware"): "Each host has 8 NVIDIA H100 GPUs fully connected with NVLink", "Hosts are
# inter-connected with backend RDMA network with 400 Gb/s per GPU" (50e9 bytes/s). Its peak:
# torchtitan's own for MFU, "for H100 SXM and other variants" 989e12 (torchtitan/utils.py at
# 9dec370, get_peak_flops; the benchmark's footnote 2: "we use the peak number of SXM directly").
# The link within a host, which the benchmark names only as NVLink: an H100 SXM's (the peak above
# is the SXM's), NVLink 4, 450 GBps one way (S. Bekman, Machine Learning Engineering,
# stas00/ml-engineering@744d01e, network/README.md, NVLink table; helpers.published).
TORCHTITAN_H100 = Hardware("torchtitan's H100 hosts (8 GPUs on NVLink 4, 400 Gb/s RDMA a GPU)",
                           peak=989e12, inside=450e9, between=400e9 / 8, gpus_per_host=8)


def recomputed_flops_per_token(shape, seq_len: int, recompute: str) -> int:
    """FLOPs per token that backward adds by recomputing (layouts.apply_ac's modes, a Llama's
    blocks): "op" runs again the products torchtitan's policy does not keep (the second, fourth
    and sixth of a block's seven: wk, wo and w3), "full" the block's forward but its last
    product (PyTorch's checkpoint stops once backward has all it needs, and w2's output is not
    among it) and attention's two products (4 d seq_len a token), "none" nothing. A product of
    a token by an m x n matrix is 2 m n FLOPs."""
    d, kv, f = shape.dim, shape.kv_dim, shape.ffn
    per_layer = {"none": 0,
                 "op": 2 * (d * kv + d * d + d * f),
                 "full": 2 * (2 * d * d + 2 * d * kv + 2 * d * f) + 4 * d * seq_len}
    if recompute not in per_layer:
        raise ValueError(f"recompute is one of {tuple(per_layer)}, not {recompute!r}")
    return shape.layers * per_layer[recompute]


@dataclass(frozen=True)
class StepTime:
    compute: float  # seconds
    fsdp: float  # seconds on the link, overlapped with compute
    tp: float  # seconds on the link, on the critical path
    tokens: int  # tokens a step, per GPU as torchtitan counts them (its dp rank's / tp)

    @property
    def seconds(self) -> float:
        return max(self.compute, self.fsdp) + self.tp

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    def __str__(self):
        return (f"{self.tokens_per_second:,.0f} tokens/s a GPU, {self.seconds:.2f} seconds a "
                f"step: compute {self.compute:.2f}, FSDP {self.fsdp:.2f} under it, tensor "
                f"parallelism {self.tp:.2f} after it")


def by_owner(sent: dict) -> tuple:
    """(FSDP's bytes, DTensor's bytes) of a fake run's {collective: bytes}."""
    tensor = sum(size for name, size in sent.items() if name.startswith("DTensor"))
    return sum(sent.values()) - tensor, tensor


def flops(shape, plan) -> float:
    """The FLOPs one GPU computes in a step of `plan`, recomputation included."""
    per_token = (flops_per_token(shape, plan.seq_len)
                 + recomputed_flops_per_token(shape, plan.seq_len, plan.recompute))
    return per_token * plan.micro_batch * plan.seq_len / plan.tp


def estimate(shape, plan, sent: dict, efficiency: float,
             hardware: Hardware = TORCHTITAN_H100) -> StepTime:
    """The step time of `plan` on `hardware` (the module docstring's model)."""
    fsdp, tensor = by_owner(sent)
    one_host = plan.gpus <= hardware.gpus_per_host
    return StepTime(compute=flops(shape, plan) / (efficiency * hardware.peak),
                    fsdp=fsdp / (hardware.inside if one_host else hardware.between),
                    tp=tensor / (hardware.inside if plan.tp <= hardware.gpus_per_host
                                 else hardware.between),
                    tokens=plan.micro_batch * plan.seq_len // plan.tp)


def calibrate(shape, plan, sent: dict, tokens_per_second: float,
              hardware: Hardware = TORCHTITAN_H100) -> float:
    """The efficiency (share of the peak) at which `estimate` gives `tokens_per_second`. Raises
    ValueError where the published step is no longer than its communication: compute is then
    hidden, and cannot be calibrated."""
    probe = estimate(shape, plan, sent, 1.0, hardware)
    compute = probe.tokens / tokens_per_second - probe.tp
    if compute <= probe.fsdp:
        raise ValueError(f"{plan}: at {tokens_per_second:,.0f} tokens/s a step takes "
                         f"{probe.tokens / tokens_per_second:.2f} s, no more than its "
                         "communication: nothing to calibrate compute on")
    return probe.compute / compute
