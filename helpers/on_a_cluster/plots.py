"""Lesson 15's pictures, drawn in the kernel from what Slurm and the ranks wrote."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from helpers.capstone.corpus import bits_per_byte
from helpers.drawing import COLORS, GREY

STATES = {"PENDING": "#E5E5E5", "RUNNING": "#D9E8D9", "COMPLETING": "#F3E3C3"}
SIGNAL = "#C44E52"


def plot_requeued(moments: list, events: list, submitted: float, requeued: float,
                  reference: dict):
    """Top: the job's life from its submission, as squeue saw it (the background: pending,
    running, completing), every rank's steps (a tick each, coloured by the job's restart), its
    saves (triangles), the stop it agreed on (a square) and the requeue (red). Bottom: the loss
    by step, each restart in its colour, over the same training under plain torchrun (grey)."""
    fig, (life, curve) = plt.subplots(2, 1, figsize=(9, 5.6), height_ratios=[1.1, 1])
    ranks = sorted({event["rank"] for event in events})
    ends = [moment.time for moment in moments[1:]] + [moments[-1].time]
    for moment, end in zip(moments, ends):
        colour = STATES.get(moment.state)
        if colour:
            life.axvspan(moment.time - submitted, end - submitted, color=colour, zorder=0)
            if moment.reason not in ("None", ""):  # the legend names the state; this, why
                life.annotate(f"reason: {moment.reason}",
                              ((moment.time + end) / 2 - submitted, 1.0), xytext=(0, 3),
                              xycoords=("data", "axes fraction"), textcoords="offset points",
                              color="#555555", ha="center", va="bottom")
    markers = {"step": ("|", 10), "saved": ("v", 6), "stopping": ("s", 6), "started": (">", 6)}
    for event in events:
        marker, size = markers.get(event["event"], (None, 0))
        if marker is None:
            continue
        restart = event.get("restart", 0) if event["event"] == "started" else None
        life.plot([event["time"] - submitted], [event["rank"]], marker=marker, markersize=size,
                  linestyle="", color=COLORS[_restart_at(events, event)] if restart is None
                  else COLORS[restart])
        if event["event"] == "started":
            life.annotate(event["node"], (event["time"] - submitted, event["rank"]),
                          xytext=(-4, 5), textcoords="offset points", ha="right")
    life.axvline(requeued - submitted, color=SIGNAL, linestyle="--", linewidth=1.2)
    life.annotate("scontrol requeue: SIGTERM", (requeued - submitted, 0.5), xytext=(4, 0),
                  xycoords=("data", "axes fraction"), textcoords="offset points",
                  color=SIGNAL)
    life.set_yticks(ranks, [f"rank {rank}" for rank in ranks])
    life.set_ylim(-0.7, len(ranks) - 0.3)
    life.invert_yaxis()
    life.set_xlabel("seconds since sbatch")
    handles = [Patch(color=colour, label=state.lower()) for state, colour in STATES.items()]
    handles += [plt.Line2D([], [], marker=marker, linestyle="", color=GREY, label=name)
                for name, (marker, _) in markers.items()]
    handles += [Patch(color=COLORS[0], label="first run"),
                Patch(color=COLORS[1], label="after the requeue")]
    life.legend(handles=handles, ncols=5, loc="upper center", frameon=False,
                bbox_to_anchor=(0.5, -0.3))
    ordered = sorted(reference)
    curve.plot(ordered, [bits_per_byte(reference[step]) for step in ordered], color=GREY,
               linewidth=6, alpha=0.35, label="plain torchrun, one node, uninterrupted")
    by_restart = {}
    for event in events:
        if event["event"] == "step" and event["rank"] == 0:
            by_restart.setdefault(_restart_at(events, event), {})[event["step"]] = event["loss"]
    for restart, losses in sorted(by_restart.items()):
        steps = sorted(losses)
        curve.plot(steps, [bits_per_byte(losses[step]) for step in steps], "o-",
                   markersize=4, color=COLORS[restart],
                   label=f"Slurm, 2 nodes, {'first run' if restart == 0 else 'after the requeue'}")
    curve.set_xlabel("step")
    curve.set_ylabel("loss, bits per byte")
    curve.legend(frameon=False, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def _restart_at(events: list, event: dict) -> int:
    """The job restart an event belongs to: that of its rank's newest "started" before it."""
    starts = [other for other in events if other["event"] == "started"
              and other["rank"] == event["rank"] and other["time"] <= event["time"]]
    return max(starts, key=lambda other: other["time"])["restart"] if starts else 0


def plot_sweep(results: dict):
    """One loss curve a setting ({label: {step: nats}}), a job array's tasks side by side."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for index, (label, losses) in enumerate(results.items()):
        steps = sorted(losses)
        ax.plot(steps, [bits_per_byte(losses[step]) for step in steps], "o-", markersize=3,
                color=COLORS[index % len(COLORS)], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss, bits per byte")
    ax.legend(frameon=False, title="array task")
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's key figure, from the committed record of a requeued job (requeued.json,
    `python -m helpers.on_a_cluster record`)."""
    from helpers.on_a_cluster.__main__ import load

    recorded = load()
    return plot_requeued(recorded["moments"], recorded["events"], recorded["submitted"],
                         recorded["requeued"], recorded["reference"])
