"""Lesson 10's pictures: who holds which shard of which layer, tokens per expert, weight transfer
time against model size, ring attention's work per rank."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from helpers.composing.hybrid import locate
from helpers.composing.weights import VARIANTS
from helpers.drawing import COLORS, GREY, color

# --- mesh ---------------------------------------------------------------------------------------

def placements(results: list, full: dict) -> dict:
    """{parameter name: [where rank r's piece sits, for every rank]} for a run whose ranks
    returned "parameters" by the dense model's names: None where a rank does not hold it, "whole",
    or (dim, index, pieces), found by locating each rank's real tensor in the same parameter of
    `full` (the single-process model after the same training; helpers.composing.hybrid.locate,
    which raises if a piece is not there)."""
    found = {name: ["-"] * len(results) for name in full}
    for rank, result in enumerate(results):
        for name, local in result["parameters"].items():
            where = locate(local, full[name], atol=1e-4, rtol=0)
            found[name][rank] = "whole" if where is None else where
    return found


def rows_held(pieces: list, full) -> list:
    """For each row of `full` (a 2-D weight), the rank whose piece (pieces[rank], rows of it)
    holds it: each piece's rows located in `full` to within 1e-4 (the float32 runs' AdamW
    amplifies rounding). Raises if a row is not found, or is found twice."""
    owner = [None] * full.shape[0]
    for rank, piece in enumerate(pieces):
        for row in piece:
            matches = ((full - row).abs().amax(dim=1) <= 1e-4).nonzero().flatten().tolist()
            if len(matches) != 1 or owner[matches[0]] is not None:
                raise ValueError(f"rank {rank}'s row is found at rows {matches} of the weight")
            owner[matches[0]] = rank
    if None in owner:
        raise ValueError(f"rows {[i for i, o in enumerate(owner) if o is None]} held by no rank")
    return owner


def plot_rows_held(owner: list, places: list, title: str):
    """One weight's rows top to bottom, each coloured by the rank that holds it, with the rank
    and its mesh coordinates (`places`: each rank's {"dp": d, "tp": t}) written on each run of
    rows."""
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    start = 0
    for row in range(1, len(owner) + 1):
        if row == len(owner) or owner[row] != owner[start]:
            rank, place = owner[start], places[owner[start]]
            ax.barh(0, row - start, left=start, color=color(rank), edgecolor="white")
            ax.text((start + row) / 2, 0, f"rank {rank}\ndp {place['dp']}, tp {place['tp']}\n"
                    f"rows {start}-{row - 1}", ha="center", va="center",
                    color="white")
            start = row
    half = len(owner) // 2
    for left, label in ((0, "tp 0: Shard(0) on tp, first half"),
                        (half, "tp 1: second half")):
        ax.annotate("", xy=(left + half, 0.55), xytext=(left, 0.55),
                    arrowprops=dict(arrowstyle="<->", color=GREY))
        ax.text(left + half / 2, 0.62, label, ha="center")
    ax.set_xlim(0, len(owner))
    ax.set_ylim(-0.6, 0.85)
    ax.set_yticks([])
    ax.set_xlabel("row of the weight (its output features)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def _short(name: str) -> str:
    """blocks.0.attention.q.weight -> block 0 q; token_embedding.weight -> token embedding."""
    parts = name.removesuffix(".weight").split(".")
    if parts[0] == "blocks":
        return f"block {parts[1]} {parts[-1]}"
    return parts[0].replace("_", " ")


def _rows(found: dict) -> list:
    """The weight matrices (biases follow their layer) in order, neighbours of one block (or both
    outside the blocks) that every rank holds the same piece of in one row: [(label, placements)],
    "block 0 q, k, v"."""
    rows = []
    for name in (name for name in found if name.endswith(".weight")):
        group = name.split(".")[1] if name.startswith("blocks.") else None
        if rows and rows[-1][1:] == [found[name], group]:
            rows[-1][0].append(_short(name))
        else:
            rows.append([[_short(name)], found[name], group])
    return [(_joined(shorts), where) for shorts, where, _ in rows]


def _joined(shorts: list) -> str:
    """["block 0 q", "block 0 k"] -> "block 0 q, k"; ["token embedding", "position embedding"]
    -> "token + position embedding"; otherwise, listed."""
    heads, lasts = zip(*(short.rsplit(" ", 1) if " " in short else ("", short)
                         for short in shorts))
    if len(set(heads)) == 1:
        return f"{heads[0]} {', '.join(lasts)}".strip()
    if len(set(lasts)) == 1:
        return f"{' + '.join(heads)} {lasts[0]}"
    return ", ".join(shorts)


def plot_placements(found: dict, places: list, title: str):
    """A table: a row per weight matrix (biases follow their layer; neighbours placed alike share
    a row), a column per rank labelled with its grid coordinates; each cell says which piece of
    that weight the rank holds, coloured by the piece (grey: all of it; blank: none)."""
    rows = _rows(found)
    fig, ax = plt.subplots(figsize=(1.05 * len(places) + 2.2, 0.25 * len(rows) + 1.5))
    for row, (_, placed) in enumerate(rows):
        for rank, where in enumerate(placed):
            if where == "-":
                continue
            if where == "whole":
                fill, text = GREY, "whole"
            else:
                dim, index, pieces = where
                fill = color(index)
                text = f"{'rows' if dim == 0 else 'cols'} {index + 1}/{pieces}"
            ax.add_patch(plt.Rectangle((rank, row), 0.94, 0.9, facecolor=fill, alpha=0.85))
            ax.text(rank + 0.47, row + 0.45, text, ha="center", va="center", color="white",
                    fontweight="bold")
    ax.set_xlim(0, len(places))
    ax.set_ylim(len(rows), 0)
    ax.set_yticks([row + 0.45 for row in range(len(rows))], [label for label, _ in rows])
    labels = [f"rank {rank}\n({', '.join(str(coordinate) for coordinate in place.values())})"
              for rank, place in enumerate(places)]
    ax.set_xticks([rank + 0.47 for rank in range(len(places))], labels)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(f"{title}\nunder each rank, its place ({', '.join(places[0])})", pad=40)
    fig.tight_layout()
    return fig


def plot_projection(model, gpus: int, chosen: list, recomputation: str = "selective"):
    """Projected memory per GPU of `chosen` layouts (helpers.composing.strategy), by part, against
    the GPU's memory; each bar labelled with the link seconds its communication would take."""
    from helpers.composing.strategy import GPU_MEMORY, RECOMPUTATION_LABELS, project

    parts = ("weights", "gradients", "optimizer", "activations")
    rows = [project(model, layout, recomputation=recomputation) for layout in chosen]
    gib = 2**30
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(chosen) + 1.6))
    for index, row in enumerate(rows):
        left = 0.0
        for part_index, part in enumerate(parts):
            ax.barh(index, row[part] / gib, left=left, color=color(part_index),
                    label=part if index == 0 else None)
            left += row[part] / gib
        ax.text(max(left, GPU_MEMORY / gib) + 4, index, f"{row['seconds']:.2f} s on links"
                if row["fits"]
                else "does not fit", va="center")
    widest = max(max(row["memory"] for row in rows), GPU_MEMORY) / gib
    ax.set_xlim(0, widest * 1.4)  # room for the labels right of the bars
    ax.axvline(GPU_MEMORY / gib, color=COLORS[3], linestyle="--")
    ax.set_yticks(range(len(chosen)), [str(layout) for layout in chosen])
    ax.invert_yaxis()
    ax.set_xlabel("GiB per GPU (projection); dashed: an H100 SXM's 80 GiB")
    ax.set_title(f"{model.name} on {gpus} GPUs, {RECOMPUTATION_LABELS[recomputation]}: memory per "
                 "GPU, and the time its bytes take on the links")
    ax.legend(frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.28),
              ncol=len(parts))
    fig.tight_layout()
    return fig


