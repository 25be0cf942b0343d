"""The course's cost model of communication, used from lesson 04 on: the bytes a collective
moves per rank, and the alpha-beta model of its time.

The bandwidths follow nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): S is the size
of the whole array (for all_gather the gathered output, for reduce_scatter the input),
algbw = S / t, and busbw = algbw * factor(n), the factor making busbw comparable with the
hardware's link bandwidth whatever the collective and the number of ranks. On a ring, factor(n)
* S is also the bytes each rank sends.

    BUSBW_FACTORS[op](n)                  nccl-tests' factor, by collective
    bus_bytes(op, n, size_bytes)          the bytes each rank sends on a ring; `op` may also be
                                          torch.distributed's name (all_gather_single, ...)
    bandwidths(op, n, size, seconds)      algbw and busbw of one measurement
    fit_alpha_beta(records)               t = alpha + S_bus / beta, fitted to measurements
    model_seconds(alpha, beta, op, n, S)  the model's time for one call
"""

from __future__ import annotations

import numpy as np

BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
OPERATIONS = list(BUSBW_FACTORS)

# torch.distributed's functions that run the same collectives on one flat tensor
TORCH_NAMES = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
               "all_to_all_single": "all_to_all"}


def bus_bytes(op: str, world_size: int, size_bytes: float) -> float:
    """The bytes each rank sends on a ring for `op` on an array of `size_bytes` (S above)."""
    return BUSBW_FACTORS[TORCH_NAMES.get(op, op)](world_size) * size_bytes


def bandwidths(op: str, world_size: int, size_bytes: int, seconds: float) -> dict:
    """algbw and busbw in bytes/s for one measurement, with nccl-tests' factors."""
    algbw = size_bytes / seconds
    return {"op": op, "world_size": world_size, "size_bytes": size_bytes, "seconds": seconds,
            "algbw": algbw, "busbw": algbw * BUSBW_FACTORS[op](world_size)}


def fit_alpha_beta(records, relative: bool = True) -> tuple:
    """Fit t = alpha + S_bus / beta (the alpha-beta model) to measurements, where S_bus = S *
    factor(n) is the data each rank must move. Least squares on the *relative* error by default,
    so the microsecond-scale small messages count as much as the large ones; `relative=False`
    minimises the error in seconds, the right choice for predicting the sum of many calls.
    Returns (alpha seconds, beta bytes/s)."""
    bus = np.array([r["busbw"] / r["algbw"] * r["size_bytes"] for r in records])
    seconds = np.array([r["seconds"] for r in records])
    weights = 1 / seconds if relative else np.ones_like(seconds)
    design = np.stack([np.ones_like(bus), bus], axis=1) * weights[:, None]
    (alpha, inverse_beta), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    return float(alpha), float(1 / inverse_beta)


def model_seconds(alpha, beta, op, world_size, size_bytes):
    """The alpha-beta model's time for `op` on an array of `size_bytes`."""
    return alpha + bus_bytes(op, world_size, size_bytes) / beta
