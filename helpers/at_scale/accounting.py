"""One training step, accounted for by PyTorch's own tools, on real ranks or on fake ones.

A fake rank is one process that plays rank r of N: `init_process_group("fake")` (PyTorch's
`FakeProcessGroup`: every collective returns at once, its buffers untouched) and, for sizes this
machine cannot hold, `FakeTensorMode` (tensors with shapes and no storage). The same worker runs
on real gloo ranks at a small size, where the accounting can be checked against reality.

- `fsdp_accounting_worker(rank, world_size, shape, batch, seq_len, fake_world_size=None, *,
  recompute="none", bf16=False)`: a Llama (helpers.llama), checkpointed by `layouts.apply_ac`
  (`recompute`), laid out by `layouts.apply_fsdp` over all ranks (`bf16`: FSDP2's
  MixedPrecisionPolicy, bfloat16 compute, gradients reduced in float32); one AdamW step to create
  the optimizer's state, then one step under `FSDPMemTracker` (this rank's peak bytes, by kind),
  one under `CommDebugMode` (PyTorch's count of the collectives, by op) and one under the course's
  `instrument.Observer` (the calls, and the bytes this rank sends by the cost model's ring).
  Returns {"peak": {kind: bytes}, "collectives": {op: count}, "calls": {name: count},
  "sent": {name: bytes}}. With `fake_world_size`, the process (launched alone, with
  init_group=False) plays rank 0 of that many, under FakeTensorMode.
- `dp_tp_accounting_worker(rank, world_size, shape, batch, seq_len, dp, tp, fake=False)`: the same
  on a ("dp", "tp") mesh, torchtitan's tensor-parallel plan (LLAMA_TP) and then FSDP2.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def join_fake_group(world_size: int, rank: int = 0) -> None:
    """This process plays rank `rank` of `world_size` in a fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def fsdp_accounting_worker(rank, world_size, shape, batch, seq_len, fake_world_size=None, *,
                           recompute="none", bf16=False):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.debug import CommDebugMode

    from helpers import instrument, layouts
    from helpers.llama import Llama

    fake = fake_world_size is not None
    if fake:  # this one process plays rank 0 of fake_world_size
        join_fake_group(fake_world_size)
        world_size = fake_world_size
    mesh = init_device_mesh("cpu", (world_size,))
    options = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32)} if bf16 else {}
    with FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(0)
        model = Llama(shape, max_seq_len=seq_len)
        layouts.apply_ac(model, recompute)
        layouts.apply_fsdp(model, mesh, **options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, shape.vocab, (batch, seq_len))

        def step():
            loss = model(tokens).float().logsumexp(-1).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        step()  # the optimizer's state exists from here on
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((tokens,))
        with tracker:
            step()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        with CommDebugMode() as comm:
            step()
        with instrument.Observer() as observer:
            step()
    return {"peak": {getattr(kind, "value", kind): size for kind, size in peak.items()},
            "collectives": {str(op): count for op, count in comm.get_comm_counts().items()},
            "calls": observer.calls(), "sent": observer.sent()}


# torchtitan's plan for a Llama block without sequence parallelism (pytorch/torchtitan@9dec370,
# torchtitan/models/llama/parallelize_llama.py, apply_tp): the projections into heads and into the
# MLP column-wise, the projections back row-wise.
LLAMA_TP = {"attention.wq": "column", "attention.wk": "column", "attention.wv": "column",
            "attention.wo": "row", "feed_forward.w1": "column", "feed_forward.w3": "column",
            "feed_forward.w2": "row"}


def dp_tp_accounting_worker(rank, world_size, shape, batch, seq_len, dp, tp, fake=False):
    """A Llama on a ("dp", "tp") mesh: LLAMA_TP over "tp", then FSDP2 over "dp"; as
    fsdp_accounting_worker, with PyTorch's MemTracker (FSDPMemTracker does not know DTensor
    parameters). Under the fake group the model is made in FakeTensorMode but laid out outside
    it: the mesh computes its coordinates from real tensors (`nonzero`, which FakeTensorMode
    cannot run)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from helpers import instrument, layouts
    from helpers.llama import Llama

    if fake:
        join_fake_group(dp * tp)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        torch.manual_seed(0)
        model = Llama(shape, max_seq_len=seq_len)
    plan = {name: ColwiseParallel() if style == "column" else RowwiseParallel()
            for name, style in LLAMA_TP.items()}
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    layouts.apply_fsdp(model, mesh["dp"])
    with mode:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, shape.vocab, (batch, seq_len))

        def step():
            loss = model(tokens).float().logsumexp(-1).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        step()
        tracker = MemTracker()
        tracker.track_external(model, optimizer, tokens)
        with tracker:
            step()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        with CommDebugMode() as comm:
            step()
        with instrument.Observer() as observer:
            step()
    return {"peak": {getattr(kind, "value", kind): size for kind, size in peak.items()},
            "collectives": {str(op): count for op, count in comm.get_comm_counts().items()},
            "calls": observer.calls(), "sent": observer.sent()}
