"""One grid of ranks, and the process groups along each of its dimensions (lesson 10).

Every group of a run with several kinds of parallelism comes from one grid, as in picotron's
process_group_manager: `torch.arange(world_size).view(dp, pp, tp)` puts rank
r = (d * pp + p) * tp + t at coordinates (d, p, t). The group along a dimension holds the ranks
whose other coordinates are the same as this rank's: rank 5 = (1, 0, 1) on a 2 x 2 x 2 grid is in
the tp group [4, 5], the pp group [5, 7] and the dp group [1, 5].

The last dimension varies fastest, so its groups are neighbouring ranks. Tensor parallelism is put
there because it communicates most (two all-reduces per block, forward and backward), and
neighbouring ranks are the GPUs of one machine; data parallelism, which communicates once per
step, goes first and spans machines. `init_device_mesh(device, shape, mesh_dim_names=...)` lays
out its ranks the same way, which `grid_worker` checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Grid:
    """`dims`: the dimensions' names, outermost first, e.g. ("dp", "tp"); `sizes`: their sizes."""

    dims: tuple
    sizes: tuple

    def __post_init__(self):
        if len(self.dims) != len(self.sizes):
            raise ValueError(f"{len(self.dims)} names {self.dims} for {len(self.sizes)} sizes")

    @property
    def world_size(self) -> int:
        return int(torch.tensor(self.sizes).prod())

    def ranks(self) -> torch.Tensor:
        """The grid: ranks()[d, p, t] is the rank at those coordinates."""
        return torch.arange(self.world_size).view(*self.sizes)

    def coordinates(self, rank: int) -> dict:
        """{dimension: this rank's coordinate along it}."""
        where = (self.ranks() == rank).nonzero()[0].tolist()
        return dict(zip(self.dims, where))

    def groups(self, dim: str) -> list:
        """Every group along `dim`: lists of ranks that differ only in their `dim` coordinate."""
        axis = self.dims.index(dim)
        lines = self.ranks().movedim(axis, -1).reshape(-1, self.sizes[axis])
        return [line.tolist() for line in lines]

    def members(self, dim: str, rank: int) -> list:
        """The ranks of `rank`'s group along `dim`."""
        return next(group for group in self.groups(dim) if rank in group)


def new_groups(grid: Grid, rank: int) -> dict:
    """{dimension: this rank's process group along it}. Every rank creates every group of every
    dimension, in the same order (dist.new_group's rule), and keeps the ones it belongs to."""
    if grid.world_size != dist.get_world_size():
        raise ValueError(f"a grid of {grid.sizes} needs {grid.world_size} ranks, not "
                         f"{dist.get_world_size()}")
    mine = {}
    for dim in grid.dims:
        for members in grid.groups(dim):
            group = dist.new_group(members)
            if rank in members:
                mine[dim] = group
    return mine
