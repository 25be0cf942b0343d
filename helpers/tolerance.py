"""How near a parallel result must be to one process's to count as equal, and why.

Both compute the same function in float32; they differ in the order of their sums. A matmul cut
over ranks adds its partial products in another order, an all-reduce adds the ranks' values in its
own order, and another CPU (or `ATEN_CPU_CAPABILITY`) sums with another vector width. Each order
rounds differently. Two orders of a sum of n terms differ by at most about n·ε·Σ|terms|, with
ε = 2⁻²³ ≈ 1.19e-7, float32's machine epsilon (each order is within (n − 1)·ε/2·Σ|terms| of the
exact sum: Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., 2002, §4.2). So:

    float32_bound(terms, scale, steps)   ε × terms × scale × steps: the largest difference that
                                         rounding explains, for values whose terms' sizes add up
                                         to `scale`, after `steps` such sums in a row
    within(difference, bound)            the verdict a notebook prints: "within 3.1e-05: True"

A wrong algorithm (a missing average, a wrong slice, a gradient added twice) moves a result by its
own size, orders of magnitude above such a bound.

An optimizer can amplify rounding beyond any useful bound. AdamW divides each step by the
gradient's running size, so a weight whose gradient is nearly zero (terms that cancel, each
rounded) moves by up to lr in a direction that rounding decides. Where two training runs must be
equal step after step, the course compares them in float64 (`reference.in_float64`): there ε is
2²⁹ ≈ 5e8 times finer, and `torch.testing.assert_close`'s float64 default (rtol 1e-7, atol 1e-7)
holds with many orders of magnitude to spare. Comparisons of one forward and backward in float32
use assert_close's float32 default (rtol 1.3e-6, atol 1e-5), which the course's sizes (sums of at
most a few thousand unit-sized terms, whose rounding errors add up like a random walk, ~ε·√n)
stay well inside.
"""

from __future__ import annotations

import torch

EPSILON = torch.finfo(torch.float32).eps  # 2**-23


def float32_bound(terms: int, scale: float = 1.0, steps: int = 1) -> float:
    """ε × terms × scale × steps: how far two float32 computations of the same values may
    differ, when each value is a sum of at most `terms` terms whose sizes add up to `scale`,
    and `steps` such sums feed one another."""
    return EPSILON * terms * scale * steps


def within(difference: float, bound: float) -> str:
    """A verdict that reads the same on every machine: "within 3.1e-05: True". The measured
    `difference` itself is rounding noise, and is never printed."""
    return f"within {bound:.1e}: {difference <= bound}"
