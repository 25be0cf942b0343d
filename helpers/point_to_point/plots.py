"""Lesson 02's pictures: the send/recv chain. Its timelines use `helpers.drawing.plot_timelines`."""

from __future__ import annotations

import matplotlib.pyplot as plt

from helpers.drawing import color, rank_box


def plot_chain(results: list):
    """The send/recv chain: what each rank received from its left and holds after doubling."""
    fig, ax = plt.subplots(figsize=(2.2 * len(results) + 0.5, 2.4))
    for rank, item in enumerate(results):
        values = ", ".join(f"{v:g}" for v in item["holds"].tolist())
        rank_box(ax, rank * 1.8, 0, color(0), f"rank {rank}\nholds\n[{values}]")
        if rank:
            ax.annotate("", xy=(rank * 1.8, 0.5), xytext=(rank * 1.8 - 0.6, 0.5),
                        arrowprops={"arrowstyle": "->", "lw": 2})
            ax.text(rank * 1.8 - 0.3, 0.62, "send", ha="center")
    ax.set_xlim(-0.2, 1.8 * len(results))
    ax.set_ylim(-0.2, 1.2)
    ax.set_title("Each rank receives from its left, doubles, and sends to its right")
    ax.axis("off")
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's figure for the README gallery: a chain of 4 ranks, from a real run."""
    from helpers.launcher import run
    from helpers.point_to_point.workers import chain_worker

    return plot_chain(run(chain_worker, 4, args=([1.0, 2.0, 3.0],), show_output=False).results)
