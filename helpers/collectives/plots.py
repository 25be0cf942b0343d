"""Lesson 03's pictures: every rank's buffers before and after a collective."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from helpers.drawing import GREY, color


def draw_buffers(ax, results: list, key: str, width: int, reduced: bool = False):
    """Every rank's `key` buffer ("before" or "after") as a row of cells on `ax`.

    A cell's colour is the rank its number came from (the tens digit of the inputs); grey when
    the number is a reduction of several ranks' numbers (`reduced`); hatched when the rank's buffer
    was only scratch space (reduce off its destination)."""
    n = len(results)
    for rank, item in enumerate(results):
        y = n - 1 - rank
        ax.text(-0.15, y + 0.4, f"rank {rank}", ha="right", va="center")
        if item[key] is None:
            ax.text(0.1, y + 0.4, "(no buffer)", va="center", color="#999")
            continue
        scratch = key == "after" and item.get("scratch", False)
        for i, value in enumerate(item[key].tolist()):
            fill = GREY if reduced and key == "after" else color(int(value) // 10)
            ax.add_patch(Rectangle((i, y), 0.94, 0.8, facecolor="white" if scratch else fill,
                                   edgecolor=GREY, hatch="//" if scratch else None, alpha=0.9))
            ax.text(i + 0.47, y + 0.4, f"{value:g}", ha="center", va="center",
                    color=GREY if scratch else "white", fontweight="bold")
        if scratch:
            ax.text(len(item[key]) + 0.1, y + 0.4, "scratch,\nnot a result", va="center",
                    color=GREY)
    ax.set_xlim(-1.1, width + 1.2)
    ax.set_ylim(-0.2, n)
    ax.set_title(key)
    ax.axis("off")


def _width(results):
    return max(len(item[key]) for item in results for key in ("before", "after")
               if item[key] is not None)


def plot_collective(name: str, results: list, rule: str = "", reduced: bool = False):
    """Every rank's buffer before and after the collective `name`, drawn from the returned
    tensors (`collective_worker`): side by side, or one above the other where buffers are long
    (a screen's width holds two of six numbers each)."""
    width = _width(results)
    if width <= 6:
        fig, axes = plt.subplots(1, 2, figsize=(2.2 + 1.3 * width, 0.55 * len(results) + 1.3))
    else:
        fig, axes = plt.subplots(2, 1, figsize=(0.6 * (width + 2.3), 1.1 * len(results) + 1.6))
    for ax, key in zip(axes, ("before", "after")):
        draw_buffers(ax, results, key, width, reduced)
    fig.suptitle(f"{name}: {rule}" if rule else name)
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's figure for the README gallery: four collectives on 4 ranks, from real runs."""
    from helpers.collectives.workers import REDUCING, collective_worker
    from helpers.launcher import run

    names = ["broadcast", "all_gather", "reduce_scatter", "all_to_all"]
    fig, axes = plt.subplots(2, 4, figsize=(14, 5.6))
    for index, name in enumerate(names):
        results = run(collective_worker, 4, args=(name,), show_output=False).results
        pair = axes[index // 2, 2 * (index % 2): 2 * (index % 2) + 2]
        for ax, key in zip(pair, ("before", "after")):
            draw_buffers(ax, results, key, _width(results), reduced=name in REDUCING)
            ax.set_title(f"{name}: {key}")
    fig.suptitle("Every rank's buffers before and after, as the ranks returned them "
                 "(colour: the rank a number came from; grey: a sum)")
    fig.tight_layout()
    return fig
