"""Lesson 10 (helpers.composing), its main topic: data x tensor (x pipeline) parallelism on a mesh
equal to one process and to PyTorch's fully_shard + parallelize_module; the projection of real
model sizes. The other topics have their own files: test_composing_experts, _weights and
_ring_attention."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.distributed as dist
from checker import expect_rejection
from compare import labelled
from torch import nn

from helpers import reference, run
from helpers.composing import mesh, plots, strategy, workers

# Results that are numbers: `make test` runs these again on other CPU kernels (Makefile).
pytestmark = pytest.mark.numerical

STEPS = 10


def lm_case():
    """The course's tiny LM, ten batches of 8 sequences, and one process's training on them, in
    float64: over ten AdamW steps, AdamW would amplify float32 rounding in a gradient near zero
    into a visible difference in its weight (helpers.tolerance); in float64 every comparison holds
    with assert_close's float64 default (rtol 1e-7, atol 1e-7)."""
    model, batches = reference.in_float64(reference.make_lm(),
                                          reference.lm_data(batch_size=8, steps=STEPS))
    return model, batches, reference.train(model, batches, reference.lm_loss)


def assert_same_losses(losses, single):
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(single.losses, dtype=torch.float64))


def test_mesh_grid_puts_each_rank_where_the_formula_says():
    grid = mesh.Grid(("dp", "pp", "tp"), (2, 2, 2))
    for rank in range(8):
        d, p, t = rank // 4, rank // 2 % 2, rank % 2  # r = (d * pp + p) * tp + t
        assert grid.coordinates(rank) == {"dp": d, "pp": p, "tp": t}
        assert grid.members("tp", rank) == [(d * 2 + p) * 2 + x for x in range(2)]
        assert grid.members("pp", rank) == [(d * 2 + x) * 2 + t for x in range(2)]
        assert grid.members("dp", rank) == [(x * 2 + p) * 2 + t for x in range(2)]
    with pytest.raises(ValueError, match="2 names"):
        mesh.Grid(("dp", "tp"), (2, 2, 2))


@pytest.mark.once  # float64, or exact: no rounding changes it (Makefile)
def test_mesh_groups_are_init_device_meshs():
    out = run(workers.grid_worker, 8, args=(("dp", "pp", "tp"), (2, 2, 2)), show_output=False)
    for rank, groups in enumerate(out):
        for dim, (by_hand, by_torch) in groups.items():
            assert by_hand == by_torch, (rank, dim)
    assert out[5] == {"dp": ([1, 5], [1, 5]), "pp": ([5, 7], [5, 7]), "tp": ([4, 5], [4, 5])}


