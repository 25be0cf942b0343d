"""Lesson 08's pictures: the lecture's output against the dense one, who holds what in the
paper's MLP, the activations each rank keeps, and the share of a step spent communicating."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from helpers.drawing import COLORS, GREY, color
from helpers.tensor_parallelism.cost import projected_layer_seconds
from helpers.tensor_parallelism.memory import block_formula

PART_COLORS = {"outside": COLORS[3], "inside": COLORS[0], "statistics": GREY}
PART_NAMES = {"outside": "outside the parallel regions", "inside": "inside them",
              "statistics": "LayerNorm and softmax statistics"}


def plot_outputs(outputs: dict, world_size: int, every: int = 1):
    """Each output (batch x num_dim, or every `every`-th feature of it), {title: tensor}, as an
    image, with the ranks' column blocks marked: the lecture's repeats one block n times."""
    fig, axes = plt.subplots(1, len(outputs), figsize=(3.5 * len(outputs), 2.7), squeeze=False)
    for ax, (title, out) in zip(axes[0], outputs.items()):
        limit = float(out.abs().max())  # each its own scale: the lecture's values are larger
        image = ax.imshow(out.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
        fig.colorbar(image, ax=ax, shrink=0.8)
        width = out.shape[1] // world_size
        for rank in range(world_size):
            ax.add_patch(Rectangle((rank * width - 0.5, -0.5), width, out.shape[0],
                                   fill=False, edgecolor=color(rank), linewidth=3))
        ax.set_title(title)
        ax.set_xlabel(f"feature / {every} (a box per rank's block)")
        ax.set_yticks([])
    axes[0, 0].set_ylabel("example")
    fig.tight_layout()
    return fig


def _matrix(ax, x, y, width, height, pieces, along, label):
    """A matrix as a rectangle cut into `pieces` coloured by rank, along 'columns' or 'rows'."""
    for rank in range(pieces):
        if along == "columns":
            box = (x + rank * width / pieces, y, width / pieces, height)
        else:
            box = (x, y + height - (rank + 1) * height / pieces, width, height / pieces)
        ax.add_patch(Rectangle(box[:2], *box[2:], facecolor=color(rank) if pieces > 1 else GREY,
                               edgecolor="white", linewidth=1.5, alpha=0.9))
    ax.text(x + width / 2, y - 0.35, label, ha="center", va="top")


def plot_sharded_mlp(world_size: int = 2):
    """The paper's MLP, Z = GeLU(X A) B, on `world_size` ranks (Shoeybi et al. 2019, §3): X
    whole on every rank, A cut by columns, Y = GeLU(X A) by columns, B by rows, and the partial
    products summed by g. Colours are ranks."""
    fig, ax = plt.subplots(figsize=(9, 3))
    _matrix(ax, 0, 1, 1.2, 2, 1, "columns", "X (b x h)\nthe same on every rank")
    ax.annotate("f", (1.9, 2.35), fontsize=16, ha="center", va="center", fontweight="bold")
    _matrix(ax, 2.6, 1, 2, 2, world_size, "columns", "A (h x 4h)\nrank r: columns r")
    _matrix(ax, 5.2, 1, 2, 2, world_size, "columns", "Y = GeLU(X A)\nrank r: columns r")
    _matrix(ax, 7.8, 0.5, 1.2, 3, world_size, "rows", "B (4h x h)\nrank r: rows r")
    for rank in range(world_size):  # the partial products: one whole b x h card per rank
        offset = 0.12 * (world_size - 1 - rank)
        ax.add_patch(Rectangle((9.6 + offset, 1 - offset), 1.2, 2, facecolor=color(rank),
                               edgecolor="white", linewidth=1.5, alpha=0.95))
    ax.text(10.3, 3.2, "Y_r B_r (b x h) on rank r:\npartial sums", ha="center", va="bottom")
    ax.annotate("g", (11.75, 2.35), fontsize=16, ha="center", va="center", fontweight="bold")
    _matrix(ax, 12.3, 1, 1.2, 2, 1, "columns", "Z (b x h)\nsummed: on every rank")
    for start, end in ((1.25, 2.55), (4.65, 5.15), (7.25, 7.75), (9.05, 9.55), (11.3, 12.25)):
        ax.annotate("", (end, 2.0), (start, 2.0), arrowprops={"arrowstyle": "->", "color": GREY})
    ax.text(5.2, 3.75, "no communication between f and g", ha="center",
            color=GREY)
    ax.set_xlim(-0.2, 13.7)
    ax.set_ylim(-0.6, 4.1)
    ax.axis("off")
    ax.set_title(f"The paper's MLP on {world_size} ranks: f is an all-reduce in backward, g one "
                 "in forward")
    fig.tight_layout()
    return fig


def plot_activation_memory(measured: dict, s: int, b: int, h: int, a: int):
    """Measured activation bytes per rank, {(t, sequence_parallel): bytes}, as black dots on the
    formula's bars (memory.block_formula), stacked by where the tensors are."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    labels = []
    for x, (t, sequence_parallel) in enumerate(measured):
        parts = block_formula(s, b, h, a, t, sequence_parallel)
        bottom = 0.0
        for part, value in parts.items():
            ax.bar(x, value / 1e3, 0.6, bottom=bottom / 1e3, color=PART_COLORS[part],
                   edgecolor="white", label=PART_NAMES[part] if x == 0 else None)
            bottom += value
        ax.plot(x, measured[t, sequence_parallel] / 1e3, "o", color="black",
                label="measured" if x == 0 else None)
        labels.append(f"t = {t}\n{'TP + SP' if sequence_parallel else 'TP'}" if t > 1
                      else "t = 1\none rank")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("activations kept per rank (kB)")
    ax.set_title(f"One block, b = {b}, s = {s}, h = {h}, {a} heads: bars are the formula")
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def plot_communication_share(measured: dict, s: int, b: int, widths: list, links: list,
                             t: int = 8):
    """Left: the measured share of a step spent in collectives, {t: {h: (step_s, comm_s)}}.
    Right: the projection (cost.projected_layer_seconds) for one layer of width h on t ranks at
    sequence length s, for each published link."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.3))
    for index, (world_size, by_width) in enumerate(measured.items()):
        dims = list(by_width)
        shares = [100 * comm / step for step, comm in by_width.values()]
        left.plot(dims, shares, "o-", color=color(index), label=f"{world_size} ranks")
    left.set_xscale("log", base=2)
    left.set_xlabel("hidden size h")
    left.set_ylabel("% of forward + backward\nin collectives")
    left.set_ylim(0, 100)
    left.set_title("measured here: gloo, CPU")
    left.legend(frameon=False)
    for index, link in enumerate(links):
        shares = []
        for h in widths:
            seconds = projected_layer_seconds(s, b, h, t, link)
            shares.append(100 * seconds["communication"] / sum(seconds.values()))
        right.plot(widths, shares, "s--", color=color(index + 2), label=link)
    right.set_xscale("log", base=2)
    right.set_xlabel("hidden size h")
    right.set_ylim(0, 100)
    right.set_title(f"projected: {t} ranks, s = {s}, b = {b}, bf16, H100 peak")
    right.legend(frameon=False)
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's key figure, from fixed inputs: the paper's MLP on 4 ranks."""
    return plot_sharded_mlp(4)
