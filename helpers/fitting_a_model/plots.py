"""Lesson 11's pictures: what a block keeps for backward under each kind of recomputation,
measured against the formula."""

from __future__ import annotations

import matplotlib.pyplot as plt

from helpers.drawing import COLORS
from helpers.fitting_a_model.checkpointing import KERNELS, MODES

MODE_LABELS = {"none": "no recomputation", "selective": "selective (attention core)",
               "full": "full (whole block)"}


def plot_kept(measured: dict, formula: dict, shape: dict):
    """Bytes one Block keeps for backward, {(kernel, mode): bytes} measured, as bars grouped by
    attention kernel; the formula's value (checkpointing.kept_formula) is a black tick on each.
    `shape`: the block's s, b, h, a, for the title."""
    fig, ax = plt.subplots(figsize=(7, 3))
    width = 0.8 / len(MODES)
    for index, mode in enumerate(MODES):
        xs = [k + (index - (len(MODES) - 1) / 2) * width for k in range(len(KERNELS))]
        values = [measured[kernel, mode] / 1e3 for kernel in KERNELS]
        ax.bar(xs, values, width * 0.9, color=COLORS[index], label=MODE_LABELS[mode])
        ax.scatter(xs, [formula[kernel, mode] / 1e3 for kernel in KERNELS], marker="_",
                   s=500, color="black", zorder=3, label="formula" if index == 0 else None)
        for x, value in zip(xs, values):
            ax.text(x, value, f"{value:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(KERNELS)), [f"{kernel} attention" for kernel in KERNELS])
    ax.set_ylabel("kept for backward (kB)")
    ax.set_title("One Block, s = {s}, b = {b}, h = {h}, a = {a}, float32".format(**shape),
                 fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
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
