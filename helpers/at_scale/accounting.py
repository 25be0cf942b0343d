"""One training step, accounted for by PyTorch's own tools, on real ranks or on fake ones.

A fake rank is one process that plays rank 0 of N: `init_process_group("fake")` (PyTorch's
`FakeProcessGroup`: every collective returns at once, having moved nothing between ranks) and
`FakeTensorMode` (tensors with shapes and no storage). The same worker runs on real gloo ranks
at a small size, where the accounting can be checked against reality.

The layout is the course's (helpers.layouts: `Plan`, `make_mesh`, `lay_out`); this module
accounts for a step of it.

- `account_worker(rank, world_size, shape, plan, *, fake=False, measure=MEASURES, fast=True)`:
  a Llama (helpers.llama) laid out by `plan`, AdamW's state created by a step on zero gradients,
  then one step under PyTorch's `FSDPMemTracker` (`MemTracker` with tensor parallelism) with the
  course's `instrument.Observer` and `TensorParallelBytes` inside it (this rank's peak bytes by
  kind; the collectives it calls and the bytes it sends) and, in a step of its own,
  `CommDebugMode` (PyTorch's count of the collectives). With `fake`, the process, launched alone
  with init_group=False, plays rank 0 of plan.gpus.
- `loss_worker(rank, world_size, shape, plan)`: the peak of the loss alone, on fake ranks.
- `shapes_apart()`: inside it, a fake step is accounted for as a real one where DTensor infers
  its operations' shapes with fake tensors of its own (its docstring says how).
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.layouts import Plan, clip_to_norm, lay_out, make_mesh

MEASURES = ("memory", "collectives")


class TensorParallelBytes(TorchDispatchMode):
    """Counts the collectives DTensor calls (the functional ones: all-gather, reduce-scatter,
    all-reduce; instrument.Observer sees only torch.distributed's own calls) and the bytes this
    rank sends for each by the cost model's ring: (n - 1) of its n pieces for an all-gather or a
    reduce-scatter, twice that for an all-reduce."""

    RING = {"all_gather_into_tensor": lambda size, n: (n - 1) * size,
            "reduce_scatter_tensor": lambda size, n: (n - 1) / n * size,
            "all_reduce": lambda size, n: 2 * (n - 1) / n * size}

    def __init__(self):
        super().__init__()
        self.calls, self.sent = {}, {}

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        name = op.overloadpacket.__name__
        if op.namespace == "_c10d_functional" and name in self.RING:
            group = dist.distributed_c10d._resolve_process_group(args[-1])
            size = args[0].numel() * args[0].element_size()
            key = f"DTensor {name}"  # apart from the Observer's names (HSDP's all_reduce)
            self.calls[key] = self.calls.get(key, 0) + 1
            self.sent[key] = self.sent.get(key, 0) + self.RING[name](size, group.size())
        return op(*args, **(kwargs or {}))


def trackers(fast: bool = True) -> tuple:
    """(FSDPMemTracker, MemTracker), PyTorch's, or (with `fast`) each with only its global peak
    kept up to date. After every operation a tracker compares the bytes alive with the peak of
    every module it has seen, O(modules) per operation: most of a fake step's time at Llama 3's
    sizes. This lesson reads only the global peak, which the fast ones compute exactly as PyTorch's
    do (tests/test_at_scale.py compares them)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    if not fast:
        return FSDPMemTracker, MemTracker

    def global_peak_only(self, peak_state) -> None:  # MemTracker._update_peak_stats, less its
        for device, snapshot in self._curr_mem_snap.items():  # first loop (per module)
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = copy.deepcopy(snapshot)

    return (type("GlobalPeakFSDPMemTracker", (FSDPMemTracker,),
                 {"_update_peak_stats": global_peak_only}),
            type("GlobalPeakMemTracker", (MemTracker,), {"_update_peak_stats": global_peak_only}))


def join_fake_group(world_size: int, rank: int = 0) -> None:
    """This process plays rank `rank` of `world_size` in a fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


@contextlib.contextmanager
def shapes_apart():
    """DTensor infers the global shape of some operations' outputs by running them on fake
    tensors of the global size (torch 2.13, torch/distributed/tensor/_sharding_prop.py,
    `_propagate_tensor_meta_non_cached`: `detect_fake_mode() or FakeTensorMode()`). On a real
    rank that is a fake mode of its own, and MemTracker leaves its tensors out: it counts only
    those of the fake mode it was entered in (mem_tracker.py, `_fake_mode_on_entry`). In a fake
    step DTensor borrows the step's own mode, so the tracker counts them as the step's. Under
    loss_parallel that is every call (a fake mode makes `_are_we_tracing()` true, so the
    shapes are never cached): `nll_loss_backward` on the whole vocabulary's logits, two float32
    tensors each t times this rank's logits, where the real rank's temporaries are three of its
    own size: (2t - 3) of them too many. Inside this context DTensor is given a fake mode of its
    own, as on a real rank, and fake = real (tests/test_at_scale.py). It replaces a name in a
    private module of PyTorch's: a later PyTorch may need another way."""
    from torch.distributed.tensor import _sharding_prop

    detect = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = detect


def train_step(model, optimizer, tokens, plan: Plan, mark=None) -> None:
    """torchtitan's step (train.py at pytorch/torchtitan@9dec370): next-token cross-entropy on
    float32 logits, the logits freed before backward, gradients clipped to a global norm of 1,
    AdamW, both with foreach=True as torchtitan has them; with tensor parallelism, the loss
    computed on logits cut by the vocabulary (loss_parallel). `mark(phase)`, if given, is told
    where each phase begins: "forward", "loss", "backward", "clipping", "optimizer"."""
    from torch.distributed.tensor.parallel import loss_parallel

    mark = mark or (lambda phase: None)
    mark("forward")
    logits = model(tokens[:, :-1])
    with loss_parallel() if plan.tp > 1 else contextlib.nullcontext():
        mark("loss")
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        del logits  # as torchtitan: the float32 copy the loss keeps is enough for backward
        mark("backward")
        loss.backward()
    mark("clipping")
    clip_to_norm(model, 1.0, foreach=True)
    mark("optimizer")
    optimizer.step()
    optimizer.zero_grad()


@contextlib.contextmanager
def prepared(shape, plan: Plan, fake: bool):
    """(model, optimizer, tokens) for a step of `plan` on this rank, inside the fake mode they
    were made in if `fake` (this process already in the group: a fake one, or real ranks): a
    Llama (helpers.llama) laid out by `lay_out`, AdamW's state created by a step on zero
    gradients, and a micro-batch of random tokens."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from helpers.llama import Llama

    mesh = make_mesh(plan)
    # The model is made under FakeTensorMode, laid out outside it: a mesh computes its
    # coordinates with `nonzero`, which fake tensors cannot run (no data, no output shape).
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        torch.manual_seed(0)
        model = Llama(shape, max_seq_len=plan.seq_len)
    lay_out(model, mesh, plan)
    with mode, shapes_apart() if fake else contextlib.nullcontext():  # (its docstring says why)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # torchtitan's
        for parameter in model.parameters():  # AdamW's moments exist from the first step on
            parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
        optimizer.zero_grad()
        yield model, optimizer, torch.randint(0, shape.vocab, (plan.micro_batch, plan.seq_len + 1))


def account_worker(rank, world_size, shape, plan, *, fake=False, measure=MEASURES, fast=True):
    """{"peak": {kind: bytes}, "calls": {collective: count}, "sent": {collective: bytes},
    "collectives": {op: count}} for one step of `plan` on this rank ("collectives" only if
    "collectives" is in `measure`)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from helpers import instrument

    plan.check(shape)
    if fake:
        join_fake_group(plan.gpus)
    elif world_size != plan.gpus:
        raise ValueError(f"{plan} needs {plan.gpus} ranks, not {world_size}")
    with prepared(shape, plan, fake) as (model, optimizer, tokens):
        step = functools.partial(train_step, model, optimizer, tokens, plan)
        FSDPMemTracker, MemTracker = trackers(fast)
        if plan.tp == 1:  # FSDP's own kinds: sharded and gathered weights, its buffers
            tracker = FSDPMemTracker(model, optimizer)
        else:  # PyTorch's general tracker (FSDPMemTracker runs on DP x TP too; the two trackers
            tracker = MemTracker()  # file a step's tensors differently, and their peaks differ)
            tracker.track_external(model, optimizer)
        with tracker, instrument.Observer() as observer, TensorParallelBytes() as tensor:
            step()
        (peak,) = tracker.get_tracker_snapshot("peak").values()  # {device: {kind: bytes}}
        found = {"peak": {getattr(kind, "value", kind): size for kind, size in peak.items()},
                 "calls": {**observer.calls(), **tensor.calls},
                 "sent": {**observer.sent(), **tensor.sent}}
        if "collectives" in measure:
            with CommDebugMode() as comm:
                step()
            found["collectives"] = {str(op): count for op, count in comm.get_comm_counts().items()}
    return found


def loss_worker(rank, world_size, shape, plan):
    """{kind: bytes} at the peak of the loss alone, forward and backward, on fake ranks: this
    rank's bfloat16 logits as the output head leaves them (cut by the vocabulary over tp, with
    loss_parallel), upcast and cross-entropy as train_step computes them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    join_fake_group(plan.gpus)
    mesh = make_mesh(plan)
    _, MemTracker = trackers()
    with FakeTensorMode(), shapes_apart():
        logits = torch.empty(plan.micro_batch, plan.seq_len, shape.vocab // plan.tp,
                             dtype=torch.bfloat16 if plan.bf16 else torch.float32,
                             requires_grad=True)
        if plan.tp > 1:
            logits = DTensor.from_local(logits, mesh["tp"], [Shard(2)])
        targets = torch.randint(0, shape.vocab, (plan.micro_batch * plan.seq_len,))

        def loss():
            with loss_parallel() if plan.tp > 1 else contextlib.nullcontext():
                F.cross_entropy(logits.flatten(0, 1).float(), targets).backward()
            logits.grad = None

        tracker = MemTracker()
        with tracker:
            loss()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
    return {getattr(kind, "value", kind): size for kind, size in peak.items()}
