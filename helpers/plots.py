"""Pictures of what the ranks returned, drawn in the notebook kernel (workers never plot).

Lesson 01 (notebooks/01_processes_and_groups.ipynb): threads vs processes, group membership.
Lesson 02 (notebooks/02_point_to_point.ipynb): the send/recv chain, per-rank timelines.
Lesson 03 (notebooks/03_collectives.ipynb): every rank's buffers before and after a collective.
Lesson 04 (notebooks/04_measuring_communication.ipynb): size sweeps, the alpha-beta fit, links.
Lesson 05 (notebooks/05_how_all_reduce_works.ipynb): ring steps, bytes per rank, cost models.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch, Rectangle

GROUP_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860"]
EVENT_COLORS = {"compute": "#55A868", "send": "#4C72B0", "recv": "#4C72B0", "isend": "#8172B3",
                "irecv": "#8172B3", "wait": "#C44E52"}


def plot_threads_vs_processes(timings: dict, cores: int):
    """Wall time of n copies of a CPU-bound loop: n threads (one GIL) against n processes."""
    workers = timings["workers"]
    single = timings["threads"][0]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.38
    positions = range(len(workers))
    for offset, kind, color in ((-width / 2, "threads", "#C44E52"), (width / 2, "processes", "#4C72B0")):
        bars = ax.bar([p + offset for p in positions], timings[kind], width, label=kind, color=color)
        ax.bar_label(bars, fmt="%.2f s", fontsize=8)
    ideal = [single * max(1.0, n / cores) for n in workers]
    ax.plot(positions, ideal, "k--", lw=1, label=f"ideal on {cores} cores")
    ax.set_xticks(list(positions), [f"{n} worker{'s' if n > 1 else ''}" for n in workers])
    ax.set_ylabel("wall time (s)")
    ax.set_title("The same CPU-bound loop, n copies at once")
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def plot_groups(results: list, title: str = "Which group each rank joined"):
    """One box per rank, coloured by its group, labelled with the value it got back."""
    fig, ax = plt.subplots(figsize=(1.6 * len(results) + 1, 2.2))
    for item in results:
        _rank_box(ax, item["rank"], 0, GROUP_COLORS[item["group"] % len(GROUP_COLORS)],
                  f"rank {item['rank']}\nsum = {item['group_sum']}")
    for group in sorted({item["group"] for item in results}):
        members = [item["rank"] for item in results if item["group"] == group]
        ax.annotate(f"group {group}: ranks {members}", ((min(members) + max(members)) / 2 * 1.2 + 0.5, 1.15),
                    ha="center", color=GROUP_COLORS[group % len(GROUP_COLORS)], fontweight="bold")
    ax.set_xlim(-0.2, 1.2 * len(results))
    ax.set_ylim(-0.2, 1.4)
    ax.set_title(title)
    ax.axis("off")
    fig.tight_layout()
    return fig


def plot_grid(results: list):
    """The rows x cols grid: each rank coloured by its row group, outlined by its column group."""
    rows = 1 + max(item["row"] for item in results)
    cols = 1 + max(item["col"] for item in results)
    fig, ax = plt.subplots(figsize=(1.9 * cols + 1.2, 1.5 * rows + 0.8))
    for item in results:
        x, y = item["col"] * 1.4, (rows - 1 - item["row"]) * 1.2
        _rank_box(ax, x / 1.2, y, GROUP_COLORS[item["row"] % len(GROUP_COLORS)],
                  f"rank {item['rank']}\nrow sum {item['row_sum']}\ncol sum {item['col_sum']}",
                  edge=GROUP_COLORS[-1 - item["col"] % len(GROUP_COLORS)])
    for row in range(rows):
        ax.text(-0.35, (rows - 1 - row) * 1.2 + 0.5, f"row group {row}", ha="right", va="center",
                color=GROUP_COLORS[row % len(GROUP_COLORS)], fontweight="bold")
    for col in range(cols):
        ax.text(col * 1.4 + 0.5, rows * 1.2 - 0.05, f"column group {col}", ha="center",
                color=GROUP_COLORS[-1 - col % len(GROUP_COLORS)], fontweight="bold")
    ax.set_xlim(-2.2, cols * 1.4)
    ax.set_ylim(-0.2, rows * 1.2 + 0.2)
    ax.set_title(f"{rows} x {cols} grid of ranks: one group per row, one per column")
    ax.axis("off")
    fig.tight_layout()
    return fig


def _rank_box(ax, slot, y, color, label, edge=None):
    x = slot * 1.2
    ax.add_patch(FancyBboxPatch((x, y), 1.0, 1.0, boxstyle="round,pad=0.02", facecolor=color,
                                alpha=0.85, edgecolor=edge or "white", linewidth=4 if edge else 1))
    ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", color="white", fontsize=9,
            fontweight="bold")


def plot_chain(results: list):
    """The send/recv chain: what each rank received from its left and holds after doubling."""
    fig, ax = plt.subplots(figsize=(2.2 * len(results) + 0.5, 2.4))
    for rank, item in enumerate(results):
        values = ", ".join(f"{v:g}" for v in item["holds"].tolist())
        _rank_box(ax, rank * 1.5, 0, GROUP_COLORS[0], f"rank {rank}\nholds\n[{values}]")
        if rank:
            ax.annotate("", xy=(rank * 1.8, 0.5), xytext=(rank * 1.8 - 0.6, 0.5),
                        arrowprops={"arrowstyle": "->", "lw": 2})
            ax.text(rank * 1.8 - 0.3, 0.62, "send", ha="center", fontsize=8)
    ax.set_xlim(-0.2, 1.8 * len(results))
    ax.set_ylim(-0.2, 1.2)
    ax.set_title("Each rank receives from its left, doubles, and sends to its right")
    ax.axis("off")
    fig.tight_layout()
    return fig


def plot_timelines(runs: dict):
    """Gantt charts, one per run: a row per rank, a bar per (label, start_s, end_s) event."""
    fig, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False,
                             figsize=(8, 0.9 * sum(len(t) for t in runs.values()) + 1.2))
    for ax, (name, per_rank) in zip(axes[:, 0], runs.items()):
        for rank, events in enumerate(per_rank):
            for label, start, end in events:
                ax.barh(rank, (end - start) * 1e3, left=start * 1e3, height=0.6,
                        color=EVENT_COLORS.get(label, "#937860"), edgecolor="white")
                if (end - start) * 1e3 > 8:
                    ax.text((start + end) / 2 * 1e3, rank, label, ha="center", va="center",
                            color="white", fontsize=8)
        finished = max(end for events in per_rank for _, _, end in events)
        ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
        ax.invert_yaxis()
        ax.set_title(f"{name}: both ranks done after {finished * 1e3:.0f} ms", fontsize=10)
    axes[-1, 0].set_xlabel("time since the common start (ms)")
    fig.tight_layout()
    return fig


def plot_collective(name: str, results: list, rule: str = "", reduced: bool = False):
    """Every rank's buffer before and after a collective, drawn from the returned tensors.

    A cell's colour is the rank its number came from (tens digit of the inputs); grey when the
    number is a reduction of several ranks' numbers (`reduced`). An empty row: no such buffer.
    """
    n = len(results)
    width = max(max(len(item[key]) for key in ("before", "after") if item[key] is not None)
                for item in results)
    fig, axes = plt.subplots(1, 2, figsize=(2.2 + 1.3 * width, 0.55 * n + 1.3))
    for ax, key in zip(axes, ("before", "after")):
        for rank, item in enumerate(results):
            y = n - 1 - rank
            ax.text(-0.15, y + 0.4, f"rank {rank}", ha="right", va="center", fontsize=9)
            if item[key] is None:
                ax.text(0.1, y + 0.4, "(no buffer)", va="center", color="#999", fontsize=8)
                continue
            for i, value in enumerate(item[key].tolist()):
                mixed = reduced and key == "after"
                color = "#8c8c8c" if mixed else GROUP_COLORS[int(value) // 10 % len(GROUP_COLORS)]
                ax.add_patch(Rectangle((i, y), 0.94, 0.8, facecolor=color, alpha=0.9))
                ax.text(i + 0.47, y + 0.4, f"{value:g}", ha="center", va="center", color="white",
                        fontsize=9, fontweight="bold")
        ax.set_xlim(-1.1, width)
        ax.set_ylim(-0.2, n)
        ax.set_title(key)
        ax.axis("off")
    fig.suptitle(f"{name}: {rule}" if rule else name, fontsize=10)
    fig.tight_layout()
    return fig


def _gigabytes(value):
    return value / 1e9


def plot_sweeps(sweeps: dict, fits: dict | None = None):
    """Left: time against size (log-log), with each fitted alpha-beta model. Right: busbw.

    `sweeps` maps a label to `helpers.bench.sweep` records; `fits` a label to (alpha, beta).
    """
    from helpers import bench

    fig, (time_ax, bw_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for index, (label, records) in enumerate(sweeps.items()):
        color = GROUP_COLORS[index % len(GROUP_COLORS)]
        sizes = [r["size_bytes"] for r in records]
        time_ax.loglog(sizes, [r["seconds"] for r in records], "o", color=color, label=label)
        bw_ax.semilogx(sizes, [_gigabytes(r["busbw"]) for r in records], "o-", color=color, label=label)
        if fits and label in fits:
            alpha, beta = fits[label]
            op, n = records[0]["op"], records[0]["world_size"]
            model = [bench.model_seconds(alpha, beta, op, n, size) for size in sizes]
            time_ax.loglog(sizes, model, "-", color=color, alpha=0.6,
                           label=f"fit: alpha = {alpha * 1e6:.0f} us, beta = {_gigabytes(beta):.2f} GB/s")
            crossover = alpha * beta / bench.BUSBW_FACTORS[op](n)
            time_ax.axvline(crossover, color=color, ls=":", lw=1)
    time_ax.set_xlabel("size S (bytes)")
    time_ax.set_ylabel("time (s)")
    time_ax.set_title("time: flat where latency dominates, rising where bandwidth does\n"
                      "(dotted: size where both terms are equal)", fontsize=9)
    time_ax.legend(fontsize=7)
    bw_ax.set_xlabel("size S (bytes)")
    bw_ax.set_ylabel("busbw (GB/s)")
    bw_ax.set_title("bus bandwidth", fontsize=9)
    bw_ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_against_published(measured: dict, published: list):
    """busbw against size: sweeps measured here (label -> bench records) and published ones
    ((label, source, [(size, busbw)]) from bench.PUBLISHED_SWEEPS), labelled as not measured."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for index, (label, records) in enumerate(measured.items()):
        ax.loglog([r["size_bytes"] for r in records], [_gigabytes(r["busbw"]) for r in records],
                  "o-", color=GROUP_COLORS[index], label=f"{label} (measured here)")
    for index, (label, _, points) in enumerate(published):
        sizes, busbw = zip(*points)
        ax.loglog(sizes, [_gigabytes(b) for b in busbw], "s--", color="#999999",
                  alpha=1 - 0.35 * index, label=f"{label} (published, not measured here)")
    ax.set_xlabel("size S (bytes)")
    ax.set_ylabel("all_reduce busbw (GB/s)")
    ax.set_title("The same sweep on GPU servers", fontsize=10)
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


