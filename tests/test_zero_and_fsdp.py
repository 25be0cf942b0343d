"""Lesson 07 (helpers.zero_and_fsdp): every ZeRO stage trains like single-process AdamW
(helpers.reference.train) and like PyTorch's own; mixed precision against one process doing the
same casts; the bytes each rank holds and sends against the formulas; the exercises."""

import copy
import math

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.distributed as dist
from checker import expect_rejection
from compare import labelled
from torch import nn

from helpers import WorkerError, reference, run, strategies
from helpers.instrument import Observer
from helpers.zero_and_fsdp import fsdp, memory, plots, sharding, widgets, workers
from helpers.zero_and_fsdp.bucketed_optimizer import BucketedShardedOptimizer
from helpers.zero_and_fsdp.sharded_optimizer import ShardedOptimizer

# Results that are numbers are marked numerical: `make test` runs them again on other CPU kernels
# (Makefile). Exact counts of bytes and calls, formulas and pictures need no second run.


def lm_and_batches(tie_weights=True):
    return (reference.make_lm(tie_weights=tie_weights, seed=0),
            reference.lm_data(seed=1, batch_size=8, steps=5))


def float64_lm_and_batches():
    """The same, in float64: whole AdamW runs are compared there, where AdamW cannot amplify
    rounding into a visible difference (helpers.tolerance), with assert_close's float64
    default."""
    return reference.in_float64(*lm_and_batches())


# float64: runs once (Makefile)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_trains_like_one_process(stage, world_size):
    """A TinyLM with tied embeddings, LayerNorms and biases; 5 AdamW steps."""
    model, batches = float64_lm_and_batches()
    single = reference.train(model, batches, reference.lm_loss, optimizer="adamw", lr=1e-2)
    out = run(workers.training_worker, world_size, args=(stage, model, batches),
              show_output=False)
    for parameters in out:
        assert list(parameters) == list(single.parameters)  # the names, the tie once
        for name, param in single.parameters.items():
            torch.testing.assert_close(parameters[name], param, msg=labelled(name))


# float64: runs once (Makefile)
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_3_with_whole_blocks_as_units_trains_like_one_process(world_size):
    """Each block one piece, gathered once per forward and once per backward, its forward
    computed again in the backward."""
    model, batches = float64_lm_and_batches()
    single = reference.train(model, batches, reference.lm_loss, optimizer="adamw", lr=1e-2)
    out = run(workers.training_worker, world_size,
              args=(3, model, batches), kwargs={"unit": "block"}, show_output=False)
    for parameters in out:
        assert list(parameters) == list(single.parameters)
        for name, param in single.parameters.items():
            torch.testing.assert_close(parameters[name], param, msg=labelled(name))


def block_units_worker(rank, world_size):
    """Bytes sent and gathered for one step of a TinyLM whose blocks are units."""
    model = reference.make_lm(seed=0)
    wrapped = fsdp.FSDP(model, units=model.blocks)
    batch = reference.lm_data(seed=1, batch_size=8)[0].shard(rank, world_size)
    with Observer() as observed:
        reference.lm_loss(wrapped(batch.inputs), batch.targets).backward()
    return observed.calls(), wrapped.gathered.peak


def test_a_block_unit_costs_one_all_gather_each_way_and_one_reduce_scatter():
    calls, peak = run(block_units_worker, 2, show_output=False)[0]
    model = reference.make_lm(seed=0)
    blocks, layers_outside = len(model.blocks), 3  # two embeddings and the head
    # forward: a gather per block and per layer outside; backward: again, but the embeddings'
    assert calls["all_gather_single"] == 2 * blocks + layers_outside + (layers_outside - 2)
    assert calls["reduce_scatter_single"] == blocks + layers_outside
    block_bytes = 4 * sum(param.numel() for param in model.blocks[0].parameters())
    assert peak == block_bytes  # one block's weights at a time


