"""Reference solutions of lesson 01's exercises. Try the exercise first."""

import torch
import torch.distributed as dist


def even_odd_sum(rank, world_size):
    evens = dist.new_group(list(range(0, world_size, 2)))  # every rank creates both groups
    odds = dist.new_group(list(range(1, world_size, 2)))
    total = torch.tensor([rank])
    dist.all_reduce(total, group=evens if rank % 2 == 0 else odds)
    return int(total)


def _row_and_column_groups(world_size, rows):
    """Every rank creates every row group, then every column group: the same calls everywhere."""
    cols = world_size // rows
    row_groups = [dist.new_group([r * cols + c for c in range(cols)]) for r in range(rows)]
    col_groups = [dist.new_group([r * cols + c for r in range(rows)]) for c in range(cols)]
    return row_groups, col_groups


def column_sum(rank, world_size, rows):
    _, col_groups = _row_and_column_groups(world_size, rows)
    total = torch.tensor([rank])
    dist.all_reduce(total, group=col_groups[rank % (world_size // rows)])
    return int(total)


def grid_sums(rank, world_size, rows):
    row_groups, col_groups = _row_and_column_groups(world_size, rows)
    cols = world_size // rows
    row_sum, col_sum = torch.tensor([rank]), torch.tensor([rank])
    dist.all_reduce(row_sum, group=row_groups[rank // cols])
    dist.all_reduce(col_sum, group=col_groups[rank % cols])
    total = row_sum.clone()  # every rank of a column holds its own row's sum: add those up
    dist.all_reduce(total, group=col_groups[rank % cols])
    return int(row_sum), int(col_sum), int(total)
