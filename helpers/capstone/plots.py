"""Lesson 14's pictures, drawn in the kernel from what the ranks returned."""

from __future__ import annotations

import json
import os

import matplotlib.pyplot as plt

from helpers.capstone.corpus import bits_per_byte
from helpers.drawing import COLORS, GREY

COMPUTE, COMMUNICATION = "#55A868", "#4C72B0"
LANES = {"compute": COMPUTE, "communication DTensor": COMMUNICATION,
         "communication FSDP2": "#DD8452"}
TRAINED_FILE = os.path.join(os.path.dirname(__file__), "trained.json")


def plot_run(runs: dict, unigram: float | None = None, title: str = ""):
    """Loss curves in bits per byte: for each run {label: (steps, validation)} (steps: {step:
    {"loss": nats, ...}}, validation: {step: bits per byte}), the training loss of every step
    and the validation loss (dots), the first run wide and pale, the others dashed over it; the
    unigram baseline as a grey dashed line."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for index, (label, (steps, validation)) in enumerate(runs.items()):
        ordered, style = sorted(steps), "-" if index == 0 else "--"  # a later run dashed, on top
        ax.plot(ordered, [bits_per_byte(steps[step]["loss"]) for step in ordered], style,
                color=COLORS[index], linewidth=2.5 if index == 0 else 1.2,
                alpha=0.5 if index == 0 else 0.9, label=f"{label}: training")
        if validation:
            ax.plot(sorted(validation), [validation[step] for step in sorted(validation)],
                    "o" + style, color=COLORS[index], markersize=6 if index == 0 else 3.5,
                    label=f"{label}: held-out text")
    if unigram is not None:
        ax.axhline(unigram, color=GREY, linestyle="--", linewidth=1)
        ax.annotate("unigram baseline (byte frequencies)", (0, unigram), xytext=(4, 4),
                    textcoords="offset points", color=GREY)
    ax.set_xlabel("step")
    ax.set_ylabel("loss, bits per byte")
    ax.set_ylim(top=min(9.5, ax.get_ylim()[1]))  # an untrained model starts near 8.8
    ax.legend(frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_resumed(attempts: dict, uninterrupted: dict, killed_after: int, resumed_after: int):
    """The torchrun job's losses by step, one colour per attempt ({attempt: {step: nats}}), over
    the uninterrupted run's (grey): where the kill was, and the checkpoint the restart loaded."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ordered = sorted(uninterrupted)
    ax.plot(ordered, [bits_per_byte(uninterrupted[step]) for step in ordered], color=GREY,
            linewidth=6, alpha=0.35, label="uninterrupted run (launcher)")
    for attempt, losses in sorted(attempts.items()):
        steps = sorted(losses)
        ax.plot(steps, [bits_per_byte(losses[step]) for step in steps], "o-", markersize=3.5,
                color=COLORS[attempt], label=f"torchrun, attempt {attempt}")
    ax.axvline(killed_after + 0.5, color="#C44E52", linestyle="--", linewidth=1)
    ax.annotate(f"rank killed after step {killed_after}", (killed_after + 0.5, 1), xytext=(4, -12),
                xycoords=("data", "axes fraction"), textcoords="offset points",
                color="#C44E52")
    ax.axvline(resumed_after, color=COLORS[1], linestyle=":", linewidth=1)
    ax.annotate(f"restart loads step {resumed_after}", (resumed_after, 0), xytext=(-4, 6),
                xycoords=("data", "axes fraction"), textcoords="offset points",
                ha="right", color=COLORS[1])
    ax.set_xlabel("step")
    ax.set_ylabel("loss, bits per byte")
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def plot_traces(per_rank: list, window: tuple | None = None):
    """The profiled steps of every rank, from its trace (profiled.profile_worker's intervals, in
    seconds on one clock, drawn from the earliest operation of any rank): a lane of compute and
    a lane of communication in flight, each owner's in its colour; on the right, each rank's
    totals: compute, each owner's communication, and the share of communication under
    compute."""
    fig, (ax, totals) = plt.subplots(1, 2, figsize=(10, 0.75 * len(per_rank) + 1.6),
                                     width_ratios=[3, 1.2], sharey=True)
    origin = min(start for found in per_rank for spans in found["intervals"].values()
                 for start, _ in spans)
    for rank, found in enumerate(per_rank):
        for lane, kind in ((0, "compute"), (1, "communication DTensor"),
                           (1, "communication FSDP2")):
            spans = [(start - origin, end - start) for start, end in found["intervals"][kind]]
            ax.broken_barh(spans, (rank - 0.38 + 0.4 * lane, 0.36), facecolors=LANES[kind],
                           edgecolors="none")
        numbers = found["breakdown"]
        totals.barh(rank - 0.2, numbers["compute_s"], height=0.36, color=COMPUTE)
        left = 0.0
        for owner in ("DTensor", "FSDP2"):
            seconds = numbers["owners"][owner]["communication"]
            totals.barh(rank + 0.2, seconds, left=left, height=0.36,
                        color=LANES[f"communication {owner}"])
            left += seconds
        totals.barh(rank + 0.2, numbers["overlap_s"], height=0.36, color="none",
                    edgecolor="black", hatch="///", linewidth=0.5)
        totals.annotate(f"{numbers['overlap_share']:.0%} hidden", (left, rank + 0.2),
                        xytext=(3, 0), textcoords="offset points", va="center")
    if window is not None:
        ax.set_xlim(*window)
    ax.set_yticks(range(len(per_rank)), [f"rank {rank}" for rank in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the trace began (the profiled steps)")
    ax.set_title("top of each row: computing; bottom: a collective in flight (gloo's threads)")
    totals.set_xlabel("seconds in the profiled steps")
    totals.set_title("totals; hatched: communication under compute")
    totals.margins(x=0.35)
    legend = [plt.Rectangle((0, 0), 1, 1, color=COMPUTE, label="compute"),
              plt.Rectangle((0, 0), 1, 1, color=COMMUNICATION,
                            label="DTensor's communication (tensor parallelism, over tp)"),
              plt.Rectangle((0, 0), 1, 1, color=LANES["communication FSDP2"],
                            label="FSDP2's communication (over dp)")]
    fig.legend(handles=legend, loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def scaling(seconds: dict, tokens_per_step: int) -> dict:
    """{ranks: {layout: (tokens per second, efficiency)}} from {ranks: {layout: seconds a step}}
    ("one_process" on 1 rank): the efficiency is tokens per second / (ranks x one process's)."""
    alone = tokens_per_step / seconds[1]["one_process"]
    return {ranks: {layout: (tokens_per_step / step, tokens_per_step / step / (ranks * alone))
                    for layout, step in found.items()} for ranks, found in seconds.items()}


def plot_scaling(seconds: dict, tokens_per_step: int, labels: dict | None = None):
    """The same batch under each layout on 1, 2 and 4 ranks ({ranks: {layout: seconds a step}},
    "one_process" on 1 rank; `labels`: {layout: its name on the figure}): tokens per second on
    the left; on the right, the efficiency of each (`scaling`), 100 % being perfect scaling."""
    fig, (rate, efficiency) = plt.subplots(1, 2, figsize=(10, 3.6))
    found = scaling(seconds, tokens_per_step)
    alone = found[1]["one_process"]
    layouts = dict.fromkeys(key for each in found.values() for key in each
                            if key != "one_process")  # in order of appearance
    for index, layout in enumerate(layouts):
        ranks = [1] + sorted(n for n, each in found.items() if layout in each)
        points = [alone] + [found[n][layout] for n in ranks[1:]]
        label = (labels or {}).get(layout, layout)
        rate.plot(ranks, [tokens for tokens, _ in points], "o-", color=COLORS[index],
                  label=label)
        efficiency.plot(ranks, [share for _, share in points], "o-", color=COLORS[index],
                        label=label)
    ranks = sorted(seconds)
    rate.plot(ranks, [n * alone[0] for n in ranks], ":", color=GREY, label="perfect scaling")
    efficiency.axhline(1, linestyle=":", color=GREY)
    rate.set_ylabel("tokens per second, the whole job")
    efficiency.set_ylabel("efficiency: tokens/s / (ranks x one process's)")
    efficiency.yaxis.set_major_formatter(plt.matplotlib.ticker.PercentFormatter(1))
    efficiency.set_ylim(0, 1.1)
    for ax in (rate, efficiency):
        ax.set_xticks(ranks)
        ax.set_xlabel("ranks (every line starts from one process)")
    rate.legend(frameon=False)
    fig.tight_layout()
    return fig


def load_trained() -> dict:
    """The committed record of `make train` (helpers/capstone/trained.json): its configuration,
    every step's record, the validation losses, the unigram baseline, and the sample."""
    with open(TRAINED_FILE) as file:
        return json.load(file)


def key_figure():
    """The lesson's key figure, from the committed record of `make train` (trained.json)."""
    trained = load_trained()
    steps = {int(step): record for step, record in trained["steps"].items()}
    validation = {int(step): value for step, value in trained["validation"].items()}
    return plot_run({"4 ranks, dp 2 x tp 2": (steps, validation)}, trained["unigram_bits"],
                    title=f"A Llama of {trained['parameters'] / 1e6:.2f} M parameters learns "
                          "Python's standard library, byte by byte (make train)")
