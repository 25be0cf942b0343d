"""CS336 lecture 8's data-parallel example, run as it is (notebooks/06_data_parallelism.ipynb).

`setup`, `cleanup` and `data_parallelism_main` are the lecture's code as the course's source notes
give it (Stanford CS336, spring 2025, lecture 8; github.com/stanford-cs336/spring2025-lectures).
The lecture imports four small helpers from its own files; the stand-ins below are written for
this course and do what the lecture's do:
- get_device(index): cuda:index when there is a GPU, else the CPU;
- int_divide(a, b): a // b, refusing a remainder;
- summarize_tensor(tensor): its shape and first value, e.g. "1024x1024[-0.0216...]";
- get_init_params(num_inputs, num_outputs, rank): a Parameter drawn from randn / sqrt(num_outputs)
  after resetting torch's global random seed to 0, every time it is called.
"""

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def get_device(index: int = 0) -> torch.device:
    return torch.device("cuda", index) if torch.cuda.is_available() else torch.device("cpu")


def int_divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by {b}")
    return a // b


def summarize_tensor(tensor: torch.Tensor) -> str:
    shape = "x".join(str(size) for size in tensor.shape)
    return f"{shape}[{round(tensor.flatten()[0].item(), 4)}...]"


def get_init_params(num_inputs: int, num_outputs: int, rank: int) -> nn.Parameter:
    torch.random.manual_seed(0)  # the same seed at every call: every call draws the same matrix
    return nn.Parameter(torch.randn(num_inputs, num_outputs, device=get_device(rank))
                        / math.sqrt(num_outputs))


# The lecture's code, unchanged.

def setup(rank: int, world_size: int):
    # Specify where master lives (rank 0), used to coordinate (actual data goes through NCCL)
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "15623"

    if torch.cuda.is_available():
        dist.init_process_group("nccl", rank=rank, world_size=world_size)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    torch.distributed.destroy_process_group()


def data_parallelism_main(rank: int, world_size: int, data: torch.Tensor, num_layers: int, num_steps: int):
    setup(rank, world_size)

    # Get the slice of data for this rank (in practice, each rank should load only its own data)
    batch_size = data.size(0)  # @inspect batch_size
    num_dim = data.size(1)  # @inspect num_dim
    local_batch_size = int_divide(batch_size, world_size)  # @inspect local_batch_size
    start_index = rank * local_batch_size  # @inspect start_index
    end_index = start_index + local_batch_size  # @inspect end_index
    data = data[start_index:end_index].to(get_device(rank))

    # Create MLP parameters params[0], ..., params[num_layers - 1] (each rank has all parameters)
    params = [get_init_params(num_dim, num_dim, rank) for i in range(num_layers)]
    optimizer = torch.optim.AdamW(params, lr=1e-3)  # Each rank has own optimizer state

    for step in range(num_steps):
        # Forward pass
        x = data
        for param in params:
            x = x @ param
            x = F.gelu(x)
        loss = x.square().mean()  # Loss function is average squared magnitude

        # Backward pass
        loss.backward()

        # Sync gradients across workers (only difference between standard training and DDP)
        for param in params:
            dist.all_reduce(tensor=param.grad, op=dist.ReduceOp.AVG, async_op=False)

        # Update parameters
        optimizer.step()

        print(f"[data_parallelism] Rank {rank}: step = {step}, loss = {loss.item()}, params = {[summarize_tensor(params[i]) for i in range(num_layers)]}", flush=True)

    cleanup()