# float64: runs once (Makefile)
@pytest.mark.parametrize("kind", workers.TORCH_KINDS)
def test_pytorch_zero_trains_like_one_process(kind):
    model, batches = float64_lm_and_batches()
    single = reference.train(model, batches, reference.lm_loss, optimizer="adamw", lr=1e-2)
    out = run(workers.torch_training_worker, 2, args=(kind, model, batches), show_output=False)
    for parameters in out:
        for name, param in single.parameters.items():
            torch.testing.assert_close(parameters[name], param, msg=labelled(name))


@pytest.mark.numerical
@pytest.mark.parametrize("gradient_sharding", [False, True])
def test_the_sharded_optimizer_keeps_param_groups_and_leaves_frozen_weights(gradient_sharding):
    out = run(workers.param_groups_worker, 3, args=(gradient_sharding,), show_output=False)
    for result in out:
        assert result["frozen unchanged"]
        for name, param in result["alone"].items():
            torch.testing.assert_close(result["sharded"][name], param, msg=labelled(name))


@pytest.mark.numerical
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fsdp_in_low_precision_equals_one_process_doing_the_same_casts(dtype):
    model, batches = lm_and_batches()
    same_casts = reference.train(reference.with_compute_dtype(model, dtype), batches,
                                 reference.lm_loss, slices=2).parameters
    float32 = reference.train(model, batches, reference.lm_loss, optimizer="adamw", lr=1e-2)
    out = run(workers.training_worker, 2, show_output=False, kwargs=dict(
        stage=3, model=model, batches=batches, loss="lm", compute_dtype=dtype))
    # 1e-3, a tenth of one AdamW step (lr 1e-2): both sides cast the same values, but add their
    # float32 sums in other orders, and a value that crosses a bfloat16 rounding boundary moves
    # by a whole bfloat16 step (2**-8 of its size), which AdamW turns into a changed step near a
    # zero gradient. A wrong algorithm moves weights by whole steps (see the last assertion).
    for parameters in out:
        for name, param in same_casts.items():
            torch.testing.assert_close(parameters[name], param, atol=1e-3, rtol=0,
                                       msg=labelled(name))
            assert parameters[name].dtype == torch.float32  # the master weights stay float32
    # and the casts matter: float32 training ends elsewhere, by far more than that tolerance
    assert max((float32.parameters[name] - param).abs().max().item()
               for name, param in same_casts.items()) > 1e-2


@pytest.mark.numerical
@pytest.mark.parametrize("numel, world_size", [(10, 4), (7, 3), (1, 4), (12, 4), (5, 5)])
def test_pieces_cover_the_tensor_and_the_collectives_move_them(numel, world_size):
    full = reference.seeded_randn(numel, numel)
    pieces = [sharding.shard_of(full, rank, world_size) for rank in range(world_size)]
    assert {piece.numel() for piece in pieces} == {math.ceil(numel / world_size)}
    torch.testing.assert_close(torch.cat(pieces)[:numel], full)
    assert not torch.cat(pieces)[numel:].any()  # the padding is zeros
    out = run(collectives_worker, world_size, args=(full,), show_output=False)
    mean = sum(full * (rank + 1) for rank in range(world_size)) / world_size
    for rank, (gathered, scattered) in enumerate(out):
        torch.testing.assert_close(gathered, full)
        torch.testing.assert_close(scattered, sharding.shard_of(mean, rank, world_size))


def collectives_worker(rank, world_size, full):
    gathered = sharding.gather(sharding.shard_of(full, rank, world_size), full.shape)
    return gathered, sharding.scatter_mean(full * (rank + 1))


MLP_DIM, MLP_LAYERS = 64, 4  # 4 x (64 x 64 + 64) = 16,640 parameters, every one divisible by 4


def mlp():
    return reference.make_mlp(dim=MLP_DIM, num_layers=MLP_LAYERS, seed=0, bias=True)


