"""CS336 lecture 8's pipeline-parallel example, run as it is, and its backward added (lesson 09).

`pipeline_parallelism_main` is the lecture's code as lecture_08.py in
github.com/stanford-cs336/spring2025-lectures has it; `setup`, `cleanup` and the small helpers
are helpers.cs336's. Its `get_init_params` reseeds at every call,
so every layer of every rank is the same matrix: the pipeline is a slice of a dense stack of
identical layers, and its forward is that stack's.

`pipeline_with_backward` is the homework the lecture leaves: the same forward, in a group that
`helpers.run` made, keeping each micro-batch's input and output; then the backward of the loss
(the mean square of the last activations, as lesson 06's loop), micro-batch by micro-batch, the
gradient of each stage's input sent back to the previous rank. Its gradients equal
`dense_gradients`'.
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

# The lecture's code, unchanged (`text` shows a line of prose in the lecture's viewer).


def text(line: str):
    pass


def pipeline_parallelism_main(rank: int, world_size: int, data: torch.Tensor, num_layers: int, num_micro_batches: int):
    setup(rank, world_size)

    # Use all the data
    data = data.to(get_device(rank))
    batch_size = data.size(0)  # @inspect batch_size
    num_dim = data.size(1)  # @inspect num_dim

    # Split up layers
    local_num_layers = int_divide(num_layers, world_size)  # @inspect local_num_layers

    # Each rank gets a subset of layers
    local_params = [get_init_params(num_dim, num_dim, rank) for i in range(local_num_layers)]

    # Forward pass

    # Break up into micro batches to minimize the bubble
    micro_batch_size = int_divide(batch_size, num_micro_batches)  # @inspect micro_batch_size
    if rank == 0:
        # The data
        micro_batches = data.chunk(chunks=num_micro_batches, dim=0)
    else:
        # Allocate memory for activations
        micro_batches = [torch.empty(micro_batch_size, num_dim, device=get_device(rank)) for _ in range(num_micro_batches)]

    for x in micro_batches:
        # Get activations from previous rank
        if rank - 1 >= 0:
            dist.recv(tensor=x, src=rank - 1)

        # Compute layers assigned to this rank
        for param in local_params:
            x = x @ param
            x = F.gelu(x)

        # Send to the next rank
        if rank + 1 < world_size:
            print(f"[pipeline_parallelism] Rank {rank}: sending {summarize_tensor(x)} to rank {rank + 1}", flush=True)
            dist.send(tensor=x, dst=rank + 1)

    text("Not handled: overlapping communication/computation to eliminate pipeline bubbles")

    # Backward pass: homework exercise

    cleanup()


# The homework: the backward.

def pipeline_with_backward(rank: int, world_size: int, data: torch.Tensor, num_layers: int,
                           num_micro_batches: int):
    """The lecture's forward, then the backward. Returns the gradients of this rank's layers."""
    num_dim = data.size(1)
    local_params = [get_init_params(num_dim, num_dim, rank)
                    for i in range(int_divide(num_layers, world_size))]
    micro_batch_size = int_divide(data.size(0), num_micro_batches)
    kept = []  # (input, output) of every micro-batch, for its backward
    for i in range(num_micro_batches):
        if rank == 0:
            x = data[i * micro_batch_size:(i + 1) * micro_batch_size]
        else:
            x = torch.empty(micro_batch_size, num_dim)
            dist.recv(tensor=x, src=rank - 1)
            x.requires_grad_()  # its gradient goes back to rank - 1
        out = x
        for param in local_params:
            out = F.gelu(out @ param)
        if rank + 1 < world_size:
            dist.send(tensor=out.detach(), dst=rank + 1)
        kept.append((x, out))
    for x, out in kept:  # the backward, micro-batch by micro-batch
        if rank + 1 == world_size:  # the mean over the batch = the mean of the micro-batch means
            (out.square().mean() / num_micro_batches).backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(tensor=grad, src=rank + 1)
            out.backward(grad)
        if rank > 0:
            dist.send(tensor=x.grad, dst=rank - 1)
    return [param.grad for param in local_params]


def dense_gradients(data: torch.Tensor, num_layers: int) -> list:
    """One process: every layer's gradient of the mean square of the last activations."""
    params = [get_init_params(data.size(1), data.size(1), 0) for _ in range(num_layers)]
    x = data
    for param in params:
        x = F.gelu(x @ param)
    x.square().mean().backward()
    return [param.grad for param in params]