@pytest.mark.once  # float64, or exact: no rounding changes it (Makefile)
def test_mesh_data_x_tensor_parallel_by_hand_trains_like_one_process():
    model, batches, single = lm_case()
    out = run(workers.dp_tp_worker, 4, args=(model, batches, 2), show_output=False)
    found = plots.placements(out.results, single.parameters)  # locates every piece, or raises
    for rank, result in enumerate(out):
        assert result["place"] == {"dp": rank // 2, "tp": rank % 2}
        assert_same_losses(result["losses"], single)
        assert found["blocks.1.attention.q.weight"][rank] == (0, rank % 2, 2)  # rows: its heads
        assert found["blocks.1.feed_forward.down.weight"][rank] == (1, rank % 2, 2)  # columns
        assert found["head.weight"][rank] == "whole"


@pytest.mark.once  # float64, or exact: no rounding changes it (Makefile)
def test_mesh_data_x_tensor_parallel_with_torch_trains_like_one_process():
    model, batches, single = lm_case()
    out = run(workers.torch_dp_tp_worker, 4, args=(model, batches, 2), show_output=False)
    for result in out:
        assert_same_losses(result["losses"], single)
        for name, param in single.parameters.items():
            torch.testing.assert_close(result["parameters"][name], param, msg=labelled(name))
    layouts = out[0]["layouts"]
    # q's rows are split over tp (its heads), then fully_shard splits each tp piece over dp
    mesh_dims, placements, local_shape = layouts["blocks.0.attention.q.weight"]
    assert mesh_dims == ("dp", "tp") and placements[1] == "Shard(dim=0)"
    assert local_shape == (32 // 2 // 2, 32)
    # the embedding is not tensor-parallel: fully_shard alone splits its rows over dp
    assert layouts["token_embedding.weight"] == (("dp",), ("Shard(dim=0)",), (64 // 2, 32))


@pytest.mark.once  # no numbers
def test_the_placement_table_gives_neighbours_placed_alike_one_row():
    rows_half, whole = (0, 0, 2), "whole"
    found = {"token_embedding.weight": [whole, "-"], "position_embedding.weight": [whole, "-"],
             "blocks.0.norm1.weight": [whole, "-"],  # placed as the embeddings, but in a block
             "blocks.0.attention.q.weight": [rows_half, "-"], "blocks.0.attention.q.bias": [1],
             "blocks.0.attention.k.weight": [rows_half, "-"],
             "blocks.0.attention.out.weight": [(1, 0, 2), "-"],
             "blocks.0.feed_forward.up.weight": [rows_half, "-"],  # placed as q, but not next
             "blocks.1.attention.q.weight": [rows_half, "-"],  # placed as up, but another block
             "norm.weight": ["-", whole], "head.weight": ["-", whole]}
    assert plots._rows(found) == [("token + position embedding", [whole, "-"]),
                                  ("block 0 norm1", [whole, "-"]),
                                  ("block 0 q, k", [rows_half, "-"]),
                                  ("block 0 out", [(1, 0, 2), "-"]),
                                  ("block 0 up", [rows_half, "-"]),
                                  ("block 1 q", [rows_half, "-"]),
                                  ("norm, head", ["-", whole])]


@pytest.mark.once  # float64, or exact: no rounding changes it (Makefile)
def test_mesh_data_x_pipeline_x_tensor_parallel_trains_like_one_process():
    model, batches, single = lm_case()
    out = run(workers.dp_tp_pp_worker, 8, args=(model, batches, (2, 2, 2)), show_output=False)
    found = plots.placements(out.results, single.parameters)
    for rank, result in enumerate(out):
        d, p, t = rank // 4, rank // 2 % 2, rank % 2
        assert result["place"] == {"dp": d, "pp": p, "tp": t}
        if p == 1:
            assert_same_losses(result["losses"], single)
        else:
            assert result["losses"] is None
    for name, holders in found.items():
        # block i lives on stage i (two blocks, two stages); embeddings first, head last
        stage = (int(name.split(".")[1]) if name.startswith("blocks")
                 else 0 if "embedding" in name else 1)
        held = [rank for rank, where in enumerate(holders) if where != "-"]
        assert held == [rank for rank in range(8) if rank // 2 % 2 == stage], name


def test_strategy_counts_parameters_as_the_layers_hold_them():
    for model in strategy.MODELS.values():
        kv = model.kv_heads * model.dim // model.heads
        with torch.device("meta"):  # shapes only: no memory
            layer = [nn.Linear(model.dim, model.dim), nn.Linear(model.dim, kv),
                     nn.Linear(model.dim, kv), nn.Linear(model.dim, model.dim),
                     nn.Linear(model.dim, model.ffn), nn.Linear(model.dim, model.ffn),
                     nn.Linear(model.ffn, model.dim), nn.RMSNorm(model.dim),
                     nn.RMSNorm(model.dim)]
            ends = [nn.Embedding(model.vocab, model.dim), nn.RMSNorm(model.dim),
                    nn.Linear(model.dim, model.vocab)]
        weights = [module.weight.numel() for module in layer]  # biases: Llama has none
        assert model.parameters() == model.layers * sum(weights) + sum(
            module.weight.numel() for module in ends)
    # the SwiGLU widths of Meta's published 8B and 70B configurations
    assert [model.ffn for model in strategy.MODELS.values()] == [14336, 28672]


def kept_per_token(model, element):
    """Bytes a Llama layer keeps per token, named one by one: the inputs of the two RMSNorms,
    their outputs (the matmuls' input), q, k, v, attention's output, SwiGLU's four tensors of
    width ffn; in float32 the log-sum-exp per head and each norm's 1/rms."""
    kv = model.kv_heads * (model.dim // model.heads)
    widths = [model.dim] * 2 + [model.dim] * 2 + [model.dim, kv, kv, model.dim] + [model.ffn] * 4
    return sum(widths) * element + 4 * model.heads + 4 * 2


def test_strategy_projects_the_formulas_of_lessons_07_to_09():
    model = strategy.MODELS["Llama 3 70B"]
    d, vocab = 8192, 128256
    # the first of 8 stages: 10 of the 80 layers and the token embedding, cut over tp 2
    per_layer = (model.parameters() - 2 * vocab * d - d) / 80
    psi = (10 * per_layer + vocab * d) / 2
    row = strategy.project(model, strategy.Layout(dp=4, tp=2, pp=8, zero=1), seq_len=4096,
                           micro_batch=1, global_batch=1024)
    assert row["weights"] == pytest.approx(2 * psi) and row["gradients"] == pytest.approx(2 * psi)
    assert row["optimizer"] == pytest.approx(12 * psi / 4)
    sbh = 4096 * 1 * d
    kept = kept_per_token(model, element=2) * 4096 / 2  # one layer, its s/t tokens
    assert row["activations"] == pytest.approx(kept * 10 * 8)  # 8 micro-batches in flight
    micro_batches = 1024 / 4
    assert row["data parallel"] == pytest.approx(2 * 3 / 4 * psi * 2)  # once per step
    # four all-reduces of s b h a layer (lesson 08) and the backward's all-gather again, half one
    assert row["tensor parallel"] == pytest.approx((4 + 1) * 2 * (1 / 2) * sbh * 2 * 10
                                                   * micro_batches)
    # a middle stage sends each micro-batch's activation on and its gradient back: s/t tokens
    assert row["pipeline"] == pytest.approx(2 * sbh / 2 * 2 * micro_batches)
    assert row["fits"] == (row["memory"] <= 80 * 2**30)
    two_stages = strategy.project(model, strategy.Layout(dp=16, tp=2, pp=2, zero=1))
    assert two_stages["pipeline"] == pytest.approx(sbh / 2 * 2 * 1024 / 16)  # one direction
    full = strategy.project(model, strategy.Layout(dp=4, tp=2, pp=8, zero=1),
                            recomputation="full")
    # each layer's input, s/t tokens of it (sequence parallelism), and one layer recomputed
    assert full["activations"] == pytest.approx(2 * sbh / 2 * 10 * 8 + kept)
    # the recomputed forward all-reduces again: seven of s b h per layer, not five
    assert full["tensor parallel"] == pytest.approx(row["tensor parallel"] * 7 / 5)
    assert full["data parallel"] == row["data parallel"]


def test_strategy_charges_sharded_gradients_and_weights_every_micro_batch():
    model = strategy.MODELS["Llama 3 8B"]
    psi, m = model.parameters(), 1024 / 8  # one stage, no tp; 128 micro-batches per step
    ring = 7 / 8 * psi * 2  # one ring pass over the 2-byte gradients (or weights)
    sent = {zero: strategy.project(model, strategy.Layout(dp=8, tp=1, pp=1, zero=zero))
            ["data parallel"] for zero in (0, 1, 2, 3)}
    assert sent[0] == pytest.approx(2 * ring) and sent[1] == pytest.approx(2 * ring)
    assert sent[2] == pytest.approx(m * ring + ring)  # reduce-scatter per micro-batch, gather
    assert sent[3] == pytest.approx(3 * m * ring)  # gather twice and reduce-scatter, each one
    for layout in strategy.layouts(model, 64):
        assert layout.gpus == 64 and model.layers % layout.pp == 0 and layout.tp <= 8
        assert layout.zero <= 1 or layout.pp == 1  # no ZeRO-2/3 under pipeline stages


def test_strategy_takes_no_recomputation_precision_and_when_gradients_sync():
    """Lesson 11's inputs: Table 2's first row, float32 states and activations, and ZeRO-2/3
    holding whole gradients until the last micro-batch (FSDP2's set_requires_gradient_sync)."""
    model = strategy.MODELS["Llama 3 70B"]
    d, a, s = 8192, 64, 4096
    sbh, layout = s * d, strategy.Layout(dp=8, tp=8, pp=1, zero=3)
    none = strategy.project(model, layout, recomputation="none")
    # every layer's tensors, s/t tokens of each, all 80 layers, one micro-batch in flight
    kept = kept_per_token(model, element=2) * s / 8
    assert none["activations"] == pytest.approx(kept * 80)
    # a flash kernel keeps nothing s x s: selective recomputation has nothing left to drop
    assert strategy.project(model, layout)["activations"] == none["activations"]
    math = strategy.project(model, layout, recomputation="none", attention="math")
    assert math["activations"] == pytest.approx((kept + a * s * 2 * s / 8) * 80)  # the softmax
    psi = model.parameters() / 8  # tp 8
    float32 = strategy.project(model, layout, recomputation="full", precision="float32")
    assert float32["weights"] == pytest.approx(4 * psi / 8)  # sharded over dp 8
    assert float32["activations"] == pytest.approx(
        4 * sbh / 8 * 80 + kept_per_token(model, element=4) * s / 8)
    m, ring = 1024 / 8, 7 / 8 * psi
    assert float32["data parallel"] == pytest.approx(3 * m * ring * 4)
    each = strategy.project(model, layout, recomputation="full")
    last = strategy.project(model, layout, recomputation="full", sync="last_micro_batch")
    assert each["gradients"] == pytest.approx(2 * psi / 8)
    assert last["gradients"] == pytest.approx(2 * psi)  # whole, until the last micro-batch
    in_float32 = strategy.project(model, layout, recomputation="full", sync="last_micro_batch",
                                  reduce_bytes=4)
    assert in_float32["gradients"] == pytest.approx(4 * psi)  # accumulated in reduce_dtype
    assert last["data parallel"] == pytest.approx(2 * m * ring * 2 + ring * 2)
    assert each["data parallel"] == pytest.approx(3 * m * ring * 2)
    zero_2 = strategy.Layout(dp=64, tp=1, pp=1, zero=2)
    assert strategy.project(model, zero_2, sync="last_micro_batch")["data parallel"] == \
        pytest.approx(2 * 63 / 64 * model.parameters() * 2)  # as ZeRO-1: once each way
    reduced_in_float32 = strategy.project(model, zero_2, reduce_bytes=4)["data parallel"]
    assert reduced_in_float32 == pytest.approx((1024 / 64 * 4 + 2) * 63 / 64 * model.parameters())
    with pytest.raises(ValueError, match="sync is one of"):
        strategy.project(model, layout, sync="never")


def test_strategy_says_what_is_short_when_nothing_fits():
    model = strategy.MODELS["Llama 3 70B"]
    text = strategy.describe(model, 8)
    least_states = 16 * model.parameters() / 8  # everything sharded over all 8 GPUs
    assert f"at least {least_states / 2**30:.0f} GiB" in text
    assert "recomputation nor a smaller micro-batch can help" in text


def test_strategy_plot_marks_what_does_not_fit():
    model = strategy.MODELS["Llama 3 70B"]
    chosen = [strategy.Layout(64, 1, 1, 3), strategy.Layout(8, 8, 1, 3)]
    fig = plots.plot_projection(model, 64, chosen)
    labels = [text.get_text() for text in fig.axes[0].texts]
    assert labels[0] == "does not fit" and labels[1].endswith("s on links")


# --- the composing exercises: typical mistakes ---------------------------------------------------


def groups_of_my_own_only(rank, world_size, sizes):  # skips the groups it is not in
    grid = torch.arange(world_size).view(*sizes)
    where = (grid == rank).nonzero()[0].tolist()
    found = []
    for axis in range(len(sizes)):
        index = [slice(None) if a == axis else where[a] for a in range(len(sizes))]
        found.append(dist.get_process_group_ranks(dist.new_group(grid[tuple(index)].tolist())))
    return found


def groups_with_the_first_dimension_fastest(rank, world_size, sizes):
    grid = torch.arange(world_size).view(*reversed(sizes)).permute(
        *reversed(range(len(sizes))))
    members = []
    for axis in range(len(sizes)):
        lines = grid.movedim(axis, -1).reshape(-1, sizes[axis]).tolist()
        mine = None
        for line in lines:
            group = dist.new_group(line)
            if rank in line:
                mine = dist.get_process_group_ranks(group)
        members.append(mine)
    return members


def _dp_tp_pieces(rank, world_size, w1, w2, x, y, tp):
    dp, (d, t) = world_size // tp, divmod(rank, tp)
    groups = {}
    for name, lines in (("tp", [[r * tp + j for j in range(tp)] for r in range(dp)]),
                        ("dp", [[r * tp + j for r in range(dp)] for j in range(tp)])):
        for line in lines:
            group = dist.new_group(line)
            if rank in line:
                groups[name] = group
    up = w1.chunk(tp)[t].clone().requires_grad_()
    down = w2.chunk(tp, dim=1)[t].clone().requires_grad_()
    return groups, up, down, x.chunk(dp)[d], y.chunk(dp)[d]


def dp_tp_step_without_the_tp_sum(rank, world_size, w1, w2, x, y, tp):
    groups, up, down, x, y = _dp_tp_pieces(rank, world_size, w1, w2, x, y, tp)
    out = torch.nn.functional.gelu(x @ up.T) @ down.T  # a share of the output, taken as all of it
    ((out - y).square().sum() / (y.numel() * (world_size // tp))).backward()
    for grad in (up.grad, down.grad):
        dist.all_reduce(grad, group=groups["dp"])
    return up.grad, down.grad


def dp_tp_step_with_local_means_summed(rank, world_size, w1, w2, x, y, tp):
    groups, up, down, x, y = _dp_tp_pieces(rank, world_size, w1, w2, x, y, tp)
    partial = torch.nn.functional.gelu(x @ up.T) @ down.T
    out = partial.detach().clone()
    dist.all_reduce(out, group=groups["tp"])
    out = partial + (out - partial).detach()  # the sum forward, this share's gradient backward
    (out - y).square().mean().backward()  # the slice's mean, then summed over dp: dp times
    for grad in (up.grad, down.grad):
        dist.all_reduce(grad, group=groups["dp"])
    return up.grad, down.grad


def dp_tp_step_with_a_differentiated_tp_sum(rank, world_size, w1, w2, x, y, tp):
    from torch.distributed.nn.functional import all_reduce

    groups, up, down, x, y = _dp_tp_pieces(rank, world_size, w1, w2, x, y, tp)
    out = all_reduce(torch.nn.functional.gelu(x @ up.T) @ down.T, group=groups["tp"])
    ((out - y).square().sum() / (y.numel() * (world_size // tp))).backward()  # sums again
    for grad in (up.grad, down.grad):
        dist.all_reduce(grad, group=groups["dp"])
    return up.grad, down.grad


def dp_tp_step_over_the_world(rank, world_size, w1, w2, x, y, tp):
    groups, up, down, x, y = _dp_tp_pieces(rank, world_size, w1, w2, x, y, tp)
    partial = torch.nn.functional.gelu(x @ up.T) @ down.T
    dist.all_reduce(partial.detach())  # over every rank: dp slices mixed in
    return up.detach(), down.detach()


@pytest.mark.parametrize("name, mistake, says", [
    ("mesh_groups", groups_of_my_own_only, "every rank must create every group"),
    ("mesh_groups", groups_with_the_first_dimension_fastest,
     "On 8 ranks, rank 0: expected [[0, 4], [0, 2], [0, 1]], got [[0, 1], [0, 2], [0, 4]]"),
    ("dp_tp_step", dp_tp_step_without_the_tp_sum, "the gradient of your W1 rows: elements 0 to "
                                                   "71 of 72 differ"),
    ("dp_tp_step", dp_tp_step_without_the_tp_sum, "Hint: which of your results is only your "
                                                   "share of a sum"),
    ("dp_tp_step", dp_tp_step_with_local_means_summed, "Your result is 3 times the expected one"),
    ("dp_tp_step", dp_tp_step_with_local_means_summed,
     "Hint: each of your gradients is dp = 3 times the whole batch's"),
    ("dp_tp_step", dp_tp_step_with_a_differentiated_tp_sum,
     "Hint: each of your gradients is tp = 2 times what it should be"),
    ("dp_tp_step", dp_tp_step_over_the_world,
     "the task says: reduce only within your dp group or your tp group"),
])
def test_composing_checkers_reject_a_typical_mistake(name, mistake, says):
    expect_rejection(name, mistake, says)


def test_strategy_sizes_what_it_leaves_out():
    model = strategy.MODELS["Llama 3 70B"]
    layer = model.parameters() - 2 * 128256 * 8192 - 8192  # all 80 layers
    parts = strategy.left_out(model, strategy.Layout(dp=8, tp=8, pp=1, zero=3), seq_len=8192,
                              micro_batch=2, reduce_bytes=4)
    logits = 8192 * 2 * 128256 / 8  # vocabulary-parallel over tp 8
    assert parts == pytest.approx({
        "logits": 2 * logits, "logits upcast to float32": 4 * logits,
        "the logits' float32 gradient": 4 * logits,
        "the current and the prefetched layer, gathered": 2 * 2 * layer / 80 / 8,
        "one layer's whole gradients": 2 * layer / 80 / 8,
        "the same in the reduce dtype (4 bytes)": 4 * layer / 80 / 8,
        "the embedding and the head, gathered": 2 * 2 * 128256 * 8192 / 8})
    # without ZeRO-3 nothing is gathered; a loss over whole logits holds the whole vocabulary
    whole = strategy.left_out(model, strategy.Layout(dp=8, tp=8, pp=1, zero=1),
                              loss_parallel=False)
    assert whole == pytest.approx({"logits": 2 * 4096 * 128256,
                                   "logits upcast to float32": 4 * 4096 * 128256,
                                   "the logits' float32 gradient": 4 * 4096 * 128256})


def test_strategy_fits_torchtitans_published_70b_run():
    """benchmarks/llama3_h100_202412_torchtitan.md, Table 4: FSDP 32 x TP 8, local batch 16,
    full activation checkpointing, 71.9 GiB on GPUs of 96 GB; sequences of 8192 tokens, the
    recipe's at the commit the benchmark names (9dec370, train_configs/llama3_70b.toml)."""
    model = strategy.MODELS["Llama 3 70B"]
    row = strategy.project(model, strategy.Layout(dp=32, tp=8, pp=1, zero=3), seq_len=8192,
                           micro_batch=16, global_batch=512, recomputation="full",
                           gpu_memory=96e9)
    assert row["micro_batches"] == 1 and row["fits"]
    tokens = 8192 * 16 / 8  # this rank's share of the micro-batch
    activations = 80 * tokens * 8192 * 2 + kept_per_token(model, 2) * tokens
    assert row["activations"] == pytest.approx(activations)
    assert row["memory"] == pytest.approx(16 * model.parameters() / 256 + activations)
    assert row["memory"] < 71.9 * 2**30  # less than the measured peak: it leaves things out


def test_rows_held_finds_which_rank_holds_each_row_of_a_weight():
    full = torch.arange(32 * 4, dtype=torch.float64).view(32, 4)
    # (dp, tp) = (2, 2): Shard(0) on tp, then each half cut again over dp
    pieces = [full[0:8], full[16:24], full[8:16], full[24:32]]
    owner = plots.rows_held(pieces, full)
    assert owner == [0] * 8 + [2] * 8 + [1] * 8 + [3] * 8
    fig = plots.plot_rows_held(owner, [{"dp": r // 2, "tp": r % 2} for r in range(4)], "q")
    assert len(fig.axes[0].patches) == 4  # one bar per run of rows
    with pytest.raises(ValueError, match="held by no rank"):
        plots.rows_held(pieces[:3], full)
    with pytest.raises(ValueError, match="found at rows"):
        plots.rows_held([full[0:8], full[0:8]], full)
