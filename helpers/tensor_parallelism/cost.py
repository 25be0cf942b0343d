"""What a tensor-parallel transformer layer computes and sends, by formula, and a projection of
both onto published hardware figures (lesson 08).

Per token, a layer's forward multiplies by q, k, v and out (4 h x h matrices, 2 FLOPs per
multiply-add: 8h^2) and by up and down (h x 4h each: 16h^2), and attention adds QK^T and the
weighted sum of V (2sh each): 24h^2 + 4sh = 24h^2 (1 + s/(6h)) FLOPs. Backward costs twice the
forward (a gradient for the input and one for the weight). With t ranks each does 1/t of it.

Each rank sends, per layer, forward and backward, four all-reduces of the activations (b s h
elements): 4 x 2(t-1)/t x b s h x bytes on a ring (lesson 04's bus bytes). Sequence parallelism
sends the same bytes as four all-gathers and four reduce-scatters.

`projected_layer_seconds` divides these by published peaks: a projection, not a measurement. It
ignores latency (alpha), assumes the link and the arithmetic run at their peaks and never
overlap; real runs reach less of both.
"""

from __future__ import annotations

from helpers.published import PUBLISHED_FLOPS, PUBLISHED_LINKS


def layer_flops(s: int, b: int, h: int) -> float:
    """Forward and backward FLOPs of one layer (all ranks together): 3 x 24 b s h^2 (1 + s/6h)."""
    return 3 * 24 * b * s * h ** 2 * (1 + s / (6 * h))


def layer_bytes_sent(s: int, b: int, h: int, t: int, bytes_per_element: int = 2) -> float:
    """Bytes each of the t ranks sends per layer, forward and backward: four all-reduces of the
    activations on a ring."""
    return 4 * 2 * (t - 1) / t * s * b * h * bytes_per_element


def _published(table, label):
    for name, value, _ in table:
        if name == label:
            return value
    raise KeyError(f"{label!r} is not among {[name for name, _, _ in table]}")


def projected_layer_seconds(s: int, b: int, h: int, t: int, link: str,
                            device: str = "NVIDIA H100 SXM, bf16") -> dict:
    """{'compute': s, 'communication': s} for one layer on each of t ranks, at the published peak
    FLOP/s of `device` and the published bytes/s of `link` (labels of lesson 04's tables)."""
    return {"compute": layer_flops(s, b, h) / t / _published(PUBLISHED_FLOPS, device),
            "communication": layer_bytes_sent(s, b, h, t) / _published(PUBLISHED_LINKS, link)}
