"""Lesson 13's pictures: a fake run's peak beside the projection and a published measurement, and
which layouts of the lesson's question fit a GPU."""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from helpers.drawing import GREY, legend_outside
from helpers.layouts import RECOMPUTE

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


# GPUs' memories the lesson draws: an H100 SXM's 80 GiB (lesson 10), and the 96 GB of torchtitan's
# benchmark's H100s ("Each H100 GPU is equipped with 96GB HBM2e"), 89.4 GiB
TITLE_CHARACTERS = 80  # a longer title is wrapped: at 12 pt, 80 characters are about 7 inches
GPU_LINES = {"80 GiB (H100 SXM)": 80 * GiB, "96 GB (the benchmark's H100s)": 96e9}


def plot_beside(bars: dict, memories: dict | None = None, title: str = ""):
    """Horizontal stacked bars, one per source: bars = {label: {kind: bytes}}; a labelled line at
    each of `memories` ({label: a GPU's bytes}) if given."""
    kinds = list(dict.fromkeys(kind for parts in bars.values() for kind in parts))
    fig, ax = plt.subplots(figsize=(9.5, 1.2 + 0.55 * len(bars)))
    inside = []  # (a segment's value, its left and right in GiB)
    for row, parts in enumerate(reversed(list(bars.values()))):
        left = 0.0
        for kind in kinds:
            size = parts.get(kind, 0) / GiB
            if size <= 0:
                continue
            ax.barh(row, size, left=left, color=KIND_COLORS[kind], edgecolor="white",
                    label=kind)
            value = ax.text(left + size / 2, row, f"{size:.1f}", ha="center", va="center",
                            color="white")
            inside.append((value, left, left + size))
            left += size
        ax.text(left + 0.5, row, f"{left:.1f} GiB", va="center")
    for (label, memory), style in zip((memories or {}).items(), ("--", ":")):
        ax.axvline(memory / GiB, color=GREY, linestyle=style, label=label)
    ax.set_yticks(range(len(bars)), list(reversed(list(bars))))
    ax.set_xlabel("GiB per GPU")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), ncol=1, loc="center left",
              bbox_to_anchor=(1.08, 0.5), frameon=False)
    ax.set_title(textwrap.fill(title, TITLE_CHARACTERS))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    _keep_values_that_fit(fig, ax, inside)
    return fig


def _keep_values_that_fit(fig, ax, inside):
    """Removes each segment's value wider than its segment, as drawn: a narrow segment's
    number would run into its neighbours'."""
    renderer = fig.canvas.get_renderer()
    for value, left, right in inside:
        (x0, _), (x1, _) = ax.transData.transform([(left, 0), (right, 0)])
        if value.get_window_extent(renderer).width > 0.9 * (x1 - x0):
            value.remove()


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


def plot_fits(verdicts: dict, title: str = ""):
    """The sweep's layouts (rows: tensor-parallel degree; columns: recomputation), one panel per
    GPU memory, verdicts = {memory: [fits.Verdict]}: green where a GPU holds the layout (what it
    would reserve for the fake peak, fits.reserved, fits), amber where only the fake peak fits,
    red where it does not; each cell with its peak and its estimated tokens per second, the
    fastest green one framed."""
    from helpers.at_scale.fits import reserved

    first = next(iter(verdicts.values()))
    tps = sorted({verdict.plan.tp for verdict in first})
    fig, axes = plt.subplots(1, len(verdicts), figsize=(4.6 * len(verdicts), 3.4), squeeze=False)
    for ax, (memory, row) in zip(axes[0], verdicts.items()):
        held = [verdict for verdict in row if reserved(verdict.peak) <= memory]
        best = max(held, key=lambda verdict: verdict.step.tokens_per_second, default=None)
        for verdict in row:
            plan = verdict.plan
            x, y = RECOMPUTE.index(plan.recompute), tps.index(plan.tp)
            color = ("#4c9f70" if verdict in held else "#e0a030" if verdict.fits
                     else "#c44e52")
            ax.add_patch(plt.Rectangle((x - 0.48, y - 0.45), 0.96, 0.9, color=color))
            if verdict is best:
                ax.add_patch(plt.Rectangle((x - 0.48, y - 0.45), 0.96, 0.9, fill=False,
                                           edgecolor="black", linewidth=2.5))
            ax.text(x, y, f"{verdict.peak / GiB:.0f} GiB\n"
                    f"{verdict.step.tokens_per_second:,.0f} tok/s", ha="center", va="center",
                    color="white")
        ax.set_xlim(-0.5, len(RECOMPUTE) - 0.5)
        ax.set_ylim(-0.5, len(tps) - 0.5)
        ax.set_xticks(range(len(RECOMPUTE)), [f"recompute\n{mode}" for mode in RECOMPUTE])
        ax.set_yticks(range(len(tps)), [f"tp {tp}, dp {first[0].plan.gpus // tp}" for tp in tps])
        ax.set_title(f"GPUs of {memory / GiB:.0f} GiB")
        for side in ax.spines.values():
            side.set_visible(False)
    fig.suptitle(title)
    legend_outside(fig, [Patch(color="#4c9f70", label="a GPU holds it (what it would reserve "
                                                      "fits)"),
                         Patch(color="#e0a030", label="only the fake peak fits"),
                         Patch(color="#c44e52", label="the fake peak does not fit"),
                         Patch(facecolor="white", edgecolor="black", linewidth=2.5,
                               label="the fastest that a GPU holds")], ncols=2)
    return fig


