"""Lesson 13's pictures: a fake run's peak beside the projection and a published measurement, and
which layouts of the lesson's question fit a GPU."""

from __future__ import annotations

import matplotlib.pyplot as plt

from helpers.at_scale.accounting import RECOMPUTE
from helpers.drawing import GREY

GiB = 2**30
# One colour per kind, the same in every figure of the lesson.
KIND_COLORS = {"weights (sharded and gathered)": "#3A5A8C", "weights (sharded)": "#4C72B0",
               "weights (gathered)": "#7FA3D6", "gradients": "#C44E52", "optimizer": "#8172B3",
               "activations": "#937860", "temporaries (logits, ...)": "#DD8452",
               "FSDP buffers": "#55A868", "measured, max reserved": GREY}


def by_kind(peak: dict) -> dict:
    """A tracker's peak ({kind: bytes}, FSDPMemTracker's or MemTracker's kinds) in the lesson's
    kinds, for the bars."""
    return {"weights (sharded and gathered)": peak.get("Parameter", 0),  # MemTracker's one kind
            "weights (sharded)": peak.get("Sharded Param", 0),
            "weights (gathered)": peak.get("Unsharded Param", 0),
            "gradients": sum(peak.get(kind, 0) for kind in ("Sharded Grad", "Unsharded Grad",
                                                             "Gradient")),
            "optimizer": peak.get("OptState", 0) + peak.get("Optstate", 0),
            "activations": peak.get("Activation", 0),
            "temporaries (logits, ...)": peak.get("Temp", 0),
            "FSDP buffers": peak.get("All Gather", 0) + peak.get("Reduce Scatter", 0)}


def plot_beside(bars: dict, memory: float | None = None, title: str = ""):
    """Horizontal stacked bars, one per source: bars = {label: {kind: bytes}}; a line at
    `memory` (a GPU's bytes) if given."""
    kinds = list(dict.fromkeys(kind for parts in bars.values() for kind in parts))
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.6 * len(bars)))
    for row, parts in enumerate(reversed(list(bars.values()))):
        left = 0.0
        for kind in kinds:
            size = parts.get(kind, 0) / GiB
            if size <= 0:
                continue
            ax.barh(row, size, left=left, color=KIND_COLORS[kind], edgecolor="white",
                    label=kind)
            if size > 6:
                ax.text(left + size / 2, row, f"{size:.1f}", ha="center", va="center",
                        fontsize=8, color="white")
            left += size
        ax.text(left + 0.5, row, f"{left:.1f} GiB", va="center", fontsize=9)
    if memory:
        ax.axvline(memory / GiB, color=GREY, linestyle="--")
    ax.set_yticks(range(len(bars)), list(reversed(list(bars))))
    ax.set_xlabel("GiB per GPU")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, ncol=1, loc="center left",
              bbox_to_anchor=(1.08, 0.5), frameon=False)
    ax.set_title(title, fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def itemised(fake: dict, projection: dict, left_out: dict) -> str:
    """Lines setting a fake run's peak (by_kind) beside the projection's kinds (its weights as
    "weights (sharded)", gradients, optimizer, activations). MemTracker (tensor parallelism)
    lumps gathered weights with the sharded ones, and in these runs files the loss's backward
    tensors, which come before any module's backward, as activations. Each difference
    over 10 % of the projection's total marked, and what the projection leaves out, sized."""
    lumped = fake["weights (sharded and gathered)"] > 0  # MemTracker: one kind for both
    rows = [("weights and optimizer state" + (" (gathered too)" if lumped else ""),
             sum(fake[kind] for kind in ("weights (sharded and gathered)", "weights (sharded)",
                                         "optimizer")),
             projection["weights (sharded)"] + projection["optimizer"]),
            ("gradients", fake["gradients"], projection["gradients"]),
            ("activations" + (" (the loss's backward tensors too)" if lumped else ""),
             fake["activations"], projection["activations"]),
            ("gathered weights and FSDP's buffers" + (" (see above)" if lumped else ""),
             fake["weights (gathered)"] + fake["FSDP buffers"], 0),
            ("temporaries (the logits' among them)", fake["temporaries (logits, ...)"], 0)]
    total = sum(projection.values())
    lines = [f"{'':48s} {'fake':>9s} {'projected':>9s}"]
    for kind, got, projected in rows:
        flag = "  <- over 10 %" if abs(got - projected) > 0.10 * total else ""
        lines.append(f"{kind:48s} {got / GiB:9.2f} {projected / GiB:9.2f}{flag}")
    lines.append(f"{'total (GiB)':48s} {sum(row[1] for row in rows) / GiB:9.2f} "
                 f"{total / GiB:9.2f}")
    lines.append("left out by the projection, sized by strategy.left_out: " + "; ".join(
        f"{kind} {size / GiB:.2f}" for kind, size in left_out.items()))
    return "\n".join(lines)


def plot_fits(sweep: list, memories: tuple, title: str = ""):
    """The sweep's layouts (rows: tensor-parallel degree; columns: recomputation), one panel per
    GPU memory: green where the fake run's peak leaves 10% of it free, amber where it fits with
    less, red where it does not fit; each cell with its peak and the bytes a rank sends."""
    tps = sorted({plan.tp for plan, _, _ in sweep})
    fig, axes = plt.subplots(1, len(memories), figsize=(4.6 * len(memories), 3.2), squeeze=False)
    for ax, memory in zip(axes[0], memories):
        for plan, peak, sent in sweep:
            x, y = RECOMPUTE.index(plan.recompute), tps.index(plan.tp)
            color = ("#4c9f70" if peak <= 0.9 * memory else "#e0a030" if peak <= memory
                     else "#c44e52")
            ax.add_patch(plt.Rectangle((x - 0.48, y - 0.45), 0.96, 0.9, color=color))
            ax.text(x, y, f"{peak / GiB:.0f} GiB\nsends {sent / GiB:.1f} GiB", ha="center",
                    va="center", fontsize=8, color="white")
        ax.set_xlim(-0.5, len(RECOMPUTE) - 0.5)
        ax.set_ylim(-0.5, len(tps) - 0.5)
        ax.set_xticks(range(len(RECOMPUTE)), [f"recompute\n{mode}" for mode in RECOMPUTE],
                      fontsize=8)
        ax.set_yticks(range(len(tps)), [f"tp {tp}, dp {sweep[0][0].gpus // tp}" for tp in tps],
                      fontsize=8)
        ax.set_title(f"GPUs of {memory / GiB:.0f} GiB", fontsize=10)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's key figure, from the committed sweep of fake runs (fits.SWEEP, which the
    tests run again in part): which layouts of Llama 3 8B fit GPUs of 80 and 48 GiB."""
    from helpers.at_scale.fits import QUESTION, load_sweep

    return plot_fits(load_sweep(), (80 * GiB, 48 * GiB),
                     f"{QUESTION['model']}, {QUESTION['sequences']} x {QUESTION['seq_len']} "
                     f"tokens a step on {QUESTION['gpus']} fake ranks: peak per GPU, GiB sent")
