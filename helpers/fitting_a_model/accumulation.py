"""Gradient accumulation under ZeRO (lesson 11, notebooks/11_fitting_a_model.ipynb): with m
micro-batches per optimizer step, what one rank sends in a step and the gradients it holds, for
each strategy, measured and by formula.

Each step, every rank cuts its slice of the batch into m micro-batches; each micro-batch's loss is
divided by m, and its backward adds to the gradients the earlier ones left (no zero_grad between
them); then one AdamW step. With Psi parameters of b bytes (S = b Psi), n ranks, and the ring's
(n-1)/n (helpers.cost_model), one rank sends per step, and holds after a micro-batch's backward:

  strategy                 sends per step                          gradients held, at most
  DDP, no_sync             all_reduce 2(n-1)/n S once              S     whole, summed locally
  ZeRO-1                   reduce_scatter (n-1)/n S once,          S     whole, until step()
                           all_gather (n-1)/n S once                     reduce-scatters them
  ZeRO-2                   reduce_scatter (n-1)/n S m times,       S/n   pieces (each whole
                           all_gather (n-1)/n S once                     gradient freed in its hook)
  ZeRO-3                   all_gather (n-1)/n S 2m times,          S/n   pieces
                           reduce_scatter (n-1)/n S m times
  FSDP2, sync on the last  all_gather (n-1)/n S 2m times,          S     whole while m > 1 (S/n
                           reduce_scatter (n-1)/n S once                 when m = 1: ZeRO-3)

Deferring the reduction (DDP's no_sync, ZeRO-1's step) makes accumulation free in bytes but keeps
whole gradients; ZeRO-2 keeps pieces and pays a reduce-scatter per micro-batch. ZeRO-3 gathers the
weights for every micro-batch whatever it does with the gradients; turning FSDP2's gradient sync
off saves m-1 reduce-scatters and holds whole gradients, as ZeRO-1 does. "Held" is measured
after each backward (memory.held_bytes), not the transient peak inside one.

fully_shard, measured at n = 2: one all_gather_single per Linear in every forward and again in
every backward (2m per Linear per step), and one reduce_scatter_single per Linear in the last
micro-batch only. fully_shard reshards every module after its forward but the root
(torch/distributed/fsdp/_fully_shard/_fsdp_state.py, FSDPState._lazy_init: "For the root, do not
reshard after forward"; reshard_after_forward=None in _fully_shard.py's docstring); the MLP's root
holds no parameter of its own, so every weight is gathered 2m times. (A root's own parameters, a
final norm, would be gathered m times.) With sync off, FSDPParamGroup.post_backward
(_fsdp_param_group.py) reshards the weights but leaves each whole gradient on
FSDPParam.unsharded_param.grad (_fsdp_param.py; on unsharded_accumulated_grad with a reduce dtype):
no public API shows them, so `fsdp2_whole_gradients` reads these torch internals.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from helpers import reference
from helpers.data_parallelism.ddp import DDP
from helpers.instrument import Observer
from helpers.zero_and_fsdp.memory import held_bytes
from helpers.zero_and_fsdp.workers import Trainer, torch_model

STRATEGIES = {
    "ddp_no_sync": "lesson 06's DDP, micro-batches 1..m-1 in no_sync()",
    "zero_1": "ShardedOptimizer: whole gradients until step()",
    "zero_2": "ShardedOptimizer(gradient_sharding=True): pieces",
    "zero_3": "lesson 07's FSDP, per layer",
    "fsdp2_sync_on_last": "fully_shard, gradient sync on the last micro-batch only",
}
LABELS = {"ddp_no_sync": "DDP, no_sync", "zero_1": "ZeRO-1", "zero_2": "ZeRO-2",
          "zero_3": "ZeRO-3", "fsdp2_sync_on_last": "FSDP2, sync on the last"}


@dataclass
class Setup:
    """One rank's model for a strategy: what to call, its optimizer, the context each
    micro-batch's forward and backward run in (given whether it is the last), what to call
    before the optimizer's step, the whole parameters, and gradients held_bytes does not see."""
    module: nn.Module
    optimizer: torch.optim.Optimizer
    full_parameters: Callable[[], dict]
    micro_batch: Callable[[bool], contextlib.AbstractContextManager] = \
        lambda last: contextlib.nullcontext()
    finish: Callable[[], None] = lambda: None
    hidden_gradients: Callable[[], list] = list


def _ddp(model):
    ddp = DDP(model)
    return Setup(ddp, reference.make_optimizer("adamw", model.parameters()),
                 lambda: reference.parameters(model),
                 micro_batch=lambda last: contextlib.nullcontext() if last else ddp.no_sync(),
                 finish=ddp.finish_gradient_synchronization)


