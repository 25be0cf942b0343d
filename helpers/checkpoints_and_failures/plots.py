"""Lesson 12's pictures: bytes per rank, a checkpoint's pieces and who reads them, a run resumed
on another number of ranks, the time lost against the interval between saves, a save in the
background, a job that survives a killed rank, and the ranks' flight records side by side."""

from __future__ import annotations

import tempfile

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from helpers.drawing import COLORS, GREY, legend_outside

KILLED = "#C44E52"
# the tensor the key figure shows: FSDP cuts its rows, tensor parallelism its columns
SHOWN = "model.blocks.0.feed_forward.down.weight"


def plot_bytes(measured: dict):
    """Bytes each rank wrote (left) and read (right), {(how, ranks): {"written": [per rank],
    "read": [per rank]}}: one group of bars per way and world size."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 2.8), sharey=True)
    for ax, what in zip(axes, ("written", "read")):
        ticks, labels, x = [], [], 0
        for index, ((how, ranks), values) in enumerate(measured.items()):
            xs = [x + rank for rank in range(ranks)]
            ax.bar(xs, [value / 1e3 for value in values[what]], 0.8, color=COLORS[index % 2])
            ticks.append(x + (ranks - 1) / 2)
            labels.append(f"{'full dict' if how == 'full' else 'DCP'}\n{ranks} ranks")
            x += ranks + 1
        ax.set_xticks(ticks, labels)
        ax.set_title(f"bytes each rank {what} (bars: ranks 0, 1, ...)")
        ax.set_ylabel("kB")
    fig.tight_layout()
    return fig


def plot_pieces(saved_rows: list, loads: dict, name: str = SHOWN):
    """One tensor of a checkpoint: left, the pieces it was saved in (colour: the file, that is the
    rank that wrote it); then, for each {label: [[Piece] per new rank]}, the part each new rank
    took from each piece it read, outlined and named."""
    rows = [row for row in saved_rows if row["name"] == name]
    shape = rows[0]["shape"]
    files = sorted({row["file"] for row in rows})
    fig, axes = plt.subplots(1, 1 + len(loads), figsize=(3.2 * (1 + len(loads)), 3.2))
    for ax in axes:
        ax.set_xlim(0, shape[1])
        ax.set_ylim(shape[0], 0)
        ax.set_aspect("auto")
        ax.set_xticks([0, shape[1]])
        ax.set_yticks([0, shape[0]])
        for row in rows:  # the stored pieces, in every panel
            ax.add_patch(Rectangle((row["start"][1], row["start"][0]), row["piece"][1],
                                   row["piece"][0], color=COLORS[files.index(row["file"])],
                                   alpha=1.0 if ax is axes[0] else 0.35, linewidth=0))
    for row in rows:
        axes[0].text(row["start"][1] + row["piece"][1] / 2, row["start"][0] + row["piece"][0] / 2,
                     row["file"], ha="center", va="center", color="white")
    axes[0].set_title(f"saved: {len(files)} files, one per rank")
    for ax, (label, per_rank) in zip(axes[1:], loads.items()):
        for rank, read in enumerate(per_rank):
            parts = [piece for piece in read if piece.name == name]
            top = min(piece.start[0] for piece in parts)
            left = min(piece.start[1] for piece in parts)
            bottom = max(piece.start[0] + piece.sizes[0] for piece in parts)
            right = max(piece.start[1] + piece.sizes[1] for piece in parts)
            ax.add_patch(Rectangle((left, top), right - left, bottom - top, fill=False,
                                   edgecolor="black", linewidth=1.5))
            sources = sorted({piece.file.removesuffix(".distcp") for piece in parts})
            ax.text((left + right) / 2, (top + bottom) / 2,
                    f"rank {rank}\nreads\n{', '.join(sources)}", ha="center", va="center")
        ax.set_title(f"loaded: {label}")
    fig.suptitle(f"{name.removeprefix('model.')}, {shape[0]} × {shape[1]}")
    fig.tight_layout()
    return fig


def plot_save_timelines(runs: dict, rank: int = 0):
    """One rank's steps and saves over time, {label: events [(what, start, end)]}: steps in
    green, a blocking save or async_save's staging in red, the background write in blue."""
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.6 * len(runs)))
    for row, events in enumerate(runs.values()):
        for what, start, end in events:
            lane = row - (0.22 if what == "write" else 0)
            height = 0.2 if what == "write" else 0.4
            colour = {"write": COLORS[0], "wait": GREY}.get(
                what, COLORS[2] if what.startswith("step") else KILLED)
            ax.barh(lane, end - start, left=start, height=height, color=colour,
                    edgecolor="white", linewidth=0.5)
            if what.startswith("step"):
                ax.text((start + end) / 2, lane, what.split()[1], ha="center", va="center",
                        color="white")
    ax.set_yticks(range(len(runs)), list(runs))
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds on rank {rank}")
    handles = [Rectangle((0, 0), 1, 1, color=colour) for colour in
               (COLORS[2], KILLED, COLORS[0])]
    ax.legend(handles, ["training step", "save (blocking) / staging", "writing in background"],
              frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=3)
    fig.tight_layout()
    return fig