def key_figure():
    """The lesson's figure for the README gallery: which rank holds which piece of which layer in
    a 2 x 2 x 2 run (data x pipeline x tensor parallelism), from a real run of one step."""
    from helpers.composing.workers import dp_tp_pp_worker
    from helpers.launcher import run
    from helpers.reference import lm_data, lm_loss, make_lm, train

    model, batches = make_lm(), lm_data(batch_size=8, steps=1)
    out = run(dp_tp_pp_worker, 8, args=(model, batches, (2, 2, 2)), show_output=False)
    found = placements(out.results, train(model, batches, lm_loss).parameters)
    return plot_placements(found, [result["place"] for result in out.results],
                           "dp x pp x tp = 2 x 2 x 2: the piece of each weight each rank holds")


# --- experts ------------------------------------------------------------------------------------


def _stacked_by_source(ax, per_source: list, bottom=None, **style):
    """One bar per expert, one segment per source rank (its colour)."""
    bottom = list(bottom or [0] * len(per_source[0]))
    for source, counts in enumerate(per_source):
        ax.bar(range(len(counts)), counts, bottom=bottom, color=color(source),
               label=f"from rank {source}", **style)
        bottom = [below + count for below, count in zip(bottom, counts)]
    return bottom


def plot_routing(results: list):
    """From moe_worker's results: left, the assignments each expert got before the capacity
    limit, by source rank, against the uniform share; right, for each expert and source rank,
    the assignments kept and dropped against the capacity C per expert per source rank."""
    experts = len(results)
    routed = [result["routed_per_expert"] for result in results]
    kept = [result["kept_per_expert"] for result in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    totals = _stacked_by_source(left, routed, edgecolor="white")
    uniform = sum(totals) / experts
    left.axhline(uniform, color="black", linestyle="--", linewidth=1,
                 label=f"uniform: {uniform:g} each")
    left.set_title(f"assignments per expert (top-k routing): {min(totals)} to {max(totals)}")
    left.set_ylabel("token assignments")
    left.set_ylim(top=1.5 * max(totals))  # room for the legend
    left.legend(frameon=False, loc="upper right")
    _kept_and_dropped(right, routed, kept, results[0]["capacity"])
    right.set_title(f"capacity factor {results[0]['capacity_factor']}: "
                    f"{sum(result['dropped'] for result in results)} of {sum(totals)} "
                    "dropped")
    for ax in (left, right):
        ax.set_xticks(range(experts), [f"expert {e}\n(rank {e})" for e in range(experts)])
    fig.tight_layout()
    return fig


def _kept_and_dropped(ax, routed, kept, capacity):
    """Grouped bars: for each expert, one bar per source rank, kept solid, dropped hatched grey."""
    sources, experts = len(routed), len(routed[0])
    width = 0.8 / sources
    for source in range(sources):
        positions = [expert - 0.4 + width * (source + 0.5) for expert in range(experts)]
        dropped = [routed_count - kept_count
                   for routed_count, kept_count in zip(routed[source], kept[source])]
        ax.bar(positions, kept[source], width, color=color(source), edgecolor="white")
        ax.bar(positions, dropped, width, bottom=kept[source], color="white", edgecolor=GREY,
               hatch="///", label="dropped" if source == 0 else None)
    if capacity is not None:
        ax.axhline(capacity, color="black", linestyle="--", linewidth=1,
                   label=f"capacity C = {capacity}")
    ax.set_ylabel("assignments from each rank")
    ax.legend(frameon=False, loc="upper right")


# --- weights ------------------------------------------------------------------------------------


def plot_transfer_times(sweep: list, title: str = ""):
    """Time to move the weights against their size (log-log), one line per variant, from
    weights.transfer_times_worker's records (median seconds; size = parameters * 4 bytes)."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    sizes = [record["parameters"] * 4 / 1e6 for record in sweep]
    for index, variant in enumerate(sweep[0]["seconds"]):
        ax.loglog(sizes, [record["seconds"][variant] * 1e3 for record in sweep], "o-",
                  color=color(index), label=VARIANTS[variant])
    for axis in (ax.xaxis, ax.yaxis):  # 1, 2, 5, 10 rather than powers of ten
        axis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("weights (MB, float32)")
    ax.set_ylabel("transfer time (ms, median)")
    ax.set_title(title)
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


# --- ring attention -----------------------------------------------------------------------------

def plot_ring_work(visible_pairs: dict, formula: dict, compute_ms: dict | None = None):
    """Ring attention's work per rank under each layout, {layout: [one value per rank]}: bars of
    the visible (query, key) pairs each rank counted in the run, the closed form
    (ring_attention.visible_pairs_formula) as a black tick on each bar; with `compute_ms`, a
    second panel of each rank's measured compute time."""
    panels = [("visible (query, key) pairs computed", visible_pairs)]
    if compute_ms is not None:
        panels.append(("compute time (ms, measured)", compute_ms))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3), squeeze=False)
    width = 0.8 / len(visible_pairs)
    for ax, (label, values) in zip(axes[0], panels):
        for index, (layout, per_rank) in enumerate(values.items()):
            ranks = [rank + (index - (len(values) - 1) / 2) * width
                     for rank in range(len(per_rank))]
            ax.bar(ranks, per_rank, width=width * 0.95, color=color(index), label=layout)
            if values is visible_pairs:
                ax.plot(ranks, formula[layout], "_", color="black", markersize=14,
                        markeredgewidth=2, label="formula" if index == 0 else None)
        ax.set_xticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
        ax.set_ylabel(label)
    axes[0, 0].legend(frameon=False)
    fig.tight_layout()
    return fig
