"""How near a parallel result must be to one process's to count as equal, and why.

Both compute the same function in float32; they differ in the order of their sums (a matmul cut
over ranks adds its partial products in another order, an all-reduce adds the ranks' values in its
own order) and, on another CPU or under `ATEN_CPU_CAPABILITY`, in how vectorised kernels sum and
round exp or erf. Each rounds differently. To first order in ε, two orders of a sum of n terms
differ by at most n·ε·Σ|terms|, with ε = 2⁻²³ ≈ 1.19e-7, float32's machine epsilon (each order is
within (n − 1)·ε/2·Σ|terms| of the exact sum: Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., 2002, §4.2). So:

    float32_bound(terms, scale, steps)   ε × terms × scale × steps: for values of size `scale`,
                                         each a sum of at most `terms` terms, after `steps` such
                                         sums in a row (a rough allowance there: each layer also
                                         scales the error it receives)
    within(difference, bound)            the verdict a notebook prints: "within 10⁻⁷: True"
    agree(pairs, terms, steps)           every (got, expected) tensor within the bound scaled
                                         to that tensor's largest magnitude: True or False
    relative_verdict(ok, terms, steps)   how a notebook prints agree's answer

The scale is the result's largest magnitude, not the Σ|terms| of the bound above, which for sums of
mixed signs is larger (in lesson 08's four layers, the largest Σ|terms| is 3.9 to 5.4 times the
largest result: measured on 2026-12-01). The bound still holds, with room: in practice the rounding
errors of a sum are of either sign and mostly cancel, and grow like √n·ε·Σ|terms|, not n·ε·Σ|terms|
(Higham and Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput.
41(5), 2019); n·ε·max is at least that wherever Σ|terms| is within √n times the largest result (32
times, for 1024 terms). So a check counts its longest sum as `terms`, and the sums that feed one
another (layers, a ratio of two sums) as `steps`.

A wrong algorithm (a missing average, a wrong slice, a gradient added twice) moves a result by
its own size: far above a bound scaled to that size, which is why a bound must be scaled to the
values compared (a gradient of size 1e-5 next to an absolute 1e-5 bound proves nothing).

An optimizer can amplify rounding beyond any useful bound. AdamW divides each step by the
gradient's running size plus eps = 1e-8: for a gradient that is nearly zero (terms that cancel,
each rounded), float32 rounding (about 1e-7 of the terms' size) is larger than eps, and the step,
up to lr, goes where rounding sends it. Where two training runs must be equal step after step,
the course compares them in float64 (`reference.in_float64`): there rounding (about 1e-16 of the
terms' size) stays far below eps, each step can move a weight by only about lr × rounding / eps,
and `torch.testing.assert_close`'s float64 default (rtol 1e-7, atol 1e-7) holds; the course's
runs of 5 to 10 steps stay below 1e-13. Comparisons of one forward and backward in float32 use
assert_close's float32 default (rtol 1.3e-6, atol 1e-5): for the course's sums of at most a few
thousand terms whose sizes add up to about 1, typical rounding (~ε·√n, about 1e-5 at most) fits;
that is not a guarantee, and the tests check it on two sets of kernels (`make test`).
"""

from __future__ import annotations

import torch

EPSILON = torch.finfo(torch.float32).eps  # 2**-23


def float32_bound(terms: int, scale: float = 1.0, steps: int = 1) -> float:
    """ε × terms × scale × steps: how far two float32 computations of the same values may
    differ, when the values are of size `scale`, each a sum of at most `terms` terms, and
    `steps` such sums feed one another."""
    return EPSILON * terms * scale * steps


def within(difference: float, bound: float) -> str:
    """A verdict that reads the same on every machine: "within 10⁻⁷: True", "within 3.1 × 10⁻⁵:
    False". The measured `difference` itself is rounding noise, and is never printed."""
    return f"within {power_of_ten(bound)}: {difference <= bound}"


def power_of_ten(value: float) -> str:
    """1e-07 as "10⁻⁷", 3.05e-05 as "3.1 × 10⁻⁵": a bound, written so that it does not read
    like a measured number."""
    mantissa, exponent = f"{value:.1e}".split("e")
    power = "10" + str(int(exponent)).translate(str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹"))
    return power if mantissa == "1.0" else f"{mantissa} × {power}"


def agree(pairs, terms: int, steps: int = 1) -> bool:
    """Whether every (got, expected) pair of tensors differs by at most float32_bound(terms,
    scale, steps), with `scale` the largest magnitude in either: each tensor measured against
    its own size, a gradient of 1e-5 as strictly as an output of 1."""
    return all((got - expected).abs().max().item() <= float32_bound(
        terms, max(got.abs().max().item(), expected.abs().max().item()), steps)
        for got, expected in pairs)


def relative_verdict(ok: bool, terms: int, steps: int = 1) -> str:
    """How a notebook prints `agree`'s answer: "within 256 ε of each tensor's largest magnitude:
    True"."""
    return f"within {terms * steps} ε of each tensor's largest magnitude: {ok}"
