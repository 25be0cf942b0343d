"""Lesson 01's workers: the GIL measured, halves of the world, a 2-D grid of groups.

Workers return plain data; the pictures are drawn in the kernel (`plots` beside this file).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from helpers.launcher.result import get_device


def busy_loop(iterations: int) -> int:
    """Pure-Python, CPU-bound work: it holds the GIL the whole time."""
    total = 0
    for i in range(iterations):
        total += i * i % 7
    return total


def busy_worker(rank, world_size, iterations):
    """Each rank does the same busy loop in its own process (its own interpreter, its own GIL).
    Returns how long the loop took there, in seconds."""
    started = time.perf_counter()
    busy_loop(iterations)
    return time.perf_counter() - started


def skipped_group_worker(rank, world_size, then_another):
    """Rank 0 skips creating the group [2, 3], which it is not a member of; the others create it.

    Returns each rank's count of groups created so far (torch names a group by this count). With
    `then_another`, every rank then creates one more group: ranks that counted differently wait
    for each other under different names, and never meet."""
    dist.new_group([0, 1])
    if rank != 0:
        dist.new_group([2, 3])
    counted = dist.distributed_c10d._world.group_count  # private: the name of the next group
    if then_another:
        dist.new_group(list(range(world_size)))
    return counted


def halves_worker(rank, world_size):
    """Split the world in two halves and all-reduce SUM inside each half (`dist.new_group`).

    Before: rank r holds the tensor [r]. After: every rank holds the sum of the ranks of its own
    half. Every rank calls `new_group` for *both* groups, in the same order, even the group it is
    not in: torch names groups by counting them (see skipped_group_worker).
    """
    first_half = list(range(world_size // 2))
    second_half = list(range(world_size // 2, world_size))
    groups = [dist.new_group(first_half), dist.new_group(second_half)]
    mine = 0 if rank in first_half else 1
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=groups[mine])
    return {
        "rank": rank,
        "group": mine,
        "group_ranks": dist.get_process_group_ranks(groups[mine]),
        "group_rank": dist.get_rank(groups[mine]),
        "group_sum": int(value.item()),
    }


def grid_worker(rank, world_size, rows):
    """A rows x cols grid of ranks with one group per row and one per column (the 2-D layout of
    data x tensor parallelism). Rank r sits at (r // cols, r % cols).

    Before: rank r holds [r]. After: `row_sum` is the sum over its row group, `col_sum` over its
    column group. Also returns the groups `init_device_mesh` builds for the same shape, so the
    notebook can check the hand-made groups against PyTorch's own.
    """
    from torch.distributed.device_mesh import init_device_mesh

    cols = world_size // rows
    if rows * cols != world_size:
        raise ValueError(f"{world_size} ranks do not fill a grid with {rows} rows")
    row_groups = [dist.new_group([r * cols + c for c in range(cols)]) for r in range(rows)]
    col_groups = [dist.new_group([r * cols + c for r in range(rows)]) for c in range(cols)]
    row, col = divmod(rank, cols)
    row_sum, col_sum = torch.tensor([float(rank)]), torch.tensor([float(rank)])
    dist.all_reduce(row_sum, group=row_groups[row])
    dist.all_reduce(col_sum, group=col_groups[col])
    # Mesh dimension "tp" varies the column, so its group is this rank's row; "dp" is the column.
    mesh = init_device_mesh(get_device().type, (rows, cols), mesh_dim_names=("dp", "tp"))
    return {
        "rank": rank,
        "row": row,
        "col": col,
        "row_ranks": dist.get_process_group_ranks(row_groups[row]),
        "col_ranks": dist.get_process_group_ranks(col_groups[col]),
        "row_sum": int(row_sum.item()),
        "col_sum": int(col_sum.item()),
        "mesh_tp_ranks": dist.get_process_group_ranks(mesh.get_group("tp")),
        "mesh_dp_ranks": dist.get_process_group_ranks(mesh.get_group("dp")),
    }