def plot_links(measured: dict, published: list):
    """Horizontal bars, log scale: bandwidths measured here (dict label -> bytes/s) against vendor
    peak figures (list of (label, bytes/s, source)), which are labelled as not measured."""
    labels = [f"{label} (measured here)" for label in measured]
    labels += [f"{label} (vendor peak, not measured)" for label, _, _ in published]
    values = [_gigabytes(v) for v in measured.values()] + [_gigabytes(v) for _, v, _ in published]
    colors = [GROUP_COLORS[0]] * len(measured) + ["#bbbbbb"] * len(published)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(values) + 1))
    bars = ax.barh(labels, values, color=colors)
    ax.bar_label(bars, fmt="%.1f GB/s", fontsize=8, padding=3)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("GB/s, one direction (log scale)")
    ax.set_title("What this machine moves, and what GPU links are built for", fontsize=10)
    fig.tight_layout()
    return fig


def _contributors(value: float) -> int:
    """How many ranks a ring-trace number contains: rank r contributed 10**r, so count the 1s."""
    return str(int(round(value))).count("1")


def draw_ring_step(ax, traces: list, index: int):
    """One step of the ring trace on `ax`: a row per rank, a cell per chunk, darker = more ranks
    summed in; the chunk each rank sends (to the next rank, the last to rank 0) is outlined."""
    n = len(traces)
    phase, step, _, _ = traces[0][index]
    for rank, trace in enumerate(traces):
        _, _, sent, values = trace[index]
        y = n - 1 - rank
        ax.text(-0.2, y + 0.4, f"rank {rank}", ha="right", va="center", fontsize=8)
        for chunk, value in enumerate(values.tolist()):
            share = _contributors(value) / n
            ax.add_patch(Rectangle((chunk, y), 0.92, 0.8, facecolor=plt.cm.Blues(0.15 + 0.8 * share),
                                   edgecolor="#C44E52" if chunk == sent else "white",
                                   linewidth=2.5 if chunk == sent else 1))
            ax.text(chunk + 0.46, y + 0.4, f"{int(value)}", ha="center", va="center", fontsize=7,
                    color="white" if share > 0.5 else "black")
    title = "start: rank r holds 10**r" if phase == "start" else f"{phase}, step {step + 1}"
    ax.set_title(title, fontsize=9)
    ax.set_xlim(-1.3, n + 0.1)
    ax.set_ylim(-0.6, n)
    ax.axis("off")