def mlp_batches():
    return reference.mlp_data(seed=1, batch_size=8, dim=MLP_DIM, steps=2)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_held_bytes_equal_the_formula(world_size):
    model = mlp()
    parameters = sum(param.numel() for param in model.parameters())
    for stage in workers.STAGES:
        # AdamW keeps a 4-byte step count per tensor it updates: each weight and each bias, or,
        # in ZeRO-3, each layer's one piece
        tensors = MLP_LAYERS if stage == 3 else 2 * MLP_LAYERS
        held = run(workers.memory_worker, world_size, args=(stage, model, mlp_batches()),
                   show_output=False, kwargs={"loss": "mse"})[0]["held"]
        formula = memory.bytes_per_rank(parameters, world_size, stage)
        assert held["weights"] == formula["weights"]
        assert held["gradients"] == formula["gradients"]
        assert held["optimizer"] == formula["optimizer"] + 4 * tensors


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_sent_per_step_are_dp_s_and_one_and_a_half_times_that_for_zero_3(world_size):
    model = mlp()
    weight_bytes = 4 * sum(param.numel() for param in model.parameters())
    share = (world_size - 1) / world_size * weight_bytes  # one ring pass over the weights
    sent = {stage: run(workers.memory_worker, world_size, args=(stage, model, mlp_batches()),
                       kwargs={"loss": "mse"}, show_output=False)[0]
            for stage in workers.STAGES}
    assert sent[0]["sent"]["all_reduce"] == pytest.approx(2 * share)
    for stage in (1, 2):
        assert sent[stage]["sent"]["reduce_scatter_single"] == pytest.approx(share)
        assert sent[stage]["sent"]["all_gather_single"] == pytest.approx(share)
        assert "all_reduce" not in sent[stage]["sent"]
    assert sent[3]["sent"]["all_gather_single"] == pytest.approx(2 * share)
    assert sent[3]["sent"]["reduce_scatter_single"] == pytest.approx(share)
    total = {stage: sum(result["sent"].values()) for stage, result in sent.items()}
    assert total[3] == pytest.approx(1.5 * total[0])
    # one layer gathered at a time: the peak is the largest layer, weight and bias
    assert sent[3]["gathered peak"] == 4 * (MLP_DIM * MLP_DIM + MLP_DIM)


def test_the_formulas_give_the_zero_papers_example():
    """Psi = 7.5e9, n = 64, K = 12 (ZeRO, Figure 1): (2 + 2 + K) Psi, then each part over n."""
    psi, n = 7.5e9, 64
    totals = [memory.bytes_per_rank(psi, n, stage, "mixed")["total"] for stage in range(4)]
    assert totals == pytest.approx([16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n,
                                    16 * psi / n])
    assert totals == pytest.approx([120e9, 31.40625e9, 16.640625e9, 1.875e9])
    assert memory.largest_model(80e9, 1, 0, "float32") == pytest.approx(5e9)
    with pytest.raises(ValueError, match="stage"):
        memory.bytes_per_rank(1, 2, 4)


def test_hand_built_and_torch_fsdp_hold_the_same_bytes_give_or_take_the_final_norm():
    model, batches = lm_and_batches(tie_weights=False)
    out = run(strategies.step_times_worker, 2, show_output=False, kwargs=dict(
        contenders=workers.ZERO_3, model=model, batch=batches[0], iterations=1))[0]
    assert set(out["seconds"]) == set(workers.ZERO_3)
    final_norm = sum(param.numel() for param in model.norm.parameters())
    hand, fully = out["held"]["hand_built_per_block"], out["held"]["fully_shard_per_block"]
    # fully_shard shards the final LayerNorm with the root; the hand-built FSDP keeps it whole
    assert hand["weights"] - fully["weights"] == 4 * final_norm // 2
    assert hand["gradients"] - fully["gradients"] == 4 * final_norm // 2


