"""Lesson 01's pictures: threads against processes, group membership, the grid of groups."""

from __future__ import annotations

import matplotlib.pyplot as plt

from helpers.drawing import color, rank_box


def plot_threads_vs_processes(timings: dict, cores: int):
    """Wall time of n copies of a CPU-bound loop: n threads (one GIL) against n processes."""
    workers = timings["workers"]
    single = timings["threads"][0]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.38
    positions = range(len(workers))
    for offset, kind, bar_color in ((-width / 2, "threads", color(3)),
                                    (width / 2, "processes", color(0))):
        bars = ax.bar([p + offset for p in positions], timings[kind], width, label=kind,
                      color=bar_color)
        ax.bar_label(bars, fmt="%.2f s")
    ideal = [single * max(1.0, n / cores) for n in workers]
    ax.plot(positions, ideal, "k--", lw=1, label=f"ideal on {cores} cores")
    ax.set_xticks(list(positions), [f"{n} worker{'s' if n > 1 else ''}" for n in workers])
    ax.set_ylabel("wall time (s)")
    ax.set_title("The same CPU-bound loop, n copies at once")
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def plot_groups(results: list, title: str = "Which group each rank joined"):
    """One box per rank, coloured by its group, labelled with the value it got back."""
    fig, ax = plt.subplots(figsize=(1.6 * len(results) + 1, 2.2))
    for item in results:
        rank_box(ax, item["rank"] * 1.2, 0, color(item["group"]),
                 f"rank {item['rank']}\nsum = {item['group_sum']}")
    for group in sorted({item["group"] for item in results}):
        members = [item["rank"] for item in results if item["group"] == group]
        middle = (min(members) + max(members)) / 2 * 1.2 + 0.5
        ax.annotate(f"group {group}: ranks {members}", (middle, 1.15), ha="center",
                    color=color(group), fontweight="bold")
    ax.set_xlim(-0.2, 1.2 * len(results))
    ax.set_ylim(-0.2, 1.4)
    ax.set_title(title)
    ax.axis("off")
    fig.tight_layout()
    return fig


def plot_grid(results: list):
    """The rows x cols grid: each rank coloured by its row group, outlined by its column group."""
    rows = 1 + max(item["row"] for item in results)
    cols = 1 + max(item["col"] for item in results)
    fig, ax = plt.subplots(figsize=(1.9 * cols + 1.2, 1.5 * rows + 0.8))
    for item in results:
        x, y = item["col"] * 1.4, (rows - 1 - item["row"]) * 1.2
        rank_box(ax, x, y, color(item["row"]),
                 f"rank {item['rank']}\nrow sum {item['row_sum']}\ncol sum {item['col_sum']}",
                 edge=color(-1 - item["col"]))
    for row in range(rows):
        ax.text(-0.35, (rows - 1 - row) * 1.2 + 0.5, f"row group {row}", ha="right", va="center",
                color=color(row), fontweight="bold")
    for col in range(cols):
        ax.text(col * 1.4 + 0.5, rows * 1.2 - 0.05, f"column group {col}", ha="center",
                color=color(-1 - col), fontweight="bold")
    ax.set_xlim(-2.2, cols * 1.4)
    ax.set_ylim(-0.2, rows * 1.2 + 0.2)
    ax.set_title(f"{rows} x {cols} grid of ranks: one group per row, one per column")
    ax.axis("off")
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's figure for the README gallery: a 2 x 3 grid of groups, from a real run."""
    from helpers.launcher import run
    from helpers.processes_and_groups.workers import grid_worker

    return plot_grid(run(grid_worker, 6, args=(2,), show_output=False).results)
