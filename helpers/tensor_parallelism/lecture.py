"""CS336 lecture 8's tensor-parallel example, run as it is, and rebuilt (lesson 08).

`tensor_parallelism_main` is the lecture's code as the course's source notes give it (Stanford
CS336, spring 2025, lecture 8; github.com/stanford-cs336/spring2025-lectures); its `setup`,
`cleanup` and small helpers are helpers.cs336's. Every rank draws
its slice with `get_init_params(num_dim, local_num_dim, rank)`, which reseeds to 0 at every call:
every rank draws the same num_dim x local_num_dim matrix, so the ranks' slices are copies of one
another, not slices of a full weight, and the output is not any dense model's.

`lecture_forward` computes the same in one process. `sliced_tensor_parallelism` changes the one line that draws the weights: every rank draws the
full num_dim x num_dim matrix and keeps its own columns. Its output equals `dense_forward`'s.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.cs336 import (
    cleanup,
    get_device,
    get_init_params,
    int_divide,
    setup,
    summarize_tensor,
)

# The lecture's code, unchanged.

def tensor_parallelism_main(rank: int, world_size: int, data: torch.Tensor, num_layers: int):
    setup(rank, world_size)

    data = data.to(get_device(rank))
    batch_size = data.size(0)  # @inspect batch_size
    num_dim = data.size(1)  # @inspect num_dim
    local_num_dim = int_divide(num_dim, world_size)  # Shard `num_dim`  @inspect local_num_dim

    # Create model (each rank gets 1/world_size of the parameters)
    params = [get_init_params(num_dim, local_num_dim, rank) for i in range(num_layers)]

    # Forward pass
    x = data
    for i in range(num_layers):
        # Compute activations (batch_size x local_num_dim)
        x = x @ params[i]  # Note: this is only on a slice of the parameters
        x = F.gelu(x)

        # Allocate memory for activations (world_size x batch_size x local_num_dim)
        activations = [torch.empty(batch_size, local_num_dim, device=get_device(rank)) for _ in range(world_size)]

        # Send activations via all gather
        dist.all_gather(tensor_list=activations, tensor=x, async_op=False)

        # Concatenate them to get batch_size x num_dim
        x = torch.cat(activations, dim=1)

    print(f"[tensor_parallelism] Rank {rank}: forward pass produced activations {summarize_tensor(x)}", flush=True)

    # Backward pass: homework exercise

    cleanup()


# Rebuilt: the shards are slices of one full weight, and the output comes back.

def sliced_tensor_parallelism(rank: int, world_size: int, data: torch.Tensor, num_layers: int):
    """The lecture's forward in a group that `helpers.run` made, with one line changed: each rank
    keeps its columns of one full weight. Returns the activations (every rank has all of them)."""
    num_dim = data.size(1)
    local_num_dim = int_divide(num_dim, world_size)
    columns = slice(rank * local_num_dim, (rank + 1) * local_num_dim)
    params = [get_init_params(num_dim, num_dim, rank)[:, columns] for i in range(num_layers)]
    x = data
    for i in range(num_layers):
        x = F.gelu(x @ params[i])
        activations = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(tensor_list=activations, tensor=x)
        x = torch.cat(activations, dim=1)
    return x


def lecture_forward(data: torch.Tensor, num_layers: int, world_size: int) -> torch.Tensor:
    """What `tensor_parallelism_main` computes, in one process: every rank's slice is the same
    matrix, so every rank's block of the gathered activations is the same block."""
    local_num_dim = int_divide(data.size(1), world_size)
    x = data
    for _ in range(num_layers):
        block = F.gelu(x @ get_init_params(data.size(1), local_num_dim, 0))
        x = torch.cat([block] * world_size, dim=1)
    return x.detach()


def dense_forward(data: torch.Tensor, num_layers: int) -> torch.Tensor:
    """One process, the whole weight: what the rebuilt forward must equal."""
    x = data
    for _ in range(num_layers):
        x = F.gelu(x @ get_init_params(data.size(1), data.size(1), 0))
    return x.detach()