def test_the_pictures_and_the_calculator_draw():
    measured = {2: {stage: {"weights": 100, "gradients": 100, "optimizer": 200}
                    for stage in range(4)}}
    figures = [plots.plot_memory(measured, 25), plots.key_figure(),
               plots.plot_bytes_per_parameter(),
               plots.plot_communication({0: {"all_reduce": 10.0}}, 2, 10)]
    assert all(fig.axes for fig in figures)
    calculator = widgets.memory_calculator()
    assert [child.description for child in calculator.children[:4]] == [
        "B params", "ranks", "precision", "GB each"]


# Typical wrong answers to the exercises, and what the checker says.


def bytes_without_padding(sizes, world_size, stage):  # numel / n, not ceil(numel / n)
    def elements(sharded):
        return sum(numel / world_size if sharded else numel for numel in sizes)

    return {"weights": 2 * elements(stage >= 3), "gradients": 2 * elements(stage >= 2),
            "optimizer": 12 * elements(stage >= 1)}


def bytes_without_sharding_gradients(sizes, world_size, stage):
    def elements(sharded):
        return sum(math.ceil(numel / world_size) if sharded else numel for numel in sizes)

    return {"weights": 2 * elements(stage >= 3), "gradients": 2 * elements(stage >= 3),
            "optimizer": 12 * elements(stage >= 1)}


def gather_with_all_gather_list(rank, world_size, piece, shapes):
    pieces = [torch.empty_like(piece) for _ in range(world_size)]
    dist.all_gather(pieces, piece)
    whole = torch.cat(pieces)
    sizes = [math.prod(shape) for shape in shapes]
    return [p.view(shape) for p, shape in zip(whole[:sum(sizes)].split(sizes), shapes)]


def gather_one_tensor_at_a_time(rank, world_size, piece, shapes):  # a call per tensor
    whole = piece.new_empty(piece.numel() * world_size)
    dist.all_gather_single(whole, piece)
    sizes = [math.prod(shape) for shape in shapes]
    result = [p.view(shape) for p, shape in zip(whole[:sum(sizes)].split(sizes), shapes)]
    for _ in shapes[1:]:
        dist.all_gather_single(whole, piece)
    return result


def gather_without_cutting_the_padding(rank, world_size, piece, shapes):
    whole = piece.new_empty(piece.numel() * world_size)
    dist.all_gather_single(whole, piece)
    return [whole]


def step_with_all_reduce(rank, world_size, params, grads, lr):  # right values, DP's way
    updated = []
    for param, grad in zip(params, grads):
        dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        updated.append(param - lr * grad)
    return updated


def step_without_padding(rank, world_size, params, grads, lr):
    updated = []
    for param, grad in zip(params, grads):
        size = param.numel() // world_size  # drops the remainder
        piece = torch.empty(size)
        dist.reduce_scatter_single(piece, grad.flatten()[:size * world_size],
                                   op=dist.ReduceOp.AVG)
        mine = param.flatten()[rank * size:(rank + 1) * size] - lr * piece
        whole = torch.empty(size * world_size)
        dist.all_gather_single(whole, mine)
        updated.append(whole)
    return updated


def _gather_weight(piece, shape, world_size):
    whole = piece.new_empty(piece.numel() * world_size)
    dist.all_gather_single(whole, piece)
    return whole[:math.prod(shape)].view(shape)


def _scatter(full, world_size, op=dist.ReduceOp.AVG):
    size = math.ceil(full.numel() / world_size)
    flat = torch.cat([full.flatten(), full.new_zeros(size * world_size - full.numel())])
    piece = full.new_empty(size)
    dist.reduce_scatter_single(piece, flat, op=op)
    return piece


def linear_keeping_the_weight(rank, world_size, piece, shape, x, grad_output):
    weight = _gather_weight(piece, shape, world_size)  # kept for the backward: not ZeRO-3
    return x @ weight.T, grad_output @ weight, _scatter(grad_output.T @ x, world_size)


