"""Lesson 05's pictures: the ring's steps, bytes per rank, ring against tree, topologies."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from helpers.drawing import color
from helpers.how_all_reduce_works.workers import (
    TOPOLOGIES,
    TOPOLOGY_LABELS,
    all_reduce_on,
    all_to_all_on,
    ring_seconds,
    tree_seconds,
)


def _contributors(value: float) -> int:
    """How many ranks a ring-trace number contains: rank r contributed 10**r, so count the 1s."""
    return str(int(round(value))).count("1")


def draw_ring_step(ax, traces: list, index: int, ranks_named: bool = True):
    """One step of the ring trace on `ax`: a row per rank (named on the left, unless not
    `ranks_named`), a cell per chunk, darker = more ranks summed in; the chunk each rank sends (to
    the next rank, the last to rank 0) is outlined."""
    n = len(traces)
    step = traces[0][index][0]
    for rank, trace in enumerate(traces):
        _, sent, values = trace[index]
        y = n - 1 - rank
        if ranks_named:
            ax.text(-0.2, y + 0.4, f"rank {rank}", ha="right", va="center")
        for chunk, value in enumerate(values.tolist()):
            share = _contributors(value) / n
            ax.add_patch(Rectangle((chunk, y), 0.92, 0.8,
                                   facecolor=plt.cm.Blues(0.15 + 0.8 * share),
                                   edgecolor="#C44E52" if chunk == sent else "white",
                                   linewidth=2.5 if chunk == sent else 1))
            ax.text(chunk + 0.46, y + 0.4, f"{int(value)}", ha="center", va="center",
                    color="white" if share > 0.5 else "black")
    phase = "reduce-scatter" if step < n - 1 else "all-gather"
    title = "start: rank r holds 10**r" if step < 0 else f"step {step}, {phase}"
    ax.set_title(title)
    ax.set_xlim(-1.5 if ranks_named else -0.1, n + 0.1)
    ax.set_ylim(-0.6, n)
    ax.axis("off")


def plot_ring_steps(traces: list):
    """Every step of the ring, side by side (the static version of the stepper widget)."""
    steps = len(traces[0])
    columns = min(4, steps)
    rows = math.ceil(steps / columns)
    n = len(traces)  # a panel's width in cells: the ranks' names only in the first column's
    widths = [n + 1.6] + [n + 0.2] * (columns - 1)
    fig, axes = plt.subplots(rows, columns, figsize=(0.6 * sum(widths), 2.2 * rows),
                             squeeze=False, width_ratios=widths)
    for index, ax in enumerate(axes.flat):
        if index < steps:
            draw_ring_step(ax, traces, index, ranks_named=index % columns == 0)
        else:
            ax.axis("off")
    last = len(traces) - 1
    fig.suptitle("Ring all-reduce: outlined = the chunk each rank sends to the next "
                 f"(rank {last} to rank 0)")
    fig.tight_layout()
    return fig


def plot_bytes_per_rank(bytes_by_algorithm: dict, tensor_bytes: int):
    """Grouped bars: bytes each rank sent, per algorithm, in units of the tensor's size."""
    labels = list(bytes_by_algorithm)
    n = len(next(iter(bytes_by_algorithm.values())))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / len(labels)
    for index, label in enumerate(labels):
        positions = [r + (index - (len(labels) - 1) / 2) * width for r in range(n)]
        ax.bar(positions, [b / tensor_bytes for b in bytes_by_algorithm[label]], width,
               label=label, color=color(index))
    ax.set_xticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylabel("bytes sent / tensor size")
    ax.set_title("Who sends how much")
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def plot_ring_vs_tree(alpha, beta, sizes, device_counts):
    """Model time of ring and tree all-reduce against the number of devices, for a few sizes."""
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for index, size in enumerate(sizes):
        line_color = color(index)
        ax.loglog(device_counts, [ring_seconds(n, size, alpha, beta) for n in device_counts],
                  "-", color=line_color, label=f"ring, {size / 1e6:g} MB")
        ax.loglog(device_counts, [tree_seconds(n, size, alpha, beta) for n in device_counts],
                  "--", color=line_color, label=f"tree, {size / 1e6:g} MB")
    ax.set_xlabel("devices n")
    ax.set_ylabel("model time (s)")
    ax.set_title(f"alpha = {alpha * 1e6:g} us, beta = {beta / 1e9:g} GB/s")
    ax.legend(ncols=2, frameon=False)
    fig.tight_layout()
    return fig


def plot_topologies(n, size_bytes, device_bandwidth):
    """Bandwidth-only model times of all-reduce and all-to-all on each topology."""
    fig, ax = plt.subplots(figsize=(7, 3))
    width = 0.38
    for offset, (label, model) in zip((-width / 2, width / 2), (
            ("all-reduce", all_reduce_on), ("all-to-all", all_to_all_on))):
        times = [model(t, n, size_bytes, device_bandwidth) * 1e3 for t in TOPOLOGIES]
        bars = ax.bar([i + offset for i in range(len(times))], times, width, label=label)
        ax.bar_label(bars, fmt="%.1f ms")
    ax.set_xticks(range(len(TOPOLOGIES)), [TOPOLOGY_LABELS[t] for t in TOPOLOGIES])
    ax.set_ylabel("model time (ms)")
    ax.set_title(f"{n} devices, {size_bytes / 1e6:.4g} MB each, "
                 f"{device_bandwidth / 1e9:g} GB/s out of each device")
    ax.legend(frameon=False)
    ax.margins(y=0.15)  # room for the bars' labels under the title
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's figure for the README gallery: every step of a 4-rank ring, from a real run."""
    from helpers.how_all_reduce_works.workers import ring_trace_worker
    from helpers.launcher import run

    return plot_ring_steps(run(ring_trace_worker, 4, show_output=False).results)
