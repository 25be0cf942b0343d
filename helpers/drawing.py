"""The drawing toolkit every lesson's pictures share: colours, rank boxes, per-rank timelines, and
`write_key_figures`, which `make figures` runs to write each lesson's key figure to figures/.

Everything here runs in the notebook kernel, on data the ranks returned (workers never plot).
"""

from __future__ import annotations

import importlib
import os
import sys

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

# One colour per rank, group or series, in this order.
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860"]
GREY = "#8c8c8c"
# Timeline bars: what a rank was doing.
EVENT_COLORS = {"compute": "#55A868", "send": "#4C72B0", "recv": "#4C72B0", "isend": "#8172B3",
                "irecv": "#8172B3", "wait": "#C44E52", "work": "#55A868", "barrier": "#C44E52"}


def color(index: int) -> str:
    """The index-th colour of the palette (it wraps around)."""
    return COLORS[index % len(COLORS)]


def rank_box(ax, x, y, facecolor, label, edge=None, size=1.0):
    """A rounded box with white bold text: one rank (or one shard) in a picture."""
    ax.add_patch(FancyBboxPatch((x, y), size, size, boxstyle="round,pad=0.02",
                                facecolor=facecolor, alpha=0.85, edgecolor=edge or "white",
                                linewidth=4 if edge else 1))
    ax.text(x + size / 2, y + size / 2, label, ha="center", va="center", color="white",
            fontsize=9, fontweight="bold")


def plot_timelines(runs: dict, label_min_ms: float = 8):
    """Gantt charts, one per run: a row per rank, a bar per (label, start_s, end_s) event.

    `runs` maps a title to a list (one per rank) of event lists. Bars longer than `label_min_ms`
    carry their label; a legend names every kind of bar."""
    fig, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False,
                             figsize=(8, 0.9 * sum(len(t) for t in runs.values()) + 1.4))
    labels = {}
    for ax, (name, per_rank) in zip(axes[:, 0], runs.items()):
        for rank, events in enumerate(per_rank):
            for label, start, end in events:
                bar_color = EVENT_COLORS.get(label, COLORS[-1])
                labels.setdefault(label, bar_color)
                ax.barh(rank, (end - start) * 1e3, left=start * 1e3, height=0.6,
                        color=bar_color, edgecolor="white")
                if (end - start) * 1e3 > label_min_ms:
                    ax.text((start + end) / 2 * 1e3, rank, label, ha="center", va="center",
                            color="white", fontsize=8)
        finished = max(end for events in per_rank for _, _, end in events)
        ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
        ax.invert_yaxis()
        everyone = "both ranks" if len(per_rank) == 2 else f"all {len(per_rank)} ranks"
        ax.set_title(f"{name}: {everyone} done after {finished * 1e3:.0f} ms", fontsize=10)
    by_color = {}  # labels that share a colour share a legend entry: "send / recv"
    for label, bar_color in labels.items():
        by_color.setdefault(bar_color, []).append(label)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in by_color]
    axes[0, 0].legend(handles, [" / ".join(names) for names in by_color.values()], fontsize=8,
                      frameon=False, ncols=len(by_color), loc="lower right",
                      bbox_to_anchor=(1, 1.12))
    axes[-1, 0].set_xlabel("time since the common start (ms)")
    fig.tight_layout()
    return fig


def write_key_figures(directory: str) -> list:
    """Write every lesson's key figure to `directory` as NN_name.svg, byte for byte the same on
    every run (no date, fixed element ids). Returns the paths written.

    A lesson takes part by defining `key_figure()` in its `plots` module."""
    from helpers.lessons import lessons

    plt.rcParams["svg.hashsalt"] = "distributed-pytorch-course"
    os.makedirs(directory, exist_ok=True)
    written = []
    for lesson in lessons():
        plots = importlib.import_module(f"{lesson.package}.plots")
        fig = plots.key_figure()
        path = os.path.join(directory, f"{lesson.stem}.svg")
        fig.savefig(path, format="svg", metadata={"Date": None})
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    import matplotlib

    matplotlib.use("Agg")
    for written_path in write_key_figures(sys.argv[1] if len(sys.argv) > 1 else "figures"):
        print(written_path)