def linear_summing_the_gradient(rank, world_size, piece, shape, x, grad_output):
    weight = _gather_weight(piece, shape, world_size)
    y = x @ weight.T
    weight = _gather_weight(piece, shape, world_size)
    return y, grad_output @ weight, _scatter(grad_output.T @ x, world_size, dist.ReduceOp.SUM)


def linear_with_the_transposed_gradient(rank, world_size, piece, shape, x, grad_output):
    weight = _gather_weight(piece, shape, world_size)
    y = x @ weight.T
    weight = _gather_weight(piece, shape, world_size)
    return y, grad_output @ weight, _scatter(x.T @ grad_output, world_size)  # (in, out)


@pytest.mark.parametrize("name, mistake, says", [
    ("zero_bytes_per_rank", bytes_without_padding,
     "For the input sizes=[1000, 10], world_size=4, stage=1: 'optimizer': expected 3036, got "
     "3030.0"),
    ("zero_bytes_per_rank", bytes_without_sharding_gradients,
     "For the input sizes=[1000, 10], world_size=4, stage=2"),
    ("gather_layer", gather_with_all_gather_list,
     "broke a rule: the task says: use one all_gather_single. Your code called "
     "dist.all_gather()."),
    ("gather_layer", gather_one_tensor_at_a_time,
     "one all_gather_single of the layer's padded size: rank 0's all_gather_single calls held "
     "[20, 20] elements (2 calls), where the task's rule gives [20] (1 call)."),
    ("gather_layer", gather_without_cutting_the_padding, "On 2 ranks, rank 0:"),
    ("sharded_sgd_step", step_with_all_reduce, "Your code called dist.all_reduce()."),
    ("sharded_sgd_step", step_without_padding,
     "one reduce_scatter_single per parameter, into a piece of ceil(numel / n) elements: rank 0's "
     "reduce_scatter_single calls held [7, 3, 8, 0] elements (4 calls), where the task's rule "
     "gives [8, 4, 8, 1] (4 calls)."),
    ("zero3_linear", linear_keeping_the_weight,
     "gather the weight twice, for the forward and again for the backward: rank 0's "
     "all_gather_single calls held [16] elements (1 call), where the task's rule gives [16, 16] "
     "(2 calls)."),
    ("zero3_linear", linear_summing_the_gradient, "your piece of the weight's gradient"),
    ("zero3_linear", linear_with_the_transposed_gradient, "On 2 ranks, rank 0:"),
])
def test_checker_rejects_a_typical_mistake(name, mistake, says):
    expect_rejection(name, mistake, says)


@pytest.mark.numerical
@pytest.mark.parametrize("stage, bucket_mb", [(0, None), (1, None), (2, None), (3, None),
                                               (1, 0.01), (2, 0.01)])
def test_gradient_clipping_by_the_global_norm_matches_one_process(stage, bucket_mb):
    model, batches = float64_lm_and_batches()
    single = reference.train(model, batches, reference.lm_loss, optimizer="adamw", lr=1e-2,
                             max_grad_norm=0.3)
    unclipped = reference.train(model, batches, reference.lm_loss, optimizer="adamw", lr=1e-2)
    out = run(workers.training_worker, 2, args=(stage, model, batches),
              kwargs={"max_grad_norm": 0.3, "bucket_mb": bucket_mb}, show_output=False)
    for name, param in single.parameters.items():
        torch.testing.assert_close(out[0][name], param, msg=labelled(name))
    assert any(not torch.allclose(unclipped.parameters[name], param)
               for name, param in single.parameters.items())  # the clipping did something


