"""The drawing toolkit every lesson's pictures share: the course's text sizes, colours, rank
boxes, per-rank timelines, a training step's compute against its collectives, the PNG a kernel
shows of a figure (with the size of its smallest text), and `write_key_figures`, which `make
figures` runs to write each lesson's key figure to figures/.

Everything here runs in the notebook kernel, on data the ranks returned (workers never plot).
"""

from __future__ import annotations

import importlib
import os
import sys

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch, Patch
from matplotlib.text import Text

# Text a lecture hall can read. A figure is drawn at 100 dpi, where a point is 100/72 px: 11 pt
# text is 15.3 px on a slide that shows the figure at its own size, over the course's floor of
# 14 px at 1280 x 720 (docs/presenting.md). Every other size is matplotlib's relative to this one
# (ticks and legends "medium", 11 pt; a figure's title "large", 13.2 pt) but an axes' title, 12 pt;
# no drawing sets a smaller one.
FONT_PT = 11
STYLE = {"font.size": FONT_PT, "axes.titlesize": 12, "figure.dpi": 100, "savefig.dpi": "figure"}
plt.rcParams.update(STYLE)
# Where a kernel shows a figure, its PNG's metadata says how large its smallest text is, in the
# PNG's own pixels (figure_bundle): the browser tier scales it by how large the slide shows it.
SMALLEST_TEXT = "smallest_text_px"
PNG = "image/png"

# One colour per rank, group or series, in this order.
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860"]
GREY = "#8c8c8c"
# Timeline bars: what a rank was doing.
EVENT_COLORS = {"compute": "#55A868", "send": "#4C72B0", "recv": "#4C72B0", "isend": "#8172B3",
                "irecv": "#8172B3", "wait": "#C44E52", "work": "#55A868", "barrier": "#C44E52"}

# A training step's lanes (plot_step_timelines). Compute lane: what the rank's own thread does;
# hatched, the spans in which it waits for communication. Communication lane: the collectives
# in flight, two shades each, alternating, so that neighbouring buckets show.
LANE_COLORS = {"forward": "#8FBF9F", "backward": "#55A868", "step": "#8172B3"}
WAITING = ("naive all_reduces", "wait")
COLLECTIVE_COLORS = {"all_reduce": ("#4C72B0", "#7FA3D6"),
                     "reduce_scatter": ("#4C72B0", "#7FA3D6"),
                     "all_gather": ("#DD8452", "#F0B27A")}


def legend_outside(fig, handles: list, ncols: int, above: bool = False) -> None:
    """A legend of the whole figure in rows of `ncols`, above its panels or below them: the figure
    grows by the legend's rows (0.3 inch each at FONT_PT), and its panels are laid out in the
    rest (tight_layout). Call it last, once the panels are drawn."""
    rows = -(-len(handles) // ncols)
    height, room = fig.get_figheight(), 0.3 * rows + 0.1
    fig.set_figheight(height + room)
    fig.legend(handles=handles, frameon=False, ncols=ncols,
               loc="upper center" if above else "lower center",
               bbox_to_anchor=(0.5, 1 if above else 0))
    share = room / (height + room)
    fig.tight_layout(rect=(0, 0, 1, 1 - share) if above else (0, share, 1, 1))


def color(index: int) -> str:
    """The index-th colour of the palette (it wraps around)."""
    return COLORS[index % len(COLORS)]


def rank_box(ax, x, y, facecolor, label, edge=None, size=1.0):
    """A rounded box with white bold text: one rank (or one shard) in a picture."""
    ax.add_patch(FancyBboxPatch((x, y), size, size, boxstyle="round,pad=0.02",
                                facecolor=facecolor, alpha=0.85, edgecolor=edge or "white",
                                linewidth=4 if edge else 1))
    ax.text(x + size / 2, y + size / 2, label, ha="center", va="center", color="white",
            fontweight="bold")


def plot_timelines(runs: dict, label_min_ms: float = 8):
    """Gantt charts, one per run: a row per rank, a bar per (label, start_s, end_s) event.

    `runs` maps a title to a list (one per rank) of event lists. Bars longer than `label_min_ms`
    carry their label; a legend names every kind of bar."""
    fig, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False,
                             figsize=(8, 0.55 * sum(len(t) for t in runs.values()) + 1.5))
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
                            color="white")
        finished = max(end for events in per_rank for _, _, end in events)
        ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
        ax.invert_yaxis()
        everyone = "both ranks" if len(per_rank) == 2 else f"all {len(per_rank)} ranks"
        ax.set_title(f"{name}: {everyone} done after {finished * 1e3:.0f} ms")
    by_color = {}  # labels that share a colour share a legend entry: "send / recv"
    for label, bar_color in labels.items():
        by_color.setdefault(bar_color, []).append(label)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in by_color]
    axes[0, 0].legend(handles, [" / ".join(names) for names in by_color.values()],
                      frameon=False, ncols=len(by_color), loc="lower right",
                      bbox_to_anchor=(1, 1.12))
    axes[-1, 0].set_xlabel("time since the common start (ms)")
    fig.tight_layout()
    return fig


