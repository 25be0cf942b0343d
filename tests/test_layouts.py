"""The course's layout (helpers.layouts): the mesh of a Plan, its dimensions and groups as
torchtitan's build_mesh lays them out, and a TinyLM laid out by any tensor-parallel degree
training as one process does. (A Llama laid out by lay_out: tests/test_at_scale.py.)"""

import copy

import pytest
import torch.distributed as dist
from torch.testing import assert_close

from helpers import reference, run, strategies
from helpers.layouts import Plan, make_mesh

# (plan, the mesh's dimension names, rank 0's group in each) on 4 ranks, written out by hand:
# outermost first, so the ranks of one tensor-parallel group are neighbours.
MESHES = [
    (Plan(dp=4), ("dp",), {"dp": [0, 1, 2, 3]}),
    (Plan(dp=2, tp=2), ("dp", "tp"), {"dp": [0, 2], "tp": [0, 1]}),
    (Plan(dp=1, tp=4), ("dp", "tp"), {"dp": [0], "tp": [0, 1, 2, 3]}),
    (Plan(dp=2, replicate=2), ("replicate", "dp"), {"replicate": [0, 2], "dp": [0, 1]}),
    (Plan(dp=1, tp=2, replicate=2), ("replicate", "dp", "tp"),
     {"replicate": [0, 2], "dp": [0], "tp": [0, 1]}),
]


def mesh_worker(rank, world_size, plan):
    mesh = make_mesh(plan)
    return mesh.mesh_dim_names, {name: dist.get_process_group_ranks(mesh.get_group(name))
                                 for name in mesh.mesh_dim_names}


@pytest.mark.parametrize("plan, names, groups", MESHES, ids=[str(plan) for plan, *_ in MESHES])
def test_a_plans_mesh_names_each_degree_above_one_and_keeps_tensor_parallel_ranks_together(
        plan, names, groups):
    out = run(mesh_worker, 4, args=(plan,), show_output=False)
    assert out[0] == (names, groups)


def dp_tp_worker(rank, world_size, model, batches, plan):
    module, optimizer = strategies.build("dp_tp", copy.deepcopy(model), plan=plan)
    mesh = strategies.default_mesh("dp_tp", plan)
    shard, shards = strategies.batch_shard(mesh)
    for batch in batches:
        local = batch.shard(shard, shards)
        optimizer.zero_grad()
        reference.lm_loss(module(local.inputs), local.targets).backward()
        optimizer.step()
    return strategies.full_parameters(module)


@pytest.mark.parametrize("plan", [Plan(dp=1, tp=4), Plan(dp=2, tp=2, recompute="full")],
                         ids=str)
def test_a_tinylm_laid_out_by_any_tensor_parallel_degree_trains_as_one_process(plan):
    """float64, where AdamW cannot amplify rounding into a visible difference
    (helpers.tolerance): assert_close's float64 default holds."""
    model, batches = reference.in_float64(reference.make_lm(seed=0),
                                          reference.lm_data(seed=1, batch_size=8, steps=3))
    out = run(dp_tp_worker, 4, args=(model, batches, plan), show_output=False)
    alone = reference.train(model, batches, reference.lm_loss, optimizer="adamw").parameters
    for rank in range(4):
        assert_close(out[rank], alone)


def test_a_plan_lays_out_dp_tp_alone_and_says_recomputation_once():
    model = reference.make_lm(seed=0)
    with pytest.raises(ValueError, match="a plan lays out dp_tp, not 'zero_1'"):
        strategies.build("zero_1", model, plan=Plan(dp=2))
    with pytest.raises(ValueError, match="recompute='selective' and a plan that says 'full'"):
        strategies.plan_for("dp_tp", Plan(dp=1, tp=2, recompute="full"), "selective")