def resume_worker(rank, world_size, gradient_sharding, directory, bucket_mb):
    """3 steps, save this rank's optimizer state and the weights, build everything again,
    load, 2 more steps; against 5 steps without a break."""
    import os

    model, batches = lm_and_batches()

    def steps(model, optimizer, batches):
        for batch in batches:
            local = batch.shard(rank, world_size)
            optimizer.zero_grad()
            reference.lm_loss(model(local.inputs), local.targets).backward()
            optimizer.step()

    def fresh(model):
        adamw, settings = reference.OPTIMIZERS["adamw"]
        if bucket_mb is None:
            return ShardedOptimizer(model.parameters(), adamw, gradient_sharding=gradient_sharding,
                                    lr=reference.LR, **settings)
        return BucketedShardedOptimizer(model.parameters(), adamw,
                                        gradient_sharding=gradient_sharding,
                                        bucket_mb=bucket_mb, lr=reference.LR, **settings)

    straight = copy.deepcopy(model)
    steps(straight, fresh(straight), batches)
    first = copy.deepcopy(model)
    optimizer = fresh(first)
    steps(first, optimizer, batches[:3])
    path = os.path.join(directory, f"optimizer_rank{rank}.pt")
    torch.save(optimizer.state_dict(), path)
    resumed = copy.deepcopy(model)
    resumed.load_state_dict(first.state_dict())
    optimizer = fresh(resumed)
    optimizer.load_state_dict(torch.load(path, weights_only=True))
    steps(resumed, optimizer, batches[3:])
    return reference.parameters(straight), reference.parameters(resumed)


@pytest.mark.numerical
@pytest.mark.parametrize("bucket_mb", [None, 0.01])
@pytest.mark.parametrize("gradient_sharding", [False, True])
def test_a_sharded_optimizer_saves_and_resumes_its_pieces_state(gradient_sharding, bucket_mb,
                                                                 tmp_path):
    out = run(resume_worker, 2, show_output=False, kwargs=dict(
        gradient_sharding=gradient_sharding, directory=str(tmp_path), bucket_mb=bucket_mb))
    for straight, resumed in out:
        for name, param in straight.items():
            torch.testing.assert_close(resumed[name], param, msg=labelled(name))


def different_seeds_worker(rank, world_size):
    model = reference.make_mlp(dim=8, num_layers=2, seed=rank)  # every rank its own weights
    ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    return reference.parameters(model)


@pytest.mark.numerical
def test_the_sharded_optimizer_starts_every_rank_from_rank_0s_weights():
    out = run(different_seeds_worker, 3, show_output=False)
    rank_0 = reference.parameters(reference.make_mlp(dim=8, num_layers=2, seed=0))
    for parameters in out:
        for name, param in rank_0.items():
            torch.testing.assert_close(parameters[name], param)


