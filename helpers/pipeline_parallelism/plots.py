"""Lesson 09's pictures: per-rank Gantt charts of the schedules (measured or ideal), the bubble
against its formula, and the activations each rank keeps over a step."""

from __future__ import annotations

import matplotlib.pyplot as plt

from helpers.drawing import COLORS
from helpers.pipeline_parallelism.ideal import bubble, simulate
from helpers.pipeline_parallelism.schedule import bubble_formula

KIND_COLORS = {"F": COLORS[0], "B": COLORS[2], "W": COLORS[4]}
KIND_NAMES = {"F": "forward", "B": "backward", "W": "weights' gradient (zb)"}


def plot_gantt(runs: dict, unit: str = "ms"):
    """One chart per run, {title: (events per rank, start)}: a row per rank, a bar per F, B or W,
    numbered by micro-batch, times from `start`; each title gives the measured bubble."""
    scale = {"ms": 1e3, "units": 1.0}[unit]
    rows = sum(len(events) for events, _ in runs.values())
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 0.36 * rows + 0.9 * len(runs)),
                             sharex=True, squeeze=False)
    for ax, (title, (events, start)) in zip(axes[:, 0], runs.items()):
        for rank, rank_events in enumerate(events):
            for event in rank_events:
                left, width = (event.start - start) * scale, (event.end - event.start) * scale
                ax.barh(rank, width, left=left, height=0.7, color=KIND_COLORS[event.kind],
                        edgecolor="white", linewidth=0.8)
                ax.text(left + width / 2, rank, str(event.micro_batch), ha="center",
                        va="center", color="white")
        ax.set_yticks(range(len(events)), [f"rank {r}" for r in range(len(events))])
        ax.invert_yaxis()
        ax.set_title(f"{title}: bubble {100 * bubble(events, start):.0f} %")
    longest = max((e.end - start) * scale for events, start in runs.values()
                  for rank in events for e in rank)
    axes[0, 0].set_xlim(0, longest * 1.01)  # shared by every chart
    axes[-1, 0].set_xlabel(f"time since the step began ({unit})")
    kinds = sorted({e.kind for events, _ in runs.values() for r in events for e in r},
                   key="FBW".index)
    handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLORS[k]) for k in kinds]
    axes[0, 0].legend(handles, [KIND_NAMES[k] for k in kinds], frameon=False,
                      ncols=len(kinds), loc="lower right", bbox_to_anchor=(1, 1.15))
    fig.tight_layout()
    return fig


def plot_ideal(num_stages: int, num_micro_batches: int, schedules=("gpipe", "1f1b", "zb")):
    """Each schedule with ideal times: a forward takes 1, a backward 2 (zb: B 1 and W 1)."""
    formula = f"{100 * bubble_formula(num_stages, num_micro_batches):.0f} %"
    return plot_gantt({f"{name}, p = {num_stages}, m = {num_micro_batches}, ideal times"
                       + ("" if name == "zb" else f" (formula {formula})"):
                       (simulate(name, num_stages, num_micro_batches), 0.0)
                       for name in schedules}, unit="units")


def plot_bubbles(measured: dict, num_stages: int, ideal: dict | None = None):
    """Measured bubble against m, {schedule: {m: bubble}}, with the formula as a line and,
    optionally, the ideal schedules' {schedule: {m: bubble}} as open markers."""
    fig, ax = plt.subplots(figsize=(6, 3))
    ms = sorted({m for values in measured.values() for m in values})
    ax.plot(ms, [100 * bubble_formula(num_stages, m) for m in ms], color="black",
            linewidth=1, label="(p - 1) / (m + p - 1)")
    for index, (name, values) in enumerate(measured.items()):
        ax.plot(list(values), [100 * v for v in values.values()], "o-", color=COLORS[index],
                label=f"{name}, measured")
        if ideal and name in ideal:
            ax.plot(list(ideal[name]), [100 * v for v in ideal[name].values()], "o",
                    mfc="none", color=COLORS[index], label=f"{name}, ideal times")
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (% of the step)")
    ax.set_title(f"p = {num_stages} stages")
    ax.set_ylim(0, 100)
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def plot_memory(runs: dict):
    """Activations kept by each rank during the step, {title: (events per rank, start)}: one
    panel per run, a line per rank, from each event's stored bytes."""
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3), sharey=True,
                             squeeze=False)
    for ax, (title, (events, start)) in zip(axes[0], runs.items()):
        for rank, rank_events in enumerate(events):
            times = [0.0] + [(e.end - start) * 1e3 for e in rank_events]
            stored = [0.0] + [e.stored_bytes / 1e3 for e in rank_events]
            ax.step(times, stored, where="post", color=COLORS[rank % len(COLORS)],
                    label=f"rank {rank}")
        ax.set_title(title)
        ax.set_xlabel("time since the step began (ms)")
    axes[0, 0].set_ylabel("activations kept (kB)")
    axes[0, -1].legend(frameon=False)
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's key figure, from fixed inputs: the three schedules with ideal times, p = 4
    stages and m = 8 micro-batches."""
    return plot_ideal(4, 8)