PHASE_COLORS = {"forward": "#f2f2f2", "loss": "#fde7d6", "backward, the loss's": "#f9cfae",
                "backward, the model's": "#e4ecf7", "clipping": "#eeeeee", "optimizer": "#e6e0f2"}


def plot_timeline(found: dict, title: str = ""):
    """A step's memory after every operation (timeline.timeline_worker's), stacked by the
    lesson's kinds, the phases shaded behind and the peak marked."""
    records = [dict(zip(found["kinds"], values)) for values in zip(*found["kinds"].values())]
    rows = [by_kind(record) for record in records]
    kinds = [kind for kind in KIND_COLORS if any(row.get(kind, 0) for row in rows)]
    fig, ax = plt.subplots(figsize=(10, 4))
    steps = range(len(rows))
    ax.stackplot(steps, *[[row.get(kind, 0) / GiB for row in rows] for kind in kinds],
                 colors=[KIND_COLORS[kind] for kind in kinds], labels=kinds, linewidth=0)
    starts = [start for _, start in found["phases"]] + [len(rows)]
    total = [record["Total"] / GiB for record in records]
    groups = []  # a wide phase alone; neighbouring narrow ones (the loss, say) under one label
    for (phase, start), end in zip(found["phases"], starts[1:]):
        ax.axvspan(start, end, color=PHASE_COLORS.get(phase, "#f2f2f2"), zorder=-1)
        narrow = end - start < 0.05 * len(rows)
        if narrow and groups and groups[-1][0]:
            groups[-1][1].append(phase)
            groups[-1][3] = end
        else:
            groups.append([narrow, [phase], start, end])
    for narrow, phases, start, end in groups:  # a narrow group's label runs over its neighbour,
        middle = (start + end) / 2  # above the others', over the plot's frame
        align = ("center" if not narrow else "right" if middle > 0.8 * len(rows) else "left")
        ax.text({"center": middle, "right": end, "left": start}[align],
                max(total) * (1.19 if narrow else 1.06),
                " + ".join(phases) if narrow else phases[0], ha=align, va="bottom")
    peak = max(range(len(total)), key=total.__getitem__)
    ax.plot(peak, total[peak], "o", color="black")
    peak_phase = found["phases"][sum(start <= peak for start in starts[:-1]) - 1][0]
    ax.annotate(f"peak {total[peak]:.1f} GiB, in {peak_phase}", (peak, total[peak]),
                xytext=(12, -4), textcoords="offset points")
    ax.set_xlim(0, len(rows))
    ax.set_ylim(0, max(total) * 1.18)
    ax.set_xlabel("operations of the step, in order")
    ax.set_ylabel("GiB alive on rank 0")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ax.set_title(textwrap.fill(title, TITLE_CHARACTERS), pad=24)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def plot_step_times(rows: list, title: str = ""):
    """rows = [(label, step_time.StepTime, published tokens/s a GPU or None)]: per row, compute
    then tensor parallelism's time on the critical path, FSDP's time on the link below them (it
    overlaps with compute), and the published step's length, marked."""
    fig, ax = plt.subplots(figsize=(9.5, 1.2 + 0.8 * len(rows)))
    for row, (_, time, published) in enumerate(reversed(rows)):
        ax.barh(row + 0.12, time.compute, height=0.4, color="#55A868",
                label="compute (FLOPs at the calibrated efficiency)")
        ax.barh(row + 0.12, time.tp, left=time.compute, height=0.4, color="#DD8452",
                label="tensor parallelism, on the critical path")
        ax.barh(row - 0.24, time.fsdp, height=0.2, color="#4C72B0", alpha=0.6,
                label="FSDP on the link, under compute where it fits")
        text = f"{time.tokens_per_second:,.0f} tokens/s a GPU"
        if published:
            seconds = time.tokens / published
            ax.plot([seconds, seconds], [row - 0.35, row + 0.4], color="black", linewidth=2,
                    label="published step (tokens / published tokens/s)")
            text += (f"; published {published:,}: "
                     f"{time.tokens_per_second / published - 1:+.0%}")
        ax.text(max(time.seconds, time.fsdp) * 1.02 + 0.3, row, text, va="center")
    ax.set_yticks(range(len(rows)), [textwrap.fill(label, 32) for label, _, _ in reversed(rows)])
    ax.set_xlabel("seconds a step, per GPU (a model, not a measurement)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="upper center",
              bbox_to_anchor=(0.5, -0.25), ncol=2, frameon=False)
    ax.set_xlim(0, max(max(time.seconds, time.fsdp) for _, time, _ in rows) * 1.7)
    ax.set_title(textwrap.fill(title, TITLE_CHARACTERS))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's key figure, from the committed sweep of fake runs (fits.SWEEP, which the
    tests run again in part): which layouts of Llama 3 8B a GPU of 80 or 48 GiB holds, and how
    fast each would run."""
    from helpers.at_scale.fits import QUESTION, sweep_verdicts

    return plot_fits({gib * GiB: sweep_verdicts(gib) for gib in (80, 48)},
                     f"{QUESTION['model']}, {QUESTION['sequences']} x {QUESTION['seq_len']} "
                     f"tokens a step on {QUESTION['gpus']} fake ranks: peak per GPU, and "
                     "tokens/s a GPU (estimated)")
