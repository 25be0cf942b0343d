"""What lesson 10's ranks run (torch only: no plotting here). Each worker returns plain data."""

from __future__ import annotations

import copy
import logging
import statistics
import time

import torch
import torch.distributed as dist

from helpers import reference
from helpers.composing import ring_attention as ring
from helpers.composing.experts import ExpertParallelMoE, sum_router_gradients
from helpers.composing.hybrid import LMStage
from helpers.composing.mesh import Grid, new_groups
from helpers.composing.weights import VARIANTS, WeightTransfer, greedy_generate, make_weight_groups
from helpers.data_parallelism.ddp import DDP, average_gradients
from helpers.pipeline_parallelism.schedule import pipeline_step

# --- mesh ---------------------------------------------------------------------------------------

def grid_worker(rank, world_size, dims, sizes):
    """The hand-built grid's groups against init_device_mesh's, for the same shape and names.
    Returns {dimension: (this rank's group members by hand, by init_device_mesh)}."""
    from torch.distributed.device_mesh import init_device_mesh

    grid = Grid(tuple(dims), tuple(sizes))
    groups = new_groups(grid, rank)
    mesh = init_device_mesh("cpu", tuple(sizes), mesh_dim_names=tuple(dims))
    return {dim: (dist.get_process_group_ranks(groups[dim]),
                  dist.get_process_group_ranks(mesh.get_group(dim))) for dim in dims}


def _mean_over(value: float, group) -> float:
    """The mean of `value` over the ranks of `group` (each data-parallel rank's loss is the mean
    over its slice; the batch's loss is the mean of those)."""
    value = torch.tensor([value], dtype=torch.float64)  # a Python float's own precision
    dist.all_reduce(value, op=dist.ReduceOp.AVG, group=group)
    return value.item()