def _zero(stage):
    def build(model):  # the readable ShardedOptimizer (stages 1, 2) or the per-layer FSDP (3)
        trainer = Trainer(model, stage)
        return Setup(trainer.module, trainer.optimizer, trainer.full_parameters,
                     finish=trainer.after_backward)
    return build


def _fsdp2(model):
    module, optimizer = torch_model("fully_shard", model, unit="layer")

    def sync_if_last(last):
        module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    return Setup(module, optimizer, lambda: {name: param.full_tensor().detach() for name, param
                                             in module.named_parameters()},
                 micro_batch=sync_if_last, hidden_gradients=lambda: fsdp2_whole_gradients(module))


BUILD = {"ddp_no_sync": _ddp, "zero_1": _zero(1), "zero_2": _zero(2), "zero_3": _zero(3),
         "fsdp2_sync_on_last": _fsdp2}


def fsdp2_whole_gradients(module: nn.Module) -> list:
    """The whole gradients FSDP2 accumulates while gradient sync is off (torch internals, see the
    module docstring), for every fully_shard'ed module inside `module`; None where there is none."""
    states = {id(state): state for sub in module.modules() if isinstance(sub, FSDPModule)
              for state in [sub._get_fsdp_state()]}
    groups = [state._fsdp_param_group for state in states.values()]
    return [grad for group in groups if group is not None for param in group.fsdp_params
            for grad in (param.unsharded_param.grad, param.unsharded_accumulated_grad)]


def gradient_bytes(setup: Setup) -> int:
    hidden = sum(grad.untyped_storage().nbytes() for grad in setup.hidden_gradients()
                 if grad is not None)
    return held_bytes(setup.module, setup.optimizer)["gradients"] + hidden


def accumulation_worker(rank, world_size, strategy, model, batches, micro_batches):
    """Train a copy of `model` with `strategy` (STRATEGIES): each batch one optimizer step on this
    rank's slice, in `micro_batches` micro-batches. Returns the full parameters after the last
    step, the bytes sent in it by collective ("sent") and the calls ("calls"), and the most
    gradient bytes held after any of its micro-batches' backward ("gradient bytes")."""
    check_strategy(strategy)
    setup = BUILD[strategy](copy.deepcopy(model))
    for batch in batches:
        local = batch.shard(rank, world_size)
        setup.optimizer.zero_grad()
        most = 0
        with Observer() as observed:
            for part in range(micro_batches):
                micro = local.shard(part, micro_batches)
                with setup.micro_batch(part == micro_batches - 1):
                    loss = reference.mse_loss(setup.module(micro.inputs), micro.targets)
                    (loss / micro_batches).backward()
                most = max(most, gradient_bytes(setup))
            setup.finish()
            setup.optimizer.step()
    return {"parameters": setup.full_parameters(), "sent": observed.sent(),
            "calls": observed.calls(), "gradient bytes": most}


def sent_formula(strategy: str, num_parameters: int, world_size: int, micro_batches: int,
                 bytes_per_element: int = 4) -> dict:
    """{collective, as the Observer names it: bytes one rank sends in one step} (the table in
    the module docstring)."""
    check_strategy(strategy)
    ring = (world_size - 1) / world_size * bytes_per_element * num_parameters  # one ring pass
    m = micro_batches
    return {
        "ddp_no_sync": {"all_reduce": 2 * ring},
        "zero_1": {"reduce_scatter_single": ring, "all_gather_single": ring},
        "zero_2": {"reduce_scatter_single": m * ring, "all_gather_single": ring},
        "zero_3": {"all_gather_single": 2 * m * ring, "reduce_scatter_single": m * ring},
        "fsdp2_sync_on_last": {"all_gather_single": 2 * m * ring,
                                    "reduce_scatter_single": ring},
    }[strategy]


def gradient_bytes_formula(strategy: str, num_parameters: int, world_size: int,
                           micro_batches: int, bytes_per_element: int = 4) -> int:
    """The most gradient bytes one rank holds after a micro-batch's backward: whole (S) or pieces
    (S/n, for Psi divisible by n: padding adds up to n-1 elements a tensor). FSDP2 with sync off
    holds whole gradients until the last micro-batch, whose backward leaves pieces only."""
    check_strategy(strategy)
    whole = bytes_per_element * num_parameters
    pieces = whole // world_size
    if strategy == "fsdp2_sync_on_last":
        return whole if micro_batches > 1 else pieces
    return whole if strategy in ("ddp_no_sync", "zero_1") else pieces


def check_strategy(strategy):
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {list(STRATEGIES)}")
