"""Lesson 07's pictures: bytes per parameter, measured bytes per rank against the ZeRO formulas,
bytes sent per step, the readable and the bucketed ZeRO-1 on a step's timeline, and the memory
calculator."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from helpers.drawing import COLORS, legend_outside, plot_step_timelines
from helpers.zero_and_fsdp.memory import BYTES_PER_PARAMETER, PARTS, bytes_per_rank
from helpers.zero_and_fsdp.workers import STAGE_1_2_LABELS

PART_COLORS = {"weights": COLORS[0], "gradients": COLORS[1], "optimizer": COLORS[2]}
STAGE_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def _stacked(ax, x, parts: dict, width, scale, label_parts=False):
    bottom = 0.0
    for part in PARTS:
        ax.bar(x, parts[part] / scale, width, bottom=bottom / scale, color=PART_COLORS[part],
               label=part if label_parts else None, edgecolor="white", linewidth=0.5)
        bottom += parts[part]
    return bottom


def plot_zero_1_steps(timelines: list):
    """One measured step of each ZeRO-1 (workers.zero_1_timeline_worker's result, one per
    rank): compute against reduce-scatters and all-gathers."""
    runs = {STAGE_1_2_LABELS[key]: {"events": [rank[key]["events"] for rank in timelines],
                                    "step_seconds": timelines[0][key]["step_seconds"]}
            for key in timelines[0]}
    return plot_step_timelines(runs, collectives=("reduce_scatter", "all_gather"),
                               waiting_for="reduce_scatter")


def plot_memory(measured: dict, num_parameters: int, precision: str = "float32",
                gathered: dict | None = None):
    """Measured bytes per rank, {world_size: {stage: {part: bytes}}}, as stacked bars, with the
    formula's total for each (memory.bytes_per_rank) as a black tick; `gathered`,
    {world_size: bytes}, adds ZeRO-3's peak of gathered weights on top of its bar, hatched."""
    world_sizes = list(measured)
    fig, axes = plt.subplots(1, len(world_sizes), figsize=(3.3 * len(world_sizes), 3.2),
                             sharey=True, squeeze=False)
    for ax, world_size in zip(axes[0], world_sizes):
        stages = list(measured[world_size])
        for x, stage in enumerate(stages):
            top = _stacked(ax, x, measured[world_size][stage], 0.6, 1e3, label_parts=x == 0)
            if stage == 3 and gathered:
                ax.bar(x, gathered[world_size] / 1e3, 0.6, bottom=top / 1e3, color="white",
                       edgecolor=COLORS[4], hatch="///",
                       label="gathered layer (peak)" if world_size == world_sizes[-1] else None)
            formula = bytes_per_rank(num_parameters, world_size, stage, precision)["total"]
            ax.plot([x - 0.38, x + 0.38], [formula / 1e3] * 2, color="black", linewidth=2,
                    label="formula" if x == 0 else None)
        ax.set_xticks(range(len(stages)), [STAGE_NAMES[stage] for stage in stages])
        ax.set_title(f"{world_size} rank{'s' if world_size > 1 else ''}")
    axes[0, 0].set_ylabel(f"bytes held per rank (kB)\n{precision} accounting")
    legend_outside(fig, axes[0, -1].get_legend_handles_labels()[0], ncols=3)
    return fig


def plot_communication(sent: dict, world_size: int, num_parameters: int):
    """Bytes each rank sent in one step, {stage: {collective: bytes}}, stacked by collective,
    with data parallelism's 2(n-1)/n x 4 Psi and ZeRO-3's 3(n-1)/n x 4 Psi marked."""
    fig, ax = plt.subplots(figsize=(8, 3))
    stages = list(sent)
    collectives = sorted({name for counts in sent.values() for name in counts})
    for x, stage in enumerate(stages):
        bottom = 0.0
        for index, name in enumerate(collectives):
            value = sent[stage].get(name, 0) / 1e3
            ax.bar(x, value, 0.6, bottom=bottom, color=COLORS[index + 3],
                   label=name if x == 0 else None, edgecolor="white")
            bottom += value
    data_parallel = 2 * (world_size - 1) / world_size * 4 * num_parameters / 1e3
    for factor, text, style in ((1.0, "2(n-1)/n x the weights' bytes", "--"),
                                (1.5, "1.5 x that", ":")):
        ax.axhline(factor * data_parallel, color="black", linestyle=style, linewidth=1,
                   label=text)
    ax.set_xticks(range(len(stages)), [STAGE_NAMES[stage] for stage in stages])
    ax.set_ylabel(f"kB sent per rank per step\n({world_size} ranks)")
    ax.set_ylim(0, 1.7 * data_parallel)
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def plot_calculator(num_parameters: float, world_size: int, precision: str = "mixed",
                    memory_gb: float = 80.0):
    """Model-state GB per rank at each stage for a model of `num_parameters` on `world_size`
    ranks, and the device's memory as a line."""
    fig, ax = plt.subplots(figsize=(6.5, 3))
    totals = []
    for stage in range(4):
        held = bytes_per_rank(num_parameters, world_size, stage, precision)
        totals.append(_stacked(ax, stage, held, 0.6, 1e9, label_parts=stage == 0))
        ax.text(stage, totals[-1] / 1e9, f"{totals[-1] / 1e9:.1f} GB", ha="center",
                va="bottom")
    ax.axhline(memory_gb, color="black", linestyle="--", linewidth=1)
    ax.text(3.4, memory_gb, f"{memory_gb:g} GB", va="bottom", ha="right")
    ax.set_xticks(range(4), [STAGE_NAMES[stage] for stage in range(4)])
    ax.set_ylabel("model states per rank (GB)")
    ax.set_ylim(0, max(max(totals) / 1e9, memory_gb) * 1.18)
    ax.set_title(f"{num_parameters / 1e9:g} B parameters, {world_size} ranks, {precision} "
                 "precision with Adam")
    ax.legend(frameon=False, loc="upper right")
    fig.tight_layout()
    return fig


def plot_bytes_per_parameter():
    """Bytes per parameter of training with Adam: float32, and the ZeRO paper's mixed precision."""
    fig, ax = plt.subplots(figsize=(5.5, 2.2))
    for y, parts in enumerate(BYTES_PER_PARAMETER.values()):
        left = 0
        for part in PARTS:
            ax.barh(y, parts[part], left=left, color=PART_COLORS[part], edgecolor="white",
                    label=part if y == 0 else None)
            ax.text(left + parts[part] / 2, y, f"{parts[part]}", ha="center", va="center",
                    color="white", fontweight="bold")
            left += parts[part]
    ax.set_yticks([0, 1], list(BYTES_PER_PARAMETER))
    ax.set_xticks(np.arange(0, 17, 2))
    ax.set_xlabel("bytes per parameter")
    ax.invert_yaxis()
    ax.legend(frameon=False, ncols=3, loc="lower center", bbox_to_anchor=(0.5, 1))
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's key figure, from fixed inputs: the calculator for the ZeRO paper's Figure 1
    example (7.5 B parameters, 64 ranks, mixed precision, K = 12)."""
    return plot_calculator(7.5e9, 64, "mixed")
