"""Every strategy of the course, built one way and used one way.

    module, optimizer = strategies.build("zero_2", model)
    for batch in batches:
        optimizer.zero_grad()
        loss_fn(module(batch.inputs), batch.targets).backward()
        optimizer.step()

whatever the name. A hand-built strategy that communicates during backward (ddp, naive, the
bucketed zero_1 and zero_2, zero_3) finishes its gradient synchronization where PyTorch's DDP
does, in a callback it queues on autograd's engine, which runs when backward ends; the readable
ShardedOptimizer (zero_1 and zero_2 without bucket_mb) reduces in its hooks (stage 2) or in
step() (stage 1), which asks nothing of the caller either.

    name                        built by                                        lesson
    one_process                 the model alone (world size 1)                  -
    naive                       data_parallelism.ddp.AverageAfterBackward       06
    ddp                         data_parallelism.ddp.DDP (bucket_mb=None:       06
                                one all_reduce per gradient)
    torch_ddp                   torch.nn.parallel.DistributedDataParallel       -
    zero_1, zero_2              zero_and_fsdp.ShardedOptimizer, or given        07
                                bucket_mb the BucketedShardedOptimizer
    zero_3                      zero_and_fsdp.fsdp.FSDP, per layer or per block 07
    zero_redundancy_optimizer   torch's DDP with ZeroRedundancyOptimizer        -
    fully_shard                 FSDP2 (helpers.layouts.apply_fsdp)              -
    dp_tp                       tensor parallel x FSDP2 by a layouts.Plan       -
                                (helpers.layouts.lay_out)

Options (keywords; each name takes those that apply to it): `plan` (dp_tp: a helpers.layouts.Plan,
any degrees; by default pairs of ranks in tensor-parallel groups, Plan(dp=n / 2, tp=2)), `mesh`
(a DeviceMesh; the hand-built ones use its process group; by default the whole world, and for
dp_tp `layouts.make_mesh(plan)`),
`bucket_mb`, `unit` (zero_3: "layer" by default, as lesson 07 builds it; fully_shard: "block",
as FSDP2's documentation wraps a transformer), `compute_dtype` (zero_3), `optimizer` and `lr`
(helpers.reference), `max_grad_norm` (clip the global gradient norm before each step: the
sharded optimizers clip their pieces, the others with a step pre-hook), `recompute` (activation
checkpointing of every block, helpers.layouts.apply_ac: "none", "selective" or "full"; dp_tp
takes it from its plan).
Everything is built on the launcher's device (`get_device()`: a GPU under NCCL, else the CPU).

    full_parameters(module)        every whole parameter, by the unwrapped model's names
    held_bytes(module, optimizer)  the bytes of model state this rank holds
    batch_shard(mesh)              (rank, size) of the data-parallel dimension: which slice of a
                                   batch this rank trains on
    step_times_worker              contenders {label: (name, options)} take turns; their median
                                   step times and held bytes
    accumulation_worker            a strategy with m micro-batches per step; its parameters,
                                   collectives and gradient bytes
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from helpers import layouts, reference
from helpers.instrument import Observer
from helpers.launcher.result import get_device
from helpers.timing import take_turns, training_step

# The names this shared module takes from lessons (tests/test_structure.py checks the imports, as
# it checks each lesson's): the hand-built strategies stay in the lessons that teach them (06, 07)
# and are built here by name, so that later lessons and the benchmarks compare them with
# PyTorch's (CONTRIBUTING.md, "Shared code and lessons").
BUILDS_ON = {
    "data_parallelism.ddp:AverageAfterBackward": "lesson 06's naive data parallelism",
    "data_parallelism.ddp:DDP": "lesson 06's bucketed, overlapped DDP",
    "zero_and_fsdp.sharded_optimizer:ShardedOptimizer": "lesson 07's ZeRO stages 1 and 2",
    "zero_and_fsdp.bucketed_optimizer:BucketedShardedOptimizer": "lesson 07's ZeRO 1 and 2 in "
                                                                 "buckets",
    "zero_and_fsdp.fsdp:FSDP": "lesson 07's ZeRO stage 3",
}

STRATEGIES = ("one_process", "naive", "ddp", "torch_ddp", "zero_1", "zero_2", "zero_3",
              "zero_redundancy_optimizer", "fully_shard", "dp_tp")
SYNC = ("each_micro_batch", "last_micro_batch")  # accumulation: when gradients are reduced
MESHED = ("fully_shard", "dp_tp")  # laid out on a DeviceMesh (default_mesh, unless given one)
TP = 2  # dp_tp's default tensor-parallel degree


def build(name: str, model: nn.Module, *, mesh=None, bucket_mb: float | None = None,
          unit: str | None = None, compute_dtype: torch.dtype | None = None,
          optimizer: str = "adamw", lr: float = reference.LR, max_grad_norm: float | None = None,
          recompute: str = "none", plan: layouts.Plan | None = None,
          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """`model` (changed in place: pass a copy to keep it) laid out as strategy `name`, and its
    optimizer: (the module to call, the optimizer to step). See the module docstring."""
    check(name)
    if plan is not None and name != "dp_tp":
        raise ValueError(f"a plan lays out dp_tp, not {name!r}")
    model = model.to(get_device())  # in place: a Module's to() moves its own tensors
    if name == "dp_tp":  # (lay_out checkpoints between tensor parallelism and FSDP2)
        plan = plan_for(name, plan, recompute)
    else:
        layouts.apply_ac(model, recompute)
    optimizer_cls, settings = reference.OPTIMIZERS[optimizer]
    settings = {**settings, "lr": lr}
    group = None if mesh is None or name in ("fully_shard", "dp_tp") else mesh.get_group()
    if name in ("zero_1", "zero_2"):
        from helpers.zero_and_fsdp.bucketed_optimizer import BucketedShardedOptimizer
        from helpers.zero_and_fsdp.sharded_optimizer import ShardedOptimizer

        sharded = dict(gradient_sharding=name == "zero_2", group=group,
                       max_grad_norm=max_grad_norm, **settings)
        if bucket_mb is None:
            return model, ShardedOptimizer(model.parameters(), optimizer_cls, **sharded)
        return model, BucketedShardedOptimizer(model.parameters(), optimizer_cls,
                                               bucket_mb=bucket_mb, **sharded)
    module, clip = _module(name, model, mesh, group, bucket_mb, unit, compute_dtype, plan)
    if name == "zero_redundancy_optimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        made = ZeroRedundancyOptimizer(module.parameters(), optimizer_cls, process_group=group,
                                       **settings)
    else:
        made = optimizer_cls(module.parameters(), **settings)
    if max_grad_norm is not None:  # before each step, on the synchronized gradients
        def clip_before_step(*_):
            clip(max_grad_norm)  # (a pre-hook returns None, or new arguments for step)

        made.register_step_pre_hook(clip_before_step)
    return module, made


def _module(name, model, mesh, group, bucket_mb, unit, compute_dtype, plan):
    """The module of a strategy whose optimizer is a plain one, and how to clip its gradients."""
    def clip_whole(max_norm):
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    if name == "one_process":
        if dist.is_initialized() and dist.get_world_size() != 1:
            raise ValueError(f"'one_process' runs on 1 rank, not {dist.get_world_size()}")
        return model, clip_whole
    if name == "naive":
        from helpers.data_parallelism.ddp import AverageAfterBackward

        return AverageAfterBackward(model, group=group), clip_whole
    if name == "ddp":
        from helpers.data_parallelism.ddp import DDP

        return DDP(model, bucket_mb=bucket_mb, group=group), clip_whole
    if name in ("torch_ddp", "zero_redundancy_optimizer"):
        device = get_device()
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(
            model, device_ids=ids, process_group=group,
            **({} if bucket_mb is None else {"bucket_cap_mb": bucket_mb})), clip_whole
    if name == "zero_3":
        from helpers.zero_and_fsdp.fsdp import FSDP

        fsdp = FSDP(model, compute_dtype=compute_dtype, group=group,
                    units=_blocks(model) if unit == "block" else None)  # default: per layer
        return fsdp, fsdp.clip_grad_norm_
    if name == "fully_shard":
        layouts.apply_fsdp(model, mesh_for(name, mesh), unit=unit or "block")
    else:  # dp_tp
        layouts.lay_out(model, mesh_for(name, mesh, plan), plan)
    return model, clip_whole


def _blocks(model: nn.Module):
    return getattr(model, "blocks", getattr(model, "layers", None))


def plan_for(name: str, plan: layouts.Plan | None = None, recompute: str = "none"):
    """The layouts.Plan strategy `name` is laid out by: for dp_tp `plan`, or by default every
    pair of ranks a tensor-parallel group (Plan(dp=n / 2, tp=2, recompute)); for fully_shard
    every rank in "dp"; None for the others."""
    if name not in MESHED:
        return None
    if plan is not None:
        if recompute != "none" and recompute != plan.recompute:
            raise ValueError(f"recompute={recompute!r} and a plan that says "
                             f"{plan.recompute!r}: say it in the plan")
        return plan
    world_size = dist.get_world_size()
    if name == "fully_shard":
        return layouts.Plan(dp=world_size)
    if world_size % TP:
        raise ValueError(f"dp_tp puts {TP} ranks in each tensor-parallel group by default; "
                         f"{world_size} ranks do not split so: give a plan")
    return layouts.Plan(dp=world_size // TP, tp=TP, recompute=recompute)


def default_mesh(name: str, plan: layouts.Plan | None = None):
    """The mesh `build` lays `name` out on when given none: layouts.make_mesh of its plan
    (plan_for): the whole world in one dimension, "dp"; for dp_tp, ("dp", "tp")."""
    return layouts.make_mesh(plan_for(name, plan))


def mesh_for(name: str, mesh=None, plan: layouts.Plan | None = None):
    """The mesh strategy `name` is laid out on: `mesh` if given, else default_mesh(name, plan)
    for those laid out on a DeviceMesh (MESHED), else None (the whole world's group)."""
    return mesh if mesh is not None or name not in MESHED else default_mesh(name, plan)


def batch_shard(mesh=None) -> tuple[int, int]:
    """(rank, size) of the data-parallel dimension of `mesh` ("dp", or its only one): which
    slice of each batch this rank trains on. Without a mesh: this rank of the world."""
    if mesh is not None and mesh.mesh_dim_names and "dp" in mesh.mesh_dim_names:
        return mesh.get_local_rank("dp"), mesh["dp"].size()
    if mesh is not None:
        return mesh.get_local_rank(), mesh.size()
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def check(name: str) -> None:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {list(STRATEGIES)}")


def unwrapped(module: nn.Module) -> nn.Module:
    """The model inside a data-parallel wrapper (torch's DDP and the course's keep it as
    `.module`)."""
    while isinstance(getattr(module, "module", None), nn.Module):
        module = module.module
    return module


@torch.no_grad()
def full_parameters(module: nn.Module) -> dict:
    """name -> every whole parameter, named as in the model before it was laid out (a tied one
    once), on the CPU. The hand-built FSDP's buffers too (gather_full_params). Every rank must
    call it: the sharded strategies gather."""
    if hasattr(module, "gather_full_params"):
        return {name: value.cpu() for name, value in module.gather_full_params().items()}
    with layouts.quiet_redistribute():  # a (dp, tp) parameter takes two all-gathers: a check
        return {name: (param.full_tensor() if isinstance(param, DTensor) else param).detach()
                .clone().cpu() for name, param in unwrapped(module).named_parameters()}


def held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The bytes this rank actually holds, counted from the tensors' storages (each storage
    once; of a DTensor, its local piece): the module's parameters, their gradients (a
    ShardedOptimizer's gradient pieces, and the whole gradients FSDP2 accumulates while its
    gradient sync is off, included), and every tensor in the optimizer's state (that of a
    ShardedOptimizer's inner optimizer, or of ZeroRedundancyOptimizer's local one)."""
    seen = set()

    def size(tensors) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None or not isinstance(tensor, torch.Tensor):
                continue
            if isinstance(tensor, DTensor):  # fully_shard's: count this rank's local piece
                tensor = tensor.to_local()
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(module.parameters())
    # ShardedOptimizer keeps its state in .inner, ZeroRedundancyOptimizer in .optim
    inner = getattr(optimizer, "inner", getattr(optimizer, "optim", optimizer))
    pieces = list(getattr(optimizer, "pieces", {}).values())
    return {
        "weights": size(params),
        "gradients": size([p.grad for p in params] + [p.grad for p in pieces]
                          + fsdp2_whole_gradients(module)),
        "optimizer": size(value for state in inner.state.values() for value in state.values()),
    }


def fsdp2_whole_gradients(module: nn.Module) -> list:
    """The whole gradients FSDP2 accumulates while its gradient sync is off
    (set_requires_gradient_sync(False)), for every fully_shard'ed module inside `module`: None
    where there is none. No public API shows them: FSDPParamGroup.post_backward
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py) reshards the weights but leaves
    each whole gradient on FSDPParam.unsharded_param.grad (on unsharded_accumulated_grad with a
    reduce dtype), so this reads those torch internals."""
    from torch.distributed.fsdp import FSDPModule

    states = {id(state): state for sub in module.modules() if isinstance(sub, FSDPModule)
              for state in [sub._get_fsdp_state()]}
    groups = [state._fsdp_param_group for state in states.values()]
    return [grad for group in groups if group is not None for param in group.fsdp_params
            for grad in (param.unsharded_param.grad, param.unsharded_accumulated_grad)]


# --- the workers every lesson and benchmark shares ---------------------------------------------

LOSSES = {"lm": reference.lm_loss, "mse": reference.mse_loss}


def step_times_worker(rank, world_size, contenders, model, batch, iterations, loss="lm"):
    """Each contender, {label: (strategy name, build options)}, on its own copy of `model`,
    trains on this rank's slice of `batch` (batch_shard: its data-parallel slice), one step after
    the other (helpers.timing.take_turns: every step starts after a barrier and lasts as long as
    the slowest rank; the first round a warm-up, in which torch's DDP also rebuilds its
    buckets). Returns {"seconds": each one's
    median step time, "held": the bytes of model state each holds between one more backward
    and its optimizer's step (held_bytes)}."""
    built, local = {}, {}
    for label, (name, options) in contenders.items():
        mesh = mesh_for(name, options.get("mesh"), options.get("plan"))
        built[label] = build(name, copy.deepcopy(model), **{**options, "mesh": mesh})
        local[label] = batch.shard(*batch_shard(mesh)).to(get_device())
    steps = {label: functools.partial(training_step, module, optimizer, LOSSES[loss],
                                      local[label].inputs, local[label].targets)
             for label, (module, optimizer) in built.items()}
    with warnings.catch_warnings():
        # fully_shard on a single Linear warns that its output (a view, for 3-D inputs) must not
        # be changed in place; these models never do
        warnings.filterwarnings("ignore", message=".*returned a view tensor")
        seconds = take_turns(steps, rounds=iterations)
        held = {}
        for label, (module, optimizer) in built.items():
            optimizer.zero_grad()
            LOSSES[loss](module(local[label].inputs), local[label].targets).backward()
            held[label] = held_bytes(module, optimizer)
            optimizer.step()
    return {"seconds": seconds, "held": held}


def accumulation_worker(rank, world_size, strategy, model, batches, micro_batches,
                        sync="each_micro_batch", loss="mse", **options):
    """Train a copy of `model` with `strategy` (build's name and `options`): each batch one
    optimizer step on this rank's slice, in `micro_batches` micro-batches, each loss divided by
    the number of micro-batches, no zero_grad between them. sync="last_micro_batch" turns the
    gradient reduction off for all but the last (ddp's and torch_ddp's no_sync(), fully_shard's
    set_requires_gradient_sync(False)); the other strategies have no such switch. Returns the
    full parameters after the last step, what it sent in that step by collective ("sent") and
    its calls ("calls"), and the most gradient bytes held after any micro-batch's backward
    ("gradient bytes", held_bytes)."""
    if sync not in SYNC:
        raise ValueError(f"unknown sync {sync!r}; choose one of {list(SYNC)}")
    mesh = mesh_for(strategy, options.pop("mesh", None), options.get("plan"))
    module, optimizer = build(strategy, copy.deepcopy(model), mesh=mesh, **options)
    for batch in batches:
        local = batch.shard(*batch_shard(mesh)).to(get_device())
        optimizer.zero_grad()
        most = 0
        with Observer() as observed:
            for part in range(micro_batches):
                last = part == micro_batches - 1
                micro = local.shard(part, micro_batches)
                with gradient_sync(module, last or sync == "each_micro_batch"):
                    (LOSSES[loss](module(micro.inputs), micro.targets) / micro_batches).backward()
                most = max(most, held_bytes(module, optimizer)["gradients"])
            optimizer.step()
    return {"parameters": full_parameters(module), "sent": observed.sent(),
            "calls": observed.calls(), "gradient bytes": most}


def gradient_sync(module, on: bool):
    """A context in which the forward and backward of `module` reduce gradients, or not."""
    if on:
        if hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if hasattr(module, "no_sync"):
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(False)
        return contextlib.nullcontext()
    raise ValueError(f"{type(module).__name__} has no way to turn its gradient sync off")


# --- the hand-built strategies' state, as torch.distributed.checkpoint reshards it -------------

def state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model": ..., "optimizer": ...}: a hand-built strategy's state (naive, ddp, zero_1,
    zero_2, zero_3, one_process) in the form torch.distributed.checkpoint saves, and loads into
    the same strategy on any number of ranks. Every tensor is this rank's own, not a copy, so
    `dcp.load` fills the strategy in place (`load`).

    Keys are the model's parameter names, and, where lesson 07 flattens several tensors into one
    piece, the name of what is flattened: "buckets.<i>" (BucketedShardedOptimizer) or
    "<layer>.flat_parameter" (FSDP, one per layer or unit). A whole tensor (a replica's weight)
    is a plain tensor, which DCP writes once. A piece is a DTensor sharded along dimension 0
    over the group (`flat_shard`): lesson 07 cuts a flat tensor of N elements into n pieces of
    ceil(N / n), zero-padded, and DTensor's Shard(0) cuts it the same way, padding left out (as
    torch.chunk does, with an empty piece for a rank left over). So a checkpoint saved on 4 ranks
    loads on 2 or 3: DCP reads, for each rank, the stored pieces that overlap its own. Every rank
    must call it. PyTorch's strategies give theirs with
    torch.distributed.checkpoint.state_dict.get_state_dict."""
    names = {param: name for name, param in unwrapped(module).named_parameters()}
    flat = _flat_pieces(module, optimizer, names)  # a piece -> (its key, its numel)
    mesh = _group_mesh(module, optimizer) if flat else None
    model = {names[param]: param.detach() for param in names if param not in flat}
    model.update({key: flat_shard(piece.detach(), numel, mesh)
                  for piece, (key, numel) in flat.items()
                  if not isinstance(optimizer, _sharded_optimizers())})
    inner = getattr(optimizer, "inner", optimizer)
    states = {}
    for param, state in inner.state.items():
        key, numel = flat.get(param, (names.get(param), None))
        states[key] = {name: flat_shard(value, numel, mesh)
                       if numel is not None and value.dim() > 0 else value
                       for name, value in state.items()}
    return {"model": model, "optimizer": states}


def load(module: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id) -> None:
    """Fill a hand-built strategy, built on any number of ranks, from a checkpoint that
    `dcp.save(state_dict(module, optimizer), checkpoint_id=...)` wrote. Every rank must call
    it."""
    import torch.distributed.checkpoint as dcp

    _allocate_state(getattr(optimizer, "inner", optimizer))
    dcp.load(state_dict(module, optimizer), checkpoint_id=checkpoint_id)


def flat_shard(piece: torch.Tensor, numel: int, mesh) -> DTensor:
    """This rank's piece of a flat tensor of `numel` elements, cut as lesson 07 cuts one
    (zero-padded to n pieces of ceil(numel / n)), as a DTensor sharded along dimension 0 over the
    1-D `mesh`: its local tensor is the piece without the padding (a view: it shares memory)."""
    from torch.distributed.tensor import Shard

    start = mesh.get_local_rank() * piece.numel()
    real = max(0, min(piece.numel(), numel - start))
    return DTensor.from_local(piece[:real], mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([numel]), stride=(1,))


def _sharded_optimizers():
    from helpers.zero_and_fsdp.sharded_optimizer import ShardedOptimizer

    return (ShardedOptimizer,)  # the bucketed one is a ShardedOptimizer too


def _flat_pieces(module, optimizer, names) -> dict:
    """{piece: (key, numel of the flat tensor it is a piece of)} of every sharded piece."""
    if isinstance(optimizer, _sharded_optimizers()):
        if hasattr(optimizer, "buckets"):  # BucketedShardedOptimizer
            return {bucket.piece: (f"buckets.{index}", sum(p.numel() for p in bucket.params))
                    for index, bucket in enumerate(optimizer.buckets)}
        return {piece: (names[param], param.numel()) for param, piece in optimizer.pieces.items()}
    if hasattr(module, "sharding"):  # the hand-built FSDP: a piece per layer or unit
        pieces = {}
        for prefix, layer in module.module.named_modules():
            piece = getattr(layer, "piece", None)
            if isinstance(piece, nn.Parameter) and piece not in pieces:
                numel = sum(math.prod(shape) for shape in module.sharding.shapes[piece])
                pieces[piece] = (f"{prefix}.flat_parameter", numel)
        return pieces
    return {}


def _group_mesh(module, optimizer):
    """A 1-D DeviceMesh over the strategy's process group."""
    from torch.distributed.device_mesh import DeviceMesh

    group = getattr(optimizer, "group", None) or getattr(module, "group", None)
    return DeviceMesh.from_group(group or dist.group.WORLD, get_device().type)


@torch.no_grad()
def _allocate_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of `optimizer` its state (AdamW's moments and step count) without
    changing it: one step with zero gradients and a learning rate of 0, as DCP's own
    get_optimizer_state_dict does for PyTorch's strategies before loading."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved_lrs):
        group["lr"] = lr
    optimizer.zero_grad()
