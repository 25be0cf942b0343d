"""Reference solutions of lesson 09's exercises. Try the exercise first."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def one_f_one_b_order(rank, num_stages, num_micro_batches):
    warmup = min(num_stages - rank - 1, num_micro_batches)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_micro_batches - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(num_micro_batches - warmup, num_micro_batches)]


def _forward(rank, world_size, weight, micro_batches, num_micro_batches, shape):
    """Every micro-batch's (input, output), the input received from rank - 1 (rank 0: given)."""
    kept = []
    for i in range(num_micro_batches):
        if rank == 0:
            x = micro_batches[i]
        else:
            x = torch.empty(shape)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()  # its gradient goes back to rank - 1
        out = F.gelu(x @ weight)
        if rank < world_size - 1:
            dist.send(out.detach(), dst=rank + 1)
        kept.append((x, out))
    return kept


def pipeline_forward(rank, world_size, weight, micro_batches, num_micro_batches, shape):
    kept = _forward(rank, world_size, weight, micro_batches, num_micro_batches, shape)
    return [out.detach() for _, out in kept] if rank == world_size - 1 else None


def pipeline_backward(rank, world_size, weight, micro_batches, num_micro_batches, shape):
    weight = weight.clone().requires_grad_()
    kept = _forward(rank, world_size, weight, micro_batches, num_micro_batches, shape)
    for x, out in kept:
        if rank == world_size - 1:  # the batch's mean = the mean of the micro-batches' means
            (out.square().mean() / num_micro_batches).backward()
        else:
            grad = torch.empty(shape)
            dist.recv(grad, src=rank + 1)
            out.backward(grad)
        if rank > 0:
            dist.send(x.grad, dst=rank - 1)
    return weight.grad


def one_f_one_b_step(rank, world_size, weight, micro_batches, num_micro_batches, shape):
    # the step for any order (pipeline_by_order, below), given 1F1B's
    return pipeline_by_order(rank, world_size, weight, micro_batches, num_micro_batches, shape,
                             one_f_one_b_order(rank, world_size, num_micro_batches))


def pipeline_by_order(rank, world_size, weight, micro_batches, num_micro_batches, shape, order):
    weight = weight.clone().requires_grad_()
    kept, sends = {}, []  # micro-batch -> (input, output); sends are waited for at the end
    for kind, i in order:  # each message tagged with its micro-batch: a neighbour's order may
        if kind == "F":    # differ, and a receive must take micro-batch i's message
            if rank == 0:
                x = micro_batches[i]
            else:
                x = torch.empty(shape)
                dist.recv(x, src=rank - 1, tag=i)
                x.requires_grad_()
            out = F.gelu(x @ weight)
            if rank < world_size - 1:
                sends.append(dist.isend(out.detach(), dst=rank + 1, tag=i))  # never wait here
            kept[i] = (x, out)
        else:
            x, out = kept.pop(i)
            if rank == world_size - 1:
                (out.square().mean() / num_micro_batches).backward()
            else:
                grad = torch.empty(shape)
                dist.recv(grad, src=rank + 1, tag=i)
                out.backward(grad)
            if rank > 0:
                sends.append(dist.isend(x.grad, dst=rank - 1, tag=i))
    for work in sends:
        work.wait()
    return weight.grad

