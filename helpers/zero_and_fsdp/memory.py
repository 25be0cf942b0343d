"""Where the memory of training goes, per rank (lesson 07, notebooks/07_zero_and_fsdp.ipynb).

Training with Adam keeps, per parameter:
  float32 training         4 (weights) + 4 (gradients) + 8 (Adam's two moments)       = 16 bytes
  mixed precision (ZeRO)   2 (fp16 weights) + 2 (fp16 gradients) + K = 12 (float32
                           master weights 4, momentum 4, variance 4)                  = 16 bytes
The second is the accounting of Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models" (SC 2020; arXiv 1910.02054, section 3.1 and Figure 1). With Psi
parameters on n ranks, each stage shards one more part (the paper's P_os, P_os+g, P_os+g+p):
  stage 0 (data parallelism)  weights + gradients + optimizer state
  stage 1                     weights + gradients + optimizer state / n
  stage 2                     weights + (gradients + optimizer state) / n
  stage 3                     (weights + gradients + optimizer state) / n
These count model states only: activations, temporary buffers and fragmentation come on top.
"""

from __future__ import annotations

BYTES_PER_PARAMETER = {
    "float32": {"weights": 4, "gradients": 4, "optimizer": 8},
    "mixed": {"weights": 2, "gradients": 2, "optimizer": 12},
}
PARTS = ("weights", "gradients", "optimizer")
# From which stage on each part is sharded.
SHARDED_FROM = {"optimizer": 1, "gradients": 2, "weights": 3}


def bytes_per_rank(num_parameters: float, world_size: int, stage: int,
                   precision: str = "float32") -> dict:
    """The model-state bytes one rank holds: {"weights", "gradients", "optimizer", "total"}."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (data parallelism), 1, 2 or 3, got {stage!r}")
    per_parameter = BYTES_PER_PARAMETER[precision]
    held = {}
    for part in PARTS:
        whole = per_parameter[part] * num_parameters
        held[part] = whole / world_size if stage >= SHARDED_FROM[part] else whole
    held["total"] = sum(held[part] for part in PARTS)
    return held


def largest_model(memory_bytes: float, world_size: int, stage: int,
                  precision: str = "float32") -> float:
    """The most parameters whose model states fit in `memory_bytes` per rank."""
    return memory_bytes / bytes_per_rank(1, world_size, stage, precision)["total"]
