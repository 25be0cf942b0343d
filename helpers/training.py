"""What a training loop on several ranks shares, whatever its strategy: the mean of a number (a
loss) over a group's ranks."""

import torch
import torch.distributed as dist


def mean_over(value: float, group) -> float:
    """The mean of `value` over the ranks of `group` (None: every rank). Each data-parallel rank's
    loss is the mean over its slice of the batch; the batch's loss is the mean of those."""
    value = torch.tensor([value], dtype=torch.float64)  # a Python float's own precision
    dist.all_reduce(value, op=dist.ReduceOp.AVG, group=group)
    return value.item()
