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
after each backward (strategies.held_bytes), not the transient peak inside one.

fully_shard, measured at n = 2: one all_gather_single per Linear in every forward and again in
every backward (2m per Linear per step), and one reduce_scatter_single per Linear in the last
micro-batch only. fully_shard reshards every module after its forward but the root
(torch/distributed/fsdp/_fully_shard/_fsdp_state.py, FSDPState._lazy_init: "For the root, do not
reshard after forward"; reshard_after_forward=None in _fully_shard.py's docstring); the MLP's root
holds no parameter of its own, so every weight is gathered 2m times. (A root's own parameters, a
final norm, would be gathered m times.) With sync off, FSDPParamGroup.post_backward
(_fsdp_param_group.py) reshards the weights but leaves each whole gradient on
FSDPParam.unsharded_param.grad (_fsdp_param.py; on unsharded_accumulated_grad with a reduce dtype):
no public API shows them, so `strategies.fsdp2_whole_gradients` reads these torch internals.

Every strategy runs in one loop, `strategies.accumulation_worker`, with the keywords of
STRATEGIES.
"""

from __future__ import annotations

# Each strategy of the table: {key: what strategies.accumulation_worker takes, as keywords}
STRATEGIES = {
    "ddp_no_sync": dict(strategy="ddp", sync="last_micro_batch"),  # lesson 06's DDP
    "zero_1": dict(strategy="zero_1"),  # ShardedOptimizer: whole gradients until step()
    "zero_2": dict(strategy="zero_2"),  # ShardedOptimizer(gradient_sharding=True): pieces
    "zero_3": dict(strategy="zero_3", unit="layer"),  # lesson 07's FSDP, per layer
    "fsdp2_sync_on_last": dict(strategy="fully_shard", unit="layer", sync="last_micro_batch"),
}
LABELS = {"ddp_no_sync": "DDP, no_sync", "zero_1": "ZeRO-1", "zero_2": "ZeRO-2",
          "zero_3": "ZeRO-3", "fsdp2_sync_on_last": "FSDP2, sync on the last"}


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
