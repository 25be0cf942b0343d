"""helpers.strategies: every strategy built by name and trained the same way, and the
hand-built ones' state saved with torch.distributed.checkpoint on 4 ranks, loaded on 2, equal to
one process."""

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from compare import labelled

from helpers import reference, run, strategies

pytestmark = pytest.mark.numerical  # trained parameters: run again on other CPU kernels

# The hand-built strategies, with the options that change their layout
HAND_BUILT = {
    "naive": ("naive", {}),
    "ddp": ("ddp", {"bucket_mb": 0.01}),
    "readable_zero_1": ("zero_1", {}),
    "bucketed_zero_1": ("zero_1", {"bucket_mb": 0.01}),
    "readable_zero_2": ("zero_2", {}),
    "bucketed_zero_2": ("zero_2", {"bucket_mb": 0.01}),
    "zero_3_per_layer": ("zero_3", {"unit": "layer"}),
    "zero_3_per_block": ("zero_3", {"unit": "block"}),
}


def lm_and_batches():
    """float64, where AdamW cannot amplify rounding into a visible difference
    (helpers.tolerance): assert_close's float64 default holds."""
    return reference.in_float64(reference.make_lm(tie_weights=True, seed=0),
                                reference.lm_data(seed=1, batch_size=12, steps=4))


def train(module, optimizer, batches, rank, world_size, loss=reference.lm_loss):
    for batch in batches:
        local = batch.shard(rank, world_size)
        optimizer.zero_grad()
        loss(module(local.inputs), local.targets).backward()
        optimizer.step()


def save_worker(rank, world_size, name, options, model, batches, directory,
                loss=reference.lm_loss):
    module, optimizer = strategies.build(name, copy.deepcopy(model), **options)
    train(module, optimizer, batches, rank, world_size, loss)
    dcp.save(strategies.state_dict(module, optimizer), checkpoint_id=directory)


def resume_worker(rank, world_size, name, options, model, batches, directory,
                  loss=reference.lm_loss):
    module, optimizer = strategies.build(name, copy.deepcopy(model), **options)
    strategies.load(module, optimizer, directory)
    loaded = strategies.full_parameters(module)
    train(module, optimizer, batches, rank, world_size, loss)
    return {"loaded": loaded, "trained": strategies.full_parameters(module)}


@pytest.mark.parametrize("key", ["readable_zero_1", "readable_zero_2"])
def test_pieces_that_hold_nothing_on_some_ranks_reshard_too(key, tmp_path):
    """An MLP of width 3 under the readable ZeRO, which cuts each tensor: a bias (3 elements) is
    cut into pieces of 1 on 4 ranks, so rank 3 holds none of it (an empty DTensor shard), and
    into pieces of 2 on 2 ranks, one of them half padding."""
    name, options = HAND_BUILT[key]
    model, batches = reference.in_float64(
        reference.make_mlp(dim=3, num_layers=2, seed=0, bias=True),
        reference.mlp_data(seed=1, batch_size=4, dim=3, steps=2))
    shared = dict(name=name, options=options, model=model, loss=reference.mse_loss,
                  directory=tmp_path)
    run(save_worker, 4, show_output=False, kwargs=dict(batches=batches[:1], **shared))
    out = run(resume_worker, 2, show_output=False, kwargs=dict(batches=batches[1:], **shared))
    for steps, when in ((1, "loaded"), (2, "trained")):
        alone = reference.train(model, batches[:steps], reference.mse_loss).parameters
        for name_, param in alone.items():
            torch.testing.assert_close(out[0][when][name_], param, msg=labelled(name_))


# Loading on 3 ranks cuts the pieces unevenly: some ranks hold padding, or nothing, of a tensor
RESHARDINGS = [(key, 2) for key in HAND_BUILT] + [
    (key, 3) for key in ("readable_zero_1", "bucketed_zero_2", "zero_3_per_layer")]


@pytest.mark.parametrize("key, ranks", RESHARDINGS)
def test_a_checkpoint_saved_on_4_ranks_loads_on_others_and_trains_like_one_process(
        key, ranks, tmp_path):
    """Two steps on 4 ranks, saved; loaded on 2 or 3 ranks into a model of other weights, two
    more steps: the loaded weights equal one process's after two steps, and the trained ones
    after four (so the optimizer's state was loaded too: AdamW's moments and step count)."""
    name, options = HAND_BUILT[key]
    model, batches = lm_and_batches()
    run(save_worker, 4, show_output=False, kwargs=dict(
        name=name, options=options, model=model, batches=batches[:2], directory=tmp_path))
    other, _ = reference.in_float64(reference.make_lm(tie_weights=True, seed=7), [])
    out = run(resume_worker, ranks, show_output=False, kwargs=dict(
        name=name, options=options, model=other, batches=batches[2:], directory=tmp_path))
    two = reference.train(model, batches[:2], reference.lm_loss, optimizer="adamw").parameters
    four = reference.train(model, batches, reference.lm_loss, optimizer="adamw").parameters
    for result in out:
        for name_, param in two.items():
            torch.testing.assert_close(result["loaded"][name_], param, msg=labelled(name_))
        for name_, param in four.items():
            torch.testing.assert_close(result["trained"][name_], param, msg=labelled(name_))


def test_an_unknown_strategy_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown strategy 'zero_4'; choose one of \['one_"):
        strategies.build("zero_4", torch.nn.Linear(2, 2))


# PyTorch's strategies, and activation checkpointing under the sharded ones
PYTORCH = {
    "torch_ddp": ("torch_ddp", {}, 2),
    "zero_redundancy_optimizer": ("zero_redundancy_optimizer", {}, 2),
    "fully_shard_recomputing": ("fully_shard", {"recompute": "full"}, 2),
    "dp_tp_recomputing": ("dp_tp", {"recompute": "selective"}, 4),
    "zero_2_recomputing": ("zero_2", {"recompute": "full", "bucket_mb": 0.01}, 2),
}


def training_worker(rank, world_size, name, options, model, batches):
    mesh = strategies.default_mesh(name) if name in ("fully_shard", "dp_tp") else None
    module, optimizer = strategies.build(name, copy.deepcopy(model), mesh=mesh, **options)
    train(module, optimizer, batches, *strategies.batch_shard(mesh))
    return strategies.full_parameters(module)


@pytest.mark.parametrize("key", PYTORCH)
def test_every_strategy_built_by_name_trains_like_one_process(key):
    """Recomputation changes what is kept, not what is computed: the same parameters."""
    name, options, ranks = PYTORCH[key]
    model, batches = lm_and_batches()
    out = run(training_worker, ranks, show_output=False, kwargs=dict(
        name=name, options=options, model=model, batches=batches))
    alone = reference.train(model, batches, reference.lm_loss, optimizer="adamw").parameters
    for parameters in out:
        assert list(parameters) == list(alone)
        for name_, param in alone.items():
            torch.testing.assert_close(parameters[name_], param, msg=labelled(name_))
