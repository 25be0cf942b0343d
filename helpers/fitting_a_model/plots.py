"""Lesson 11's pictures: what a block keeps for backward under each kind of recomputation,
measured against the formula."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from helpers.drawing import COLORS
from helpers.fitting_a_model.accumulation import LABELS
from helpers.fitting_a_model.checkpointing import KERNELS, MODES

MODE_LABELS = {"none": "no recomputation", "selective": "selective (attention core)",
               "full": "full (whole block)"}


def plot_kept(measured: dict, formula: dict, shape: dict):
    """Bytes one Block keeps for backward, {(kernel, mode): bytes} measured, as bars grouped by
    attention kernel; the formula's value (checkpointing.kept_formula) is a black tick on each.
    `shape`: the block's s, b, h, a, for the title."""
    fig, ax = plt.subplots(figsize=(9, 3.0))
    width = 0.8 / len(MODES)
    for index, mode in enumerate(MODES):
        xs = [k + (index - (len(MODES) - 1) / 2) * width for k in range(len(KERNELS))]
        values = [measured[kernel, mode] / 1e3 for kernel in KERNELS]
        ax.bar(xs, values, width * 0.9, color=COLORS[index], label=MODE_LABELS[mode])
        ax.scatter(xs, [formula[kernel, mode] / 1e3 for kernel in KERNELS], marker="_",
                   s=500, color="black", zorder=3, label="formula" if index == 0 else None)
        for x, value in zip(xs, values):
            ax.text(x, value, f"{value:,.0f}", ha="center", va="bottom")
    ax.set_xticks(range(len(KERNELS)), [f"{kernel} attention" for kernel in KERNELS])
    ax.set_ylabel("kept for backward (kB)")
    ax.set_title("One Block, s = {s}, b = {b}, h = {h}, a = {a}, float32".format(**shape))
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1, 1))
    ax.margins(y=0.15)
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's key figure, from a run: one seeded Block, measured in each mode."""
    from helpers import reference
    from helpers.fitting_a_model.checkpointing import kept_bytes, kept_formula

    shape = {"s": 128, "b": 2, "h": 64, "a": 4}
    block = reference.make_block(dim=shape["h"], heads=shape["a"], seed=0)
    x = reference.seeded_randn(1, shape["b"], shape["s"], shape["h"]).requires_grad_()
    measured = {(kernel, mode): kept_bytes(block, x, mode, kernel)
                for kernel in KERNELS for mode in MODES}
    formula = {(kernel, mode): kept_formula(shape["s"], shape["b"], shape["h"], shape["a"],
                                            mode, kernel)
               for kernel in KERNELS for mode in MODES}
    return plot_kept(measured, formula, shape)


def plot_losses(curves: dict):
    """The loss of every step, one line per {label: [loss, ...]}."""
    fig, ax = plt.subplots(figsize=(7, 2.8))
    for index, (label, losses) in enumerate(curves.items()):
        ax.plot(range(1, len(losses) + 1), losses, color=COLORS[index], label=label,
                linestyle="-" if index == 0 else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def plot_relative_errors(errors: dict, bounds: dict):
    """How many elements have each relative error, {label: errors} on a log scale, with each
    label's bound (a dashed line of the same colour)."""
    fig, ax = plt.subplots(figsize=(7, 2.8))
    nonzero = [error[error > 0] for error in errors.values()]
    low = min(error.min().item() for error in nonzero)
    high = max(max(error.max().item() for error in nonzero), *bounds.values())
    edges = np.geomspace(low, high * 1.5, 60)
    for index, (label, error) in enumerate(zip(errors, nonzero)):
        ax.hist(error.numpy(), bins=edges, color=COLORS[index], alpha=0.7, label=label)
        ax.axvline(bounds[label], color=COLORS[index], linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("|error| / (Σ|terms| / n), against a float64 average (dashed: the bound)")
    ax.set_ylabel("elements")
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def plot_accumulation(sent: dict, formula: dict, held: dict, parameter_bytes: int):
    """Left: the bytes one rank sends per optimizer step against the micro-batches m, measured
    {strategy: {m: bytes}} (dots) on the formula's (lines). Right: the most gradient bytes it
    holds after a micro-batch's backward, {strategy: bytes} at the largest m, in units of the
    whole gradients' `parameter_bytes`. Each strategy is named by accumulation.LABELS."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3), width_ratios=(3, 2))
    for index, strategy in enumerate(sent):
        counts = sorted(sent[strategy])
        left.plot(counts, [formula[strategy][m] / 1e3 for m in counts], color=COLORS[index],
                  label=LABELS.get(strategy, strategy),
                  linewidth=4 - 0.6 * index)  # equal lines stay visible
        left.plot(counts, [sent[strategy][m] / 1e3 for m in counts], "o", color=COLORS[index])
    left.set_xticks(counts)
    left.set_xlabel("micro-batches per step, m")
    left.set_ylabel("kB sent per step, one rank")
    left.set_title("sent: measured (dots), formula (lines)")
    left.legend(frameon=False)
    names = list(held)
    right.barh(range(len(names)), [held[name] / parameter_bytes for name in names],
               color=[COLORS[index] for index in range(len(names))])
    right.set_yticks(range(len(names)), [LABELS.get(name, name) for name in names])
    right.invert_yaxis()
    right.set_xlabel("gradients held / whole gradients")
    right.set_title(f"held during accumulation (m = {counts[-1]})")
    fig.tight_layout()
    return fig


def plot_tradeoff(kept: dict, added: dict, title: str):
    """Each checkpointing setting {label: bytes kept} against {label: FLOPs its recomputation
    adds}, both measured: a point per setting, labelled."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for index, label in enumerate(kept):
        ax.scatter(added[label] / 1e6, kept[label] / 1e3, s=60, color=COLORS[index % len(COLORS)],
                   zorder=3)
        ax.annotate(label, (added[label] / 1e6, kept[label] / 1e3), textcoords="offset points",
                    xytext=(8, 5 if index % 2 == 0 else -14))  # neighbours apart
    ax.set_xlabel("FLOPs recomputation adds to a step (millions, FlopCounterMode)")
    ax.set_ylabel("bytes kept for backward (thousands)")
    ax.set_xlim(-0.1 * max(added.values()) / 1e6, 1.45 * max(added.values()) / 1e6)
    ax.set_ylim(0, 1.15 * max(kept.values()) / 1e3)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
