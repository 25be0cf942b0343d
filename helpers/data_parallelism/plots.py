"""Lesson 06's pictures: replicas drifting or not, where equality with one process breaks, step
timelines with communication under compute, and the alpha-beta model against measurement."""

from __future__ import annotations

import matplotlib.pyplot as plt

from helpers.data_parallelism.step_model import predict_step
from helpers.data_parallelism.workers import LABELS
from helpers.drawing import COLORS, GREY, plot_step_timelines


def plot_replica_spread(spreads: dict):
    """How far each replica's weights are from rank 0's after every step (largest difference),
    one line per case: {case: [spread after step 1, ...]} (per rank: the largest over ranks)."""
    fig, ax = plt.subplots(figsize=(6.5, 2.8))
    styles = [("s", "-", 9), ("o", "--", 5), ("^", ":", 7)]  # curves that coincide stay visible
    for index, (case, spread) in enumerate(spreads.items()):
        marker, line, size = styles[index % len(styles)]
        steps = range(1, len(spread) + 1)
        ax.plot(steps, [max(value, 1e-12) for value in spread], marker=marker, linestyle=line,
                markersize=size, color=COLORS[index], label=case)
    ax.set_yscale("log")
    ax.set_ylim(1e-13, 10)
    ax.axhline(1e-12, color=GREY, linewidth=0.8, linestyle=":")
    ax.text(1, 1e-11, "identical (0, drawn at 1e-12)", color=GREY)
    ax.set_xlabel("training step")
    ax.set_ylabel("largest |weight - rank 0's|")
    ax.legend(frameon=False, loc="center right")
    fig.tight_layout()
    return fig


def plot_equality(differences: dict, tolerance: float):
    """The largest parameter difference from single-process training, one bar per case (log
    scale); bars left of the dashed line pass `assert_close`'s float32 tolerance."""
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(differences) + 1.2))
    cases = list(differences)
    values = [max(differences[case], 1e-10) for case in cases]
    colors = [COLORS[2] if value <= tolerance else COLORS[3] for value in values]
    ax.barh(range(len(cases)), values, color=colors)
    ax.set_xscale("log")
    ax.set_yticks(range(len(cases)), cases)
    ax.invert_yaxis()
    ax.axvline(tolerance, color="black", linestyle="--", linewidth=1)
    ax.annotate("float32 tolerance", (tolerance, 1), xycoords=("data", "axes fraction"),
                xytext=(0, 3), textcoords="offset points", ha="center", va="bottom")
    for y, value in enumerate(values):  # a passing difference is rounding: its digits are noise
        label = f"≤ {tolerance:.0e}" if value <= tolerance else f"{differences[cases[y]]:.1e}"
        ax.text(value * 1.3, y, label, va="center")
    ax.set_xlim(1e-10, 10)
    ax.set_xlabel("largest |parameter - single-process parameter| after training")
    fig.tight_layout()
    return fig


def plot_bucketing(measured: dict, predicted: dict):
    """Time to average the gradients after backward, per bucket size: measured bars and the
    alpha-beta model's prediction ({label: seconds} each, same labels)."""
    fig, ax = plt.subplots(figsize=(7, 3))
    labels = list(measured)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [measured[k] * 1e3 for k in labels], width=0.4,
           color=COLORS[0], label="measured")
    ax.bar([i + 0.2 for i in x], [predicted[k] * 1e3 for k in labels], width=0.4,
           color=COLORS[1], label="alpha-beta model")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("averaging the gradients (ms)")
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def plot_step_times(medians: dict, world_size: int):
    """Median step time of each strategy (workers.STRATEGIES), measured side by side in one run."""
    fig, ax = plt.subplots(figsize=(6.5, 2.6))
    names = list(medians)
    ax.barh(range(len(names)), [medians[n] * 1e3 for n in names],
            color=[COLORS[i] for i in range(len(names))])
    for y, name in enumerate(names):
        ax.text(medians[name] * 1e3, y, f" {medians[name] * 1e3:.0f} ms", va="center")
    ax.set_yticks(range(len(names)), [LABELS.get(name, name) for name in names])
    ax.invert_yaxis()
    ax.set_xlabel(f"median step time on {world_size} ranks (ms)")
    ax.set_xlim(0, max(medians.values()) * 1e3 * 1.2)
    fig.tight_layout()
    return fig


def modelled_steps(grad_bytes, forward_s, backward_s, step_s, world_size, alpha, beta,
                   bucket_bytes) -> dict:
    """The model's step for the naive loop, DDP with one all_reduce per gradient (overlapped)
    and DDP with buckets (bucketed), ready for plot_step_timelines (one lane pair: every rank
    does the same)."""
    cases = {"naive": ("naive", None), "overlapped": ("ddp", None),
             f"bucketed ({bucket_bytes / 2**20:g} MiB)": ("ddp", bucket_bytes)}
    runs = {}
    for title, (strategy, bucket) in cases.items():
        step = predict_step(grad_bytes, forward_s, backward_s, step_s, strategy, world_size,
                            alpha, beta, bucket)
        runs[title] = {"events": [step["events"]], "step_seconds": step["step_seconds"]}
    return runs


def key_figure():
    """The lesson's key figure, from fixed inputs: the model's step for 16 gradients of 1 MiB,
    30 ms of compute, alpha = 1 ms and beta = 1 GB/s on 4 ranks."""
    runs = modelled_steps([2**20] * 16, 0.010, 0.020, 0.002, 4, 1e-3, 1e9, 4 * 2**20)
    return plot_step_timelines(runs, what="alpha-beta model")