def dp_tp_worker(rank, world_size, model, batches, tp_size, lr=1e-2):
    """Data x tensor parallelism by hand on a (world_size / tp_size) x tp_size grid: each block
    tensor-parallel over the tp group (lesson 08's parallelize_block), the whole model wrapped in
    lesson 06's DDP over the dp group. Returns the batch loss of every step and this rank's
    parameters at the end (its shards), by the dense model's names."""
    grid = Grid(("dp", "tp"), (world_size // tp_size, tp_size))
    groups, place = new_groups(grid, rank), grid.coordinates(rank)
    model = DDP(LMStage(model, tp_group=groups["tp"]), group=groups["dp"])
    optimizer = reference.make_optimizer("adamw", model.parameters(), lr)
    losses = []
    for batch in batches:
        local = batch.shard(place["dp"], grid.sizes[0])
        optimizer.zero_grad()
        # forward and backward: tensor parallelism's all-reduces, on the tp group; in backward,
        # DDP's hooks also launch each gradient's all-reduce on the dp group as it is ready
        loss = reference.lm_loss(model(local.inputs), local.targets)
        loss.backward()
        model.finish_gradient_synchronization()  # data parallelism: wait for the dp averages
        optimizer.step()
        losses.append(_mean_over(loss.item(), groups["dp"]))
    return {"place": place, "losses": losses,
            "parameters": reference.parameters(model.module)}


def dp_tp_pp_worker(rank, world_size, model, batches, sizes, micro_batches=2, lr=1e-2):
    """Data x pipeline x tensor parallelism by hand on a dp x pp x tp grid (`sizes`): rank
    (d, p, t) runs pipeline stage p (lesson 09's pipeline_step, 1F1B, on the pp group) of blocks
    that are tensor-parallel over the tp group, on dp slice d of each batch, and averages its
    gradients over the dp group (lesson 06's average_gradients). Returns the batch loss of every
    step (on the last stage; None elsewhere), its place, and its parameters at the end."""
    grid = Grid(("dp", "pp", "tp"), tuple(sizes))
    groups, place = new_groups(grid, rank), grid.coordinates(rank)
    num_stages = grid.sizes[1]
    stage = LMStage(model, place["pp"], num_stages, groups["tp"])
    optimizer = reference.make_optimizer("adamw", stage.parameters(), lr)
    losses = []
    for batch in batches:
        local = batch.shard(place["dp"], grid.sizes[0])
        optimizer.zero_grad()
        step = pipeline_step(stage, local.inputs if stage.first else None,
                             local.targets if stage.last else None, reference.lm_loss,
                             micro_batches, "1f1b", group=groups["pp"], track_memory=False)
        average_gradients(stage, groups["dp"])  # data parallelism: one all_reduce per parameter
        optimizer.step()
        if stage.last:
            losses.append(_mean_over(step.loss, groups["dp"]))
    return {"place": place, "losses": losses if stage.last else None,
            "parameters": reference.parameters(stage)}


def torch_dp_tp_worker(rank, world_size, model, batches, tp_size, lr=1e-2):
    """The same training with PyTorch's pieces on one DeviceMesh ("dp", "tp"): each block
    parallelize_module'd over mesh["tp"] with lesson 08's plan, then fully_shard over mesh["dp"]
    (each block, then the whole model). Returns the losses, every parameter gathered whole
    (full_tensor), and each parameter's DTensor layout: its mesh dimensions, placements and the
    shape of this rank's piece."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from helpers.tensor_parallelism.megatron import torch_plan

    mesh = init_device_mesh("cpu", (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    model = copy.deepcopy(model)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], torch_plan(sequence_parallel=False))
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = reference.make_optimizer("adamw", model.parameters(), lr)
    dp_rank, losses = mesh.get_local_rank("dp"), []
    for batch in batches:
        local = batch.shard(dp_rank, mesh.size(0))
        optimizer.zero_grad()
        loss = reference.lm_loss(model(local.inputs), local.targets)
        loss.backward()
        optimizer.step()
        losses.append(_mean_over(loss.item(), mesh.get_group("dp")))
    layouts = {name: (param.device_mesh.mesh_dim_names, tuple(map(repr, param.placements)),
                      tuple(param.to_local().shape))
               for name, param in model.named_parameters()}
    # Gathering fully_shard's strided pieces takes two all-gathers, which DTensor warns about on
    # every rank: true, and of no interest here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    full = {name: param.full_tensor().detach().clone() for name, param in model.named_parameters()}
    return {"losses": losses, "parameters": full, "layouts": layouts}


# --- experts ------------------------------------------------------------------------------------


def moe_worker(rank, world_size, moe, tokens, output_grad):
    """Expert parallelism, one expert per rank: rank r takes its slice of `tokens` (N, dim), the
    ranks' N / E each in rank order, through ExpertParallelMoE(moe), then backward from the
    loss sum(output * output_grad) over the whole batch, each rank its own slice's part.
    Returns its outputs, its tokens' gradient, its expert's and the router's gradients (named as
    in `moe`), its routing's counts, and the bytes of every all-to-all of rows."""
    layer = ExpertParallelMoE(moe)
    local = tokens.tensor_split(world_size)[rank].clone().requires_grad_()
    traffic = []
    output, routing = layer.forward_with_routing(local, traffic)
    (output * output_grad.tensor_split(world_size)[rank]).sum().backward()
    sum_router_gradients(layer)  # the replicated router: gradients summed, as in data parallelism
    grads = {f"router.{name}": param.grad for name, param in layer.router.named_parameters()}
    grads.update({f"experts.{rank}.{name}": param.grad
                  for name, param in layer.expert.named_parameters()})
    return {"output": output.detach(), "input_grad": local.grad, "grads": grads,
            "routed_per_expert": routing.routed_per_expert(world_size).tolist(),
            "kept_per_expert": routing.kept_per_expert(world_size).tolist(),
            "dropped": routing.dropped, "capacity": routing.capacity,
            "capacity_factor": layer.capacity_factor, "traffic": traffic}


# --- weights ------------------------------------------------------------------------------------


def _stale(model):
    """An inference rank's copy before any transfer: the model's shapes, every weight NaN, so
    that a weight the transfer misses shows in the logits."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    return model


def weight_update_worker(rank, world_size, num_trainers, model, batches, prompt, new_tokens,
                         variant="bucketed broadcast", bucket_bytes=2**14, lr=1e-2):
    """Reinforcement learning's loop without the reward: per batch, the trainers take one
    data-parallel AdamW step (each on its slice of the batch, gradients averaged over the
    trainers' group, lesson 06), the weights go to the inference ranks by `variant`, and every
    rank decodes `new_tokens` greedily from `prompt` with the weights it now holds.
    Returns {"trainer", "steps": per step {"tokens", "logits"}, "parameters" (after the last
    step), "calls" (this rank's calls in the last transfer)}."""
    groups = make_weight_groups(num_trainers, world_size)
    trainer = groups.is_trainer(rank)
    local = copy.deepcopy(model) if trainer else _stale(model)
    optimizer = reference.make_optimizer("adamw", local.parameters(), lr) if trainer else None
    transfer = WeightTransfer(list(local.parameters()), groups, variant, bucket_bytes)
    steps, calls = [], []
    for batch in batches:
        if trainer:
            shard = batch.shard(rank, num_trainers)
            optimizer.zero_grad()
            reference.lm_loss(local(shard.inputs), shard.targets).backward()
            average_gradients(local, group=groups.trainers)
            optimizer.step()
        calls = []
        transfer(calls)  # the trainers' new weights reach the inference ranks
        tokens, logits = greedy_generate(local, prompt, new_tokens)
        steps.append({"tokens": tokens, "logits": logits})
    return {"trainer": trainer, "steps": steps, "parameters": reference.parameters(local),
            "calls": calls}


def delivered_weights_worker(rank, world_size, num_trainers, model, bucket_bytes):
    """Each variant in turn moves trainer `model`'s weights to inference ranks that start from
    NaN. Returns {variant: {"parameters": what this rank holds after, "calls": its calls}}."""
    groups = make_weight_groups(num_trainers, world_size)
    delivered = {}
    for variant in VARIANTS:
        local = copy.deepcopy(model) if groups.is_trainer(rank) else _stale(model)
        calls = []
        WeightTransfer(list(local.parameters()), groups, variant, bucket_bytes)(calls)
        delivered[variant] = {"parameters": reference.parameters(local), "calls": calls}
    return delivered


def _timed(transfer) -> float:
    """One transfer after a barrier; its seconds on the slowest rank."""
    dist.barrier()
    started = time.perf_counter()
    transfer()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def transfer_times_worker(rank, world_size, num_trainers, widths, layers=4, bucket_bytes=2**20,
                          repeats=5):
    """For TinyLMs of each width (`layers` blocks, built on every rank: no model travels), the
    median seconds of `repeats` transfers by each variant, after one to warm up, the variants
    taking turns. Returns per width {"width", "parameters" (count), "tensors", "seconds":
    {variant: s}, "calls": {variant: this rank's calls in one transfer}}."""
    groups = make_weight_groups(num_trainers, world_size)
    sweep = []
    for width in widths:
        model = reference.make_lm(dim=width, layers=layers)
        params = list(model.parameters())
        transfers = {variant: WeightTransfer(params, groups, variant, bucket_bytes)
                     for variant in VARIANTS}
        times = {variant: [] for variant in VARIANTS}
        for _ in range(repeats + 1):
            for variant in VARIANTS:
                times[variant].append(_timed(transfers[variant]))
        calls = {variant: [] for variant in VARIANTS}
        for variant in VARIANTS:
            transfers[variant](calls[variant])
        sweep.append({"width": width, "parameters": sum(param.numel() for param in params),
                      "tensors": len(params),
                      "seconds": {variant: statistics.median(values[1:])
                                  for variant, values in times.items()},
                      "calls": calls})
    return sweep


# --- ring attention -----------------------------------------------------------------------------


def ring_attention_worker(rank, world_size, seed, shape, layout, dtype=torch.float64):
    """Ring attention (helpers.composing.ring_attention) on seeded inputs: every rank draws the
    whole sequence's q, k, v, `shape` = (batch, heads, seq_len, head_dim), from `seed` (nothing
    large travels to the ranks), keeps its own positions under `layout`, and runs the ring.
    Returns its RingAttentionResult: its block of the output and of the log-sum-exp, the
    visible (query, key) pairs it computed, and its compute seconds."""
    q, k, v = (ring.local_block(x, rank, world_size, layout)
               for x in ring.attention_inputs(seed, *shape, dtype=dtype))
    dist.barrier()  # every rank starts the ring together: the seconds are its compute's
    return ring.ring_attention(q, k, v, layout)


def ring_attention_backward_worker(rank, world_size, seed, shape, layout, dtype=torch.float64):
    """Ring attention's forward, then its backward (ring_attention_backward) for a seeded
    gradient of the whole sequence's output, of which each rank keeps its positions. Returns
    this rank's gradients of its q, k and v, {"q": ..., "k": ..., "v": ...}."""
    q, k, v, grad_output = (
        ring.local_block(x, rank, world_size, layout)
        for x in (*ring.attention_inputs(seed, *shape, dtype=dtype),
                  ring.output_gradient(seed, *shape, dtype=dtype)))
    result = ring.ring_attention(q, k, v, layout)
    grads = ring.ring_attention_backward(q, k, v, result.output, result.logsumexp, grad_output,
                                         layout)
    return dict(zip("qkv", grads))
