"""Worker functions for tests/test_launch.py, in a module that imports only torch.

Every rank imports the module that defines its worker, so keeping this one light keeps each
launch at a fork (test_launch.py itself imports pytest and psutil).
"""

import os
import sys
import threading

import torch
import torch.distributed as dist

from helpers import get_device
from helpers.reference import seeded_randn


def all_reduce_worker(rank, world_size, base):
    tensor = torch.arange(4, dtype=torch.float64) * (rank + 1) + base
    dist.all_reduce(tensor)
    return tensor


def kwargs_worker(rank, world_size, *, scale, offset=0):
    return {"rank": rank, "world_size": world_size, "value": rank * scale + offset}


def big_result_worker(rank, world_size, megabytes):
    return seeded_randn(rank, megabytes * 2**20 // 4)


def grad_worker(rank, world_size):
    weight = torch.nn.Parameter(torch.full((3,), float(rank)))
    loss = (weight * 2).sum()
    loss.backward()
    return {"weight": weight, "grad": weight.grad, "activation": weight * 3}


def printing_worker(rank, world_size):
    print(f"line one from rank {rank}")
    print(f"to stderr from rank {rank}", file=sys.stderr)
    os.write(1, f"raw fd write from rank {rank}\n".encode())
    return rank


def device_worker(rank, world_size):
    return str(get_device(rank)), torch.get_num_threads()


def raise_on_rank(rank, world_size, failing_rank):
    if rank == failing_rank:
        raise ValueError(f"rank {rank} refuses")
    tensor = torch.zeros(1)
    dist.all_reduce(tensor)  # the others wait for the failing rank and fail as a consequence
    return tensor


def abort_on_rank_one(rank, world_size):
    if rank == 1:
        os.abort()
    dist.barrier()


def unpicklable_result_worker(rank, world_size):
    return threading.Lock()


def send_first_worker(rank, world_size):
    tensor = torch.zeros(4)
    dist.send(tensor, dst=1 - rank)  # both ranks send first: each waits for a recv that never comes
    dist.recv(tensor, src=1 - rank)


def spin_worker(rank, world_size):
    if rank == 0:
        return "done"
    while True:
        pass


def environment_worker(rank, world_size, name):
    return os.environ.get(name)


# Workers that start their own process group, in the style of PyTorch's tutorials (helpers.spawn).

def setup(rank, world_size, port=None):
    os.environ["MASTER_ADDR"] = "localhost"
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def tutorial_style_worker(rank, world_size, port=None):
    """setup(), one DDP training step of a linear model, cleanup(): returns the updated weight."""
    from torch.nn.parallel import DistributedDataParallel

    setup(rank, world_size, port)
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    ddp_model = DistributedDataParallel(model)
    inputs = torch.full((2, 3), float(rank + 1))
    ddp_model(inputs).sum().backward()  # gradient: the column sums of inputs, averaged over ranks
    with torch.no_grad():
        model.weight -= 0.1 * model.weight.grad
    cleanup()
    return model.weight.detach()


def env_rendezvous_worker(rank, world_size):
    """init_process_group with env:// and nothing else: the launcher's variables must suffice."""
    dist.init_process_group("gloo")
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {"total": total.item(), "environ": {name: os.environ[name] for name in names}}


def leave_group_initialised(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return tensor.item()  # no destroy_process_group: the launcher does it


def too_few_processes(rank, world_size_claimed):
    """Claims a bigger world than was started: the rendezvous waits for ranks that never come."""
    setup(rank, world_size_claimed)


def recv_first_worker(rank, world_size):
    tensor = torch.zeros(4)
    dist.recv(tensor, src=1 - rank)  # both ranks receive first: lesson 02's classic deadlock


def long_error_worker(rank, world_size):
    if rank == 1:
        raise RuntimeError("the first line of a long error\n" + "x" * 5000)