def plot_ring_steps(traces: list):
    """Every step of the ring, side by side (the static version of the stepper widget)."""
    steps = len(traces[0])
    columns = min(4, steps)
    rows = math.ceil(steps / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, 2.2 * rows), squeeze=False)
    for index, ax in enumerate(axes.flat):
        if index < steps:
            draw_ring_step(ax, traces, index)
        else:
            ax.axis("off")
    fig.suptitle("Ring all-reduce: outlined = the chunk each rank sends to the next "
                 "(rank 3 to rank 0)" if len(traces) == 4 else "Ring all-reduce: outlined = the chunk each "
                 "rank sends to the next", fontsize=10)
    fig.tight_layout()
    return fig


def plot_bytes_per_rank(bytes_by_algorithm: dict, tensor_bytes: int):
    """Grouped bars: bytes each rank sent, per algorithm, in units of the tensor's size."""
    labels = list(bytes_by_algorithm)
    n = len(next(iter(bytes_by_algorithm.values())))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / len(labels)
    for index, label in enumerate(labels):
        positions = [r + (index - (len(labels) - 1) / 2) * width for r in range(n)]
        ax.bar(positions, [b / tensor_bytes for b in bytes_by_algorithm[label]], width,
               label=label, color=GROUP_COLORS[index % len(GROUP_COLORS)])
    ax.set_xticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylabel("bytes sent / tensor size")
    ax.set_title("Who sends how much", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def plot_ring_vs_tree(alpha, beta, sizes, device_counts):
    """Model time of ring and tree all-reduce against the number of devices, for a few sizes."""
    from helpers import algorithms

    fig, ax = plt.subplots(figsize=(7.5, 4))
    for index, size in enumerate(sizes):
        color = GROUP_COLORS[index % len(GROUP_COLORS)]
        ax.loglog(device_counts, [algorithms.ring_seconds(n, size, alpha, beta) for n in device_counts],
                  "-", color=color, label=f"ring, {size / 1e6:g} MB")
        ax.loglog(device_counts, [algorithms.tree_seconds(n, size, alpha, beta) for n in device_counts],
                  "--", color=color, label=f"tree, {size / 1e6:g} MB")
    ax.set_xlabel("devices n")
    ax.set_ylabel("model time (s)")
    ax.set_title(f"alpha = {alpha * 1e6:g} us, beta = {beta / 1e9:g} GB/s", fontsize=10)
    ax.legend(fontsize=8, ncols=2, frameon=False)
    fig.tight_layout()
    return fig


def plot_topologies(n, size_bytes, device_bandwidth):
    """Bandwidth-only model times of all-reduce and all-to-all on each topology."""
    from helpers import algorithms

    fig, ax = plt.subplots(figsize=(7, 3))
    width = 0.38
    for offset, (label, model) in zip((-width / 2, width / 2), (
            ("all-reduce", algorithms.all_reduce_on), ("all-to-all", algorithms.all_to_all_on))):
        times = [model(t, n, size_bytes, device_bandwidth) * 1e3 for t in algorithms.TOPOLOGIES]
        bars = ax.bar([i + offset for i in range(len(times))], times, width, label=label)
        ax.bar_label(bars, fmt="%.1f ms", fontsize=8)
    ax.set_xticks(range(len(algorithms.TOPOLOGIES)), algorithms.TOPOLOGIES)
    ax.set_ylabel("model time (ms)")
    ax.set_title(f"{n} devices, {size_bytes / 1e6:g} MB each, {device_bandwidth / 1e9:g} GB/s out of "
                 "each device", fontsize=10)
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig
