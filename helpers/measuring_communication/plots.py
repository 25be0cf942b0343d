"""Lesson 04's pictures: size sweeps with the alpha-beta fit, links, published sweeps."""

from __future__ import annotations

import matplotlib.pyplot as plt

from helpers.cost_model import BUSBW_FACTORS, model_seconds
from helpers.drawing import color


def _gigabytes(value):
    return value / 1e9


def plot_sweeps(sweeps: dict, fits: dict | None = None):
    """Left: time against size (log-log), with each fitted alpha-beta model. Right: busbw.

    `sweeps` maps a label to `sweep` records; `fits` a label to (alpha, beta).
    """
    fig, (time_ax, bw_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for index, (label, records) in enumerate(sweeps.items()):
        line_color = color(index)
        sizes = [r["size_bytes"] for r in records]
        time_ax.loglog(sizes, [r["seconds"] for r in records], "o", color=line_color, label=label)
        bw_ax.semilogx(sizes, [_gigabytes(r["busbw"]) for r in records], "o-", color=line_color,
                       label=label)
        if fits and label in fits:
            alpha, beta = fits[label]
            op, n = records[0]["op"], records[0]["world_size"]
            model = [model_seconds(alpha, beta, op, n, size) for size in sizes]
            time_ax.loglog(sizes, model, "-", color=line_color, alpha=0.6,
                           label=f"fit: alpha = {alpha * 1e6:.0f} us, "
                                 f"beta = {_gigabytes(beta):.2f} GB/s")
            crossover = alpha * beta / BUSBW_FACTORS[op](n)
            time_ax.axvline(crossover, color=line_color, ls=":", lw=1)
    time_ax.set_xlabel("size S (bytes)")
    time_ax.set_ylabel("time (s)")
    crossover = "\n(line: the fitted model; dotted: the size where both terms are equal)"
    time_ax.set_title("time: flat where latency dominates, rising where bandwidth does"
                      + (crossover if fits else ""))
    time_ax.legend()
    bw_ax.set_xlabel("size S (bytes)")
    bw_ax.set_ylabel("busbw (GB/s)")
    bw_ax.set_title("bus bandwidth")
    bw_ax.legend()
    fig.tight_layout()
    return fig


def plot_against_published(measured: dict, published: list):
    """busbw against size: sweeps measured here (label -> bench records) and published ones
    ((label, source, conditions, [(size, busbw)]) from published.PUBLISHED_SWEEPS), labelled as
    not measured here."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for index, (label, records) in enumerate(measured.items()):
        ax.loglog([r["size_bytes"] for r in records], [_gigabytes(r["busbw"]) for r in records],
                  "o-", color=color(index), label=f"{label} (measured here)")
    for index, (label, _, _, points) in enumerate(published):
        sizes, busbw = zip(*points)
        ax.loglog(sizes, [_gigabytes(b) for b in busbw], "s--", color="#999999",
                  alpha=1 - 0.35 * index, label=f"{label} (published, not measured here)")
    ax.set_xlabel("size S (bytes)")
    ax.set_ylabel("all_reduce busbw (GB/s)")
    ax.set_title("The same sweep on GPU servers (published, in S. Bekman's ML Engineering book)")
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(0, -0.2))
    fig.tight_layout()
    return fig


def plot_links(measured: dict, published: list):
    """Horizontal bars, log scale: bandwidths measured here (dict label -> bytes/s) against
    published link figures (list of (label, bytes/s, where)), which are labelled as not measured."""
    labels = [f"{label} (measured here)" for label in measured]
    labels += [f"{label} (published, not measured)" for label, _, _ in published]
    values = [_gigabytes(v) for v in measured.values()] + [_gigabytes(v) for _, v, _ in published]
    colors = [color(0)] * len(measured) + ["#bbbbbb"] * len(published)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(values) + 1))
    bars = ax.barh(labels, values, color=colors)
    ax.bar_label(bars, fmt="%.1f GB/s", padding=3)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("GB/s, one direction (log scale)")
    ax.set_title("What this machine moves, and what GPU links are built for")
    fig.tight_layout()
    return fig


def plot_busbw_factors(world_sizes=range(2, 17)):
    """nccl-tests' busbw factor of every collective against the number of ranks; collectives that
    share a factor share a line."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    sizes = list(world_sizes)
    lines = {}  # the factor's values -> the collectives that have it
    for op, factor in BUSBW_FACTORS.items():
        lines.setdefault(tuple(factor(n) for n in sizes), []).append(op)
    for index, (values, ops) in enumerate(lines.items()):
        ax.plot(sizes, values, "o-", ms=3, color=color(index), label=", ".join(ops))
    ax.set_xlabel("ranks n")
    ax.set_ylabel("busbw / algbw")
    ax.set_ylim(0, 2.1)
    ax.set_title("busbw = algbw x factor(n), nccl-tests' factors (doc/PERFORMANCE.md)")
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's figure for the README gallery: the busbw factors (a formula, so the same on
    every machine; the measured sweeps are in the notebook)."""
    return plot_busbw_factors()