def draw_step(ax, per_rank: list, collectives: tuple) -> tuple:
    """Two lanes per rank on `ax`: what the rank computes (or waits for), and its `collectives`
    (events whose label is one of them). A collective's bar ends when it completes and starts
    at its launch or at the previous completion, whichever is later: collectives launched
    together wait for each other, and the bars do not hide one another. Returns the y tick
    positions and their labels."""
    ticks, labels = [], []
    for rank, events in enumerate(per_rank):
        compute_y, comm_y = 2 * rank, 2 * rank + 0.8
        finished = 0.0
        for index, (name, launched, ended) in enumerate(sorted(
                (e for e in events if e[0] in collectives), key=lambda e: e[2])):
            start, finished = max(launched, finished), ended  # a bar per completion, no overlap
            ax.barh(comm_y, (ended - start) * 1e3, left=start * 1e3, height=0.7,
                    color=COLLECTIVE_COLORS[name][index % 2], edgecolor="white", linewidth=0.5)
        for label, start, end in events:
            if label in collectives:
                continue
            waiting = label in WAITING
            ax.barh(compute_y, (end - start) * 1e3, left=start * 1e3, height=0.7,
                    color=LANE_COLORS.get(label, GREY), hatch="///" if waiting else None,
                    edgecolor="white", alpha=0.6 if waiting else 1)
        ticks += [compute_y, comm_y]
        who = f"rank {rank}" if len(per_rank) > 1 else "each rank"
        labels += [f"{who} compute", f"{who} {' / '.join(collectives)}"]
    return ticks, labels


def plot_step_timelines(runs: dict, what: str = "measured", collectives=("all_reduce",),
                        waiting_for: str | None = None):
    """One training step per strategy, {title: {"events": per-rank lists of (label, start_s,
    end_s), "step_seconds": s, or None to leave the time out of the title}}: a compute lane and a
    lane of `collectives` per rank, on a common time axis. `waiting_for` names, in the legend,
    what the hatched spans wait for (by default, the collectives)."""
    lanes = 2 * max(len(run["events"]) for run in runs.values())
    fig, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False,
                             figsize=(9, 0.27 * lanes * len(runs) + 1.3))
    for ax, (title, run) in zip(axes[:, 0], runs.items()):
        ticks, labels = draw_step(ax, run["events"], collectives)
        ax.set_yticks(ticks, labels)
        ax.invert_yaxis()
        timed = (f"step {run['step_seconds'] * 1e3:.0f} ms" if run.get("step_seconds") is not None
                 else "one step")
        ax.set_title(f"{title}: {timed} ({what})", loc="left")
    drawn = {event[0] for run in runs.values() for events in run["events"] for event in events}
    handles = [Patch(color=LANE_COLORS[name], label=name) for name in LANE_COLORS
               if name in drawn]  # a legend names only what is drawn
    if drawn & set(WAITING):
        handles.append(Patch(facecolor=GREY, alpha=0.6, hatch="///",
                             label=f"waiting for {waiting_for or ' / '.join(collectives)}"))
    handles += [Patch(color=COLLECTIVE_COLORS[name][0], label=f"{name} (a bar per completion)")
                for name in collectives if name in drawn]
    axes[-1, 0].set_xlabel("time since the step started (ms)")
    legend_outside(fig, handles, ncols=-(-len(handles) // 2), above=True)
    return fig


def smallest_text_px(fig) -> float | None:
    """The size of the smallest text a drawn figure shows, in pixels of its PNG at the figure's
    dpi: a font size in points times dpi / 72 (None where it shows no text). Texts that are
    hidden or empty (the labels of ticks never drawn) do not count."""
    sizes = [text.get_fontsize() for text in fig.findobj(Text)
             if text.get_visible() and text.get_text().strip()
             and (text.axes is None or text.axes.get_visible())]
    return round(min(sizes) * fig.dpi / 72, 2) if sizes else None


def figure_bundle(fig) -> tuple:
    """What a kernel shows of a figure (`import helpers` has IPython show figures so): the PNG the
    inline backend would draw (the tight bounding box, at the figure's dpi), base64, and in its
    metadata the size of its smallest text (smallest_text_px, measured once the PNG is drawn)."""
    from IPython.core.pylabtools import print_figure

    data = print_figure(fig, "png", bbox_inches="tight", base64=True)
    return {PNG: data}, {PNG: {SMALLEST_TEXT: smallest_text_px(fig)}}


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