def plot_resized_losses(runs: dict, reference: dict):
    """The loss of each step, {label: {step: loss}} for each run (a colour each), over the one
    process reference {step: loss} (a grey line), and a dotted line where the runs change."""
    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    steps = sorted(reference)
    ax.plot(steps, [reference[step] for step in steps], color=GREY, linewidth=3, alpha=0.5,
            label="one process, the whole global batch")
    for index, (label, losses) in enumerate(runs.items()):
        ax.plot(sorted(losses), [losses[step] for step in sorted(losses)], "o",
                color=COLORS[index], label=label)
        if index:
            ax.axvline(min(losses) - 0.5, color=GREY, linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss of the global batch")
    ax.set_xticks(steps)
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def plot_lost_time(curves: dict, mtbf_s: float):
    """From a formula, not a run: the fraction of a job's time lost to saves and redone work
    against the interval between saves, lost(τ) = δ/τ + τ/2M, for each {label: δ in seconds},
    from τ = 2δ (or 1 s) to τ = M, with Young's interval √(2δM) marked."""
    import numpy as np

    from helpers.checkpoints_and_failures.interval import lost_fraction, young_interval

    fig, ax = plt.subplots(figsize=(6.4, 3))
    for index, (label, save_s) in enumerate(curves.items()):
        # from a save every 2δ (half the time saving; shorter is meaningless) to one every M
        intervals = np.logspace(np.log10(max(2 * save_s, 1.0)), np.log10(mtbf_s), 400)
        best = young_interval(save_s, mtbf_s)
        ax.plot(intervals, 100 * lost_fraction(intervals, save_s, mtbf_s), color=COLORS[index],
                label=f"{label}: τ = √(2δM) = {best:,.0f} s")
        ax.plot([best], [100 * lost_fraction(best, save_s, mtbf_s)], "o", color=COLORS[index])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("seconds between saves, τ")
    ax.set_ylabel("% of time lost")
    ax.set_title(f"from a formula: lost = δ/τ + τ/2M, M = {mtbf_s / 3600:.1f} h (Llama 3)")
    legend_outside(fig, ax.get_legend_handles_labels()[0], ncols=1)
    return fig


def plot_job(job, story: list):
    """A torchrun job from its workers' and its agent's own logs. Top, the whole run: for each
    rank a tick per step (colour: the attempt), a triangle per save, a cross where it was
    killed, and what the agent did, `story` [(seconds, what)], as numbered dashed lines listed
    below. Bottom, each attempt's training close up, rank 0's steps numbered."""
    ranks = sorted({event["rank"] for event in job.events})
    attempts = sorted({event["attempt"] for event in job.events})
    fig, axes = plt.subplot_mosaic([["all"] * len(attempts), attempts], figsize=(10, 5.2),
                                   height_ratios=[1, 1])
    markers = {"step": ("|", 12), "saved": ("v", 6), "started": (">", 6), "killed": ("X", 11),
               "stopping": ("s", 6)}  # a stop signal (lesson 14's job, under Slurm: lesson 15)
    for name, ax in axes.items():
        shown = [event for event in job.events if name == "all" or event["attempt"] == name]
        for event in shown:
            x, y = job.seconds(event["time"]), event["rank"]
            marker, size = markers[event["event"]]
            colour = KILLED if event["event"] == "killed" else COLORS[event["attempt"]]
            ax.plot([x], [y], marker=marker, markersize=size, color=colour, linestyle="")
            if name != "all" and event["event"] == "step" and y == ranks[0]:
                ax.annotate(str(event["step"]), (x, y), xytext=(0, 8),
                            textcoords="offset points", ha="center", color=colour)
        if name != "all":
            times = [job.seconds(event["time"]) for event in shown]
            ax.set_xlim(min(times) - 0.05, max(times) + 0.05)
            ax.set_title(f"attempt {name}, close up")
        for number, (seconds, _) in enumerate(story, start=1):
            ax.axvline(seconds, color=GREY, linewidth=0.8, linestyle="--")
            if name == "all":
                ax.annotate(str(number), (seconds, ranks[0] - 0.5 - 0.45 * (number % 3)),
                            ha="center", va="bottom",
                            bbox={"boxstyle": "circle,pad=0.15", "fc": "white", "ec": GREY})
        ax.set_yticks(ranks, [f"rank {rank}" for rank in ranks])
        ax.set_ylim(ranks[-1] + 0.6, ranks[0] - (1.9 if name == "all" else 0.9))
    axes["all"].set_title("the whole job; numbered: what the agent did")
    axes["all"].set_xlabel("seconds since torchrun started")
    listed = "   ".join(f"{number}: {what}" for number, (_, what) in enumerate(story, start=1))
    fig.text(0.5, 0.015, f"agent, from its log:   {listed}", ha="center")
    legend = [plt.Line2D([], [], marker=">", linestyle="", color=COLORS[0], label="started"),
              plt.Line2D([], [], marker="|", linestyle="", markersize=10, color=COLORS[0],
                         label="step, attempt 0"),
              plt.Line2D([], [], marker="|", linestyle="", markersize=10, color=COLORS[1],
                         label="step, attempt 1"),
              plt.Line2D([], [], marker="v", linestyle="", color=GREY, label="checkpoint saved"),
              plt.Line2D([], [], marker="X", linestyle="", color=KILLED, label="SIGKILL")]
    fig.legend(handles=legend, frameon=False, loc="lower center",
               bbox_to_anchor=(0.5, 0.04), ncol=5)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return fig


def plot_flight_records(dumps: list, rows: list):
    """The ranks' last collectives side by side, from their flight-recorder dumps, lined up by
    sequence number (`rows`, from failures.compare): a cell per (rank, number), red where a rank
    differs from the others."""
    numbers = [number for number, _ in rows]
    fig, ax = plt.subplots(figsize=(1.6 + 1.7 * len(numbers), 0.6 + 0.42 * len(dumps)))
    for column, (_, calls) in enumerate(rows):
        names = list(calls.values())
        common = max(set(names), key=names.count)
        for rank, call in calls.items():
            odd = call != common
            ax.add_patch(Rectangle((column, rank), 0.95, 0.9, color=KILLED if odd else COLORS[0],
                                   alpha=0.9 if odd else 0.35))
            ax.text(column + 0.47, rank + 0.45, call or "(nothing)", ha="center", va="center",
                    color="white" if odd else "black")
    ax.set_xlim(0, len(numbers))
    ax.set_ylim(len(dumps), 0)
    ax.set_xticks([column + 0.47 for column in range(len(numbers))],
                  [f"#{number}" for number in numbers])
    ax.set_yticks([rank + 0.45 for rank in range(len(dumps))],
                  [f"rank {rank}" for rank in range(len(dumps))])
    ax.set_xlabel("collective sequence number in the group")
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's key figure, from a run: TinyLM saved with DCP by FSDP on 4 ranks, and the
    pieces of one weight that each rank reads when DP × TP on a 2 × 2 mesh loads it (the
    notebook adds FSDP on 2 ranks)."""
    from helpers import reference, run
    from helpers.checkpoints_and_failures.sharded import load_worker, pieces, save_worker

    model, batches = reference.make_lm(seed=0), reference.lm_data(seed=1, batch_size=8)
    with tempfile.TemporaryDirectory() as directory:
        run(save_worker, 4, show_output=False,
            kwargs=dict(model=model, batches=batches, directory=directory, how="dcp"))
        out = run(load_worker, 4, show_output=False,
                  kwargs=dict(model=model, directory=directory, how="dcp", layout="dp_tp"))
        return plot_pieces(pieces(directory), {"DP × TP, 2 × 2": [rank["read"] for rank in out]})
