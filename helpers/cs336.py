"""What CS336 lecture 8's examples (lessons 06, 08 and 09) import from the lecture's own files.

`setup` and `cleanup` are the lecture's code as the course's source notes give it (Stanford CS336,
spring 2025, lecture 8; github.com/stanford-cs336/spring2025-lectures). The lecture imports four
small helpers from its own files; the stand-ins below are written for this course and do what the
lecture's do:
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