def dropout_unit_worker(rank, world_size, units):
    """One SGD step of a block with dropout; the block a unit (recomputed in backward) or not."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8))
    model = nn.Sequential(block)
    wrapped = fsdp.FSDP(model, units=[block] if units else None)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    torch.manual_seed(10 + rank)  # the masks: each rank its own
    x = torch.randn(4, 8)
    wrapped(x).square().mean().backward()
    optimizer.step()
    return wrapped.gather_full_params()


@pytest.mark.numerical
def test_recomputing_a_unit_draws_the_same_dropout_masks():
    recomputed = run(dropout_unit_worker, 2, args=(True,), show_output=False)[0]
    layered = run(dropout_unit_worker, 2, args=(False,), show_output=False)[0]
    for name, param in layered.items():
        torch.testing.assert_close(recomputed[name], param, msg=labelled(name))


def refusing_worker(rank, world_size, case):
    if case == "tied across different layers":
        model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6))  # the Linear has a bias
        model[1].weight = model[0].weight
    else:
        model = nn.Sequential(nn.Embedding(6, 4, sparse=True))
    fsdp.FSDP(model)


@pytest.mark.parametrize("case, says", [
    ("tied across different layers", "tied weight only between layers that hold exactly"),
    ("sparse embedding", "plain embeddings only"),
])
def test_fsdp_refuses_what_it_would_shard_wrongly(case, says):
    with pytest.raises(WorkerError, match=says):
        run(refusing_worker, 2, args=(case,), show_output=False)


@pytest.mark.numerical
def test_gather_full_params_gives_the_unsharded_state_dict():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    names = run(full_state_worker, 2, args=(model,), show_output=False)[0]
    assert names == list(model.state_dict())  # parameters and buffers, in order


def full_state_worker(rank, world_size, model):
    return list(fsdp.FSDP(copy.deepcopy(model)).gather_full_params())


@pytest.mark.numerical
def test_the_fully_shard_recipe_trains_like_one_process():
    """Meta-device build, rank 0's weights broadcast into the pieces, clipping, full state dict
    back on rank 0."""
    kwargs = {"vocab": 64, "dim": 32, "heads": 4, "layers": 2, "max_seq_len": 16}
    model, batches = reference.in_float64(reference.make_lm(seed=0, **kwargs),
                                          reference.lm_data(seed=1, steps=5))
    single = reference.train(model, batches, reference.lm_loss, optimizer="adamw", lr=1e-2,
                             max_grad_norm=0.5)
    out = run(workers.fully_shard_recipe_worker, 2,
              args=(kwargs, model.state_dict(), batches),
              kwargs={"max_grad_norm": 0.5, "dtype": torch.float64}, show_output=False)
    assert out[1] is None
    assert list(out[0]) == list(model.state_dict())
    for name, param in single.parameters.items():
        torch.testing.assert_close(out[0][name], param, msg=labelled(name))


def test_stage_1_and_2_times_and_bytes_against_zero_redundancy_optimizer():
    model, batches = lm_and_batches(tie_weights=False)
    out = run(strategies.step_times_worker, 2, show_output=False, kwargs=dict(
        contenders=workers.stage_1_2_contenders(bucket_mb=1.0), model=model, batch=batches[0],
        iterations=1))[0]
    assert set(out["seconds"]) == set(workers.STAGE_1_2)
    held = out["held"]
    parameters = sum(param.numel() for param in model.parameters())
    readable = held["readable_zero_1"]
    assert readable["weights"] == readable["gradients"] == 4 * parameters  # whole, every rank
    assert readable["optimizer"] == 8 * parameters // 2 + 4 * len(list(model.parameters()))
    # bucketed, in buckets of 1 MiB (the whole model: one bucket, padded to an even size):
    # Adam's two moments of this rank's half, and one step count
    assert held["bucketed_zero_1"]["optimizer"] == 8 * math.ceil(parameters / 2) + 4
    assert held["bucketed_zero_2"]["gradients"] == 4 * math.ceil(parameters / 2)
    # ZeroRedundancyOptimizer gives each rank whole parameters: about half the state, not half
    # of every tensor; both hold the whole weights and gradients
    torch_zero = held["zero_redundancy_optimizer"]
    assert torch_zero["weights"] == 4 * parameters
    assert 0 < torch_zero["optimizer"] < 8 * parameters


def clip_each_rank_by_its_own_norm(rank, world_size, pieces, max_norm):
    norm = torch.stack([piece.square().sum() for piece in pieces]).sum().sqrt()
    return [piece * torch.clamp(max_norm / (norm + 1e-6), max=1.0) for piece in pieces]


def clip_by_the_sum_of_the_ranks_norms(rank, world_size, pieces, max_norm):
    norm = torch.stack([piece.square().sum() for piece in pieces]).sum().sqrt().reshape(1)
    dist.all_reduce(norm)  # norms do not add: their squares do
    return [piece * torch.clamp(max_norm / (norm + 1e-6), max=1.0) for piece in pieces]


@pytest.mark.parametrize("mistake, says", [
    (clip_each_rank_by_its_own_norm, "one all_reduce of a single number: rank 0's all_reduce "
                                     "calls held [] elements (0 calls)"),
    (clip_by_the_sum_of_the_ranks_norms, "times the expected one"),
])
def test_clip_sharded_gradients_checker_rejects_a_typical_mistake(mistake, says):
    expect_rejection("clip_sharded_gradients", mistake, says)
