"""What `make test-gpu` runs on a machine with CUDA; every test here is skipped without one.

- NCCL at world size 1: every strategy of helpers.strategies, built on the launcher's device
  (the default backend on a GPU machine is "cpu:gloo,cuda:nccl"), trains like one process.
- The CUDA code paths: lesson 11's autocast and GradScaler on CUDA; the bytes a ZeRO stage holds,
  read with torch.cuda.memory_allocated, against lesson 07's formula.
- gloo with several ranks sharing one GPU, on CUDA tensors (gloo's all_reduce and broadcast take
  them).

None of it has run yet: README says so, and says so until a GPU machine has run it.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from compare import labelled

from helpers import reference, run, strategies
from helpers.fitting_a_model import precision
from helpers.launcher.result import GLOO_AND_NCCL, get_device
from helpers.zero_and_fsdp import memory

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]

ONE_RANK = {  # every strategy that runs on one rank, and the options that change its layout
    "one_process": ("one_process", {}), "naive": ("naive", {}), "ddp": ("ddp", {}),
    "bucketed_ddp": ("ddp", {"bucket_mb": 0.01}),
    "clipped_zero_3": ("zero_3", {"max_grad_norm": 0.5}),
    "torch_ddp": ("torch_ddp", {}), "readable_zero_1": ("zero_1", {}),
    "bucketed_zero_2": ("zero_2", {"bucket_mb": 0.01}), "zero_3": ("zero_3", {}),
    "zero_redundancy_optimizer": ("zero_redundancy_optimizer", {}),
    "fully_shard": ("fully_shard", {}),
}


def training_worker(rank, world_size, name, options, model, batches):
    module, optimizer = strategies.build(name, copy.deepcopy(model), **options)
    for batch in batches:
        local = batch.shard(rank, world_size).to(get_device())
        optimizer.zero_grad()
        reference.lm_loss(module(local.inputs), local.targets).backward()
        optimizer.step()
    return {"device": next(module.parameters()).device.type,
            "parameters": strategies.full_parameters(module)}


@pytest.mark.parametrize("key", ONE_RANK)
def test_every_strategy_trains_on_the_gpu_like_one_process_on_the_cpu(key):
    """float64 on both sides: the GPU's kernels sum in other orders than the CPU's, and AdamW
    cannot amplify float64 rounding into a visible difference (helpers.tolerance)."""
    name, options = ONE_RANK[key]
    model, batches = reference.in_float64(reference.make_lm(seed=0),
                                          reference.lm_data(seed=1, batch_size=8, steps=3))
    out = run(training_worker, 1, show_output=False, kwargs=dict(
        name=name, options=options, model=model, batches=batches))
    assert out.backend == GLOO_AND_NCCL
    assert out[0]["device"] == "cuda"
    alone = reference.train(model, batches, reference.lm_loss,
                            max_grad_norm=options.get("max_grad_norm")).parameters
    for name_, param in alone.items():
        torch.testing.assert_close(out[0]["parameters"][name_], param, msg=labelled(name_))


def test_autocast_and_grad_scaler_on_cuda():
    """As on the CPU (tests/test_fitting_a_model_precision.py): bfloat16 training learns, and a
    float16 overflow is skipped and answered by halving the scale."""
    model = reference.make_lm(seed=0)
    cuda = torch.device("cuda")
    losses = precision.losses(model, reference.lm_data(seed=1, batch_size=8, steps=20),
                              torch.bfloat16, device=cuda)
    assert losses[-1] < losses[0] * 2 / 3
    steps = precision.scaler_steps(model, reference.lm_data(seed=1, batch_size=8, steps=4),
                                   init_scale=2.0 ** 24, device=cuda)
    assert not steps[0]["finite"] and not steps[0]["stepped"]
    assert steps[1]["scale"] == steps[0]["scale"] / 2


def held_on_gpu_worker(rank, world_size, stage, model, batch):
    """torch.cuda.memory_allocated at the end of a second backward (the gradients complete,
    AdamW's state allocated by the first step), less before the model came to the GPU: as
    lesson 07's memory_worker measures it, its weights, gradients and optimizer state."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    module, optimizer = strategies.build({0: "naive", 1: "zero_1", 2: "zero_2", 3: "zero_3"}[stage],
                                         copy.deepcopy(model))
    local = batch.shard(rank, world_size).to(get_device())

    def backward():  # the activations go when it returns
        reference.mse_loss(module(local.inputs), local.targets).backward()

    backward()
    optimizer.step()
    optimizer.zero_grad()
    backward()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before - local.inputs.nbytes - local.targets.nbytes


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_bytes_a_stage_holds_on_the_gpu_are_lesson_07s_formula(stage):
    """At one rank every stage holds everything: 16 bytes a parameter (float32 weights and
    gradients, AdamW's two moments), lesson 07's formula. CUDA's caching allocator rounds every
    allocation up to a multiple of 512 bytes, and AdamW keeps a step count a tensor: at most
    2 x 512 bytes more for each tensor (a weight, its gradient, its two moments), the batch's
    two allocations included."""
    model = reference.make_mlp(dim=64, num_layers=4, seed=0, bias=True)
    batch = reference.mlp_data(seed=1, batch_size=8, dim=64)[0]
    held = run(held_on_gpu_worker, 1, show_output=False, kwargs=dict(
        stage=stage, model=model, batch=batch))[0]
    psi = sum(param.numel() for param in model.parameters())
    formula = memory.bytes_per_rank(psi, 1, stage)["total"]
    tensors = 4 * len(list(model.parameters())) + 2  # weight, gradient, two moments; the batch
    assert formula <= held <= formula + 2 * 512 * tensors


def gloo_on_cuda_worker(rank, world_size):
    tensor = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(tensor)
    source = torch.full((4,), float(rank), device="cuda")
    dist.broadcast(source, src=1)
    return {"sum": tensor.cpu(), "broadcast": source.cpu()}


def test_gloo_reduces_cuda_tensors_of_ranks_sharing_one_gpu():
    out = run(gloo_on_cuda_worker, 3, backend="gloo", show_output=False)
    for result in out:
        torch.testing.assert_close(result["sum"], torch.full((4,), 6.0))
        torch.testing.assert_close(result["broadcast"], torch.full((4,), 1.0))
