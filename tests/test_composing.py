"""Lesson 10 (helpers.composing): data x tensor (x pipeline) parallelism on a mesh equal to one
process and to PyTorch's fully_shard + parallelize_module; a mixture of experts over uneven
all-to-alls equal to one process; weights sent from trainers to inference ranks; ring attention
equal to full causal attention; the exercises."""

import matplotlib

matplotlib.use("Agg")

import copy
import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from checker import expect_acceptance, expect_rejection
from compare import labelled
from torch import nn

from helpers import WorkerError, reference, run
from helpers.composing import experts, mesh, plots, strategy, weights, workers
from helpers.composing import ring_attention as ring

# --- mesh ---------------------------------------------------------------------------------------

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


def test_mesh_groups_are_init_device_meshs():
    out = run(workers.grid_worker, 8, args=(("dp", "pp", "tp"), (2, 2, 2)), show_output=False)
    for rank, groups in enumerate(out):
        for dim, (by_hand, by_torch) in groups.items():
            assert by_hand == by_torch, (rank, dim)
    assert out[5] == {"dp": ([1, 5], [1, 5]), "pp": ([5, 7], [5, 7]), "tp": ([4, 5], [4, 5])}


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


def test_strategy_projects_the_formulas_of_lessons_07_to_09():
    model = strategy.MODELS["Llama 3 70B"]
    psi = model.parameters() / (2 * 8)  # one tp x pp shard
    row = strategy.project(model, strategy.Layout(dp=4, tp=2, pp=8, zero=1), seq_len=4096,
                           micro_batch=1, global_batch=1024)
    assert row["weights"] == 2 * psi and row["gradients"] == 2 * psi
    assert row["optimizer"] == 12 * psi / 4
    sbh = 4096 * 1 * 8192
    assert row["activations"] == pytest.approx(34 * sbh / 2 * (80 / 8) * 8)  # 8 in flight
    micro_batches = 1024 / 4
    assert row["data parallel"] == pytest.approx(2 * 3 / 4 * psi * 2)
    assert row["tensor parallel"] == pytest.approx(4 * 2 * (1 / 2) * sbh * 2 * 10 * micro_batches)
    assert row["pipeline"] == pytest.approx(2 * sbh * 2 * micro_batches)
    assert row["fits"] == (row["memory"] <= 80e9)
    for layout in strategy.layouts(model, 64):
        assert layout.gpus == 64 and model.layers % layout.pp == 0 and layout.tp <= 8


def test_strategy_plot_marks_what_does_not_fit():
    model = strategy.MODELS["Llama 3 70B"]
    chosen = [strategy.Layout(64, 1, 1, 3), strategy.Layout(4, 2, 8, 1)]
    fig = plots.plot_projection(model, 64, chosen)
    labels = [text.get_text() for text in fig.axes[0].texts]
    assert labels[0] == "does not fit" and labels[1].endswith("s on links")


# --- experts ------------------------------------------------------------------------------------


MOE_DIM, MOE_TOKENS_PER_RANK = 8, 12
# (world size = experts, k, capacity factor): top-1 and top-2 on 2 and 4 ranks, with and
# without the capacity limit
MOE_CASES = [(2, 1, 1.0), (2, 2, None), (4, 1, None), (4, 2, 1.0)]
CAPACITY_CASES = [case for case in MOE_CASES if case[2] is not None]


def moe_case(world_size, k, capacity_factor):
    """A seeded MoE, the whole batch of tokens (the ranks' slices in rank order), and the
    gradient of the loss with respect to the layer's output (loss = sum(output * output_grad))."""
    moe = experts.make_moe(MOE_DIM, world_size, k, capacity_factor, seed=2)
    num_tokens = world_size * MOE_TOKENS_PER_RANK
    return (moe, reference.seeded_randn(20, num_tokens, MOE_DIM),
            reference.seeded_randn(21, num_tokens, MOE_DIM))


@functools.cache
def moe_run(world_size, k, capacity_factor):
    return run(workers.moe_worker, world_size, args=moe_case(world_size, k, capacity_factor),
               show_output=False).results


def one_process_moe(world_size, k, capacity_factor):
    """The same layer in one process, the tokens routed in the ranks' groups: output, the tokens'
    gradient, every parameter's gradient."""
    moe, tokens, output_grad = moe_case(world_size, k, capacity_factor)
    tokens = tokens.clone().requires_grad_()
    output = moe(tokens, num_groups=world_size)
    (output * output_grad).sum().backward()
    return output.detach(), tokens.grad, {name: p.grad for name, p in moe.named_parameters()}


@pytest.mark.parametrize("case", MOE_CASES)
def test_experts_layer_equals_one_process_forward_and_backward(case):
    results = moe_run(*case)
    output, input_grad, grads = one_process_moe(*case)
    torch.testing.assert_close(torch.cat([result["output"] for result in results]), output)
    torch.testing.assert_close(torch.cat([result["input_grad"] for result in results]),
                               input_grad)
    for rank, result in enumerate(results):
        mine = {"router.weight", "router.bias",
                *(name for name in grads if name.startswith(f"experts.{rank}."))}
        assert set(result["grads"]) == mine
        for name in mine:  # the router's: summed over the ranks; expert r's: on rank r
            torch.testing.assert_close(result["grads"][name], grads[name], msg=labelled(name))


def dropped_by_counting(world_size, k, capacity_factor):
    """Per rank, the assignments beyond C = floor(capacity_factor * T * k / E) to each expert,
    counted from the router's top-k alone: sum over experts of max(0, routed - C)."""
    moe, tokens, _ = moe_case(world_size, k, capacity_factor)
    capacity = int(capacity_factor * MOE_TOKENS_PER_RANK * k / world_size)  # > 0: int is floor
    dropped = []
    for group in tokens.tensor_split(world_size):
        chosen = torch.softmax(moe.router(group), dim=-1).topk(k).indices
        routed = torch.bincount(chosen.flatten(), minlength=world_size)
        dropped.append(int((routed - capacity).clamp(min=0).sum()))
    return dropped


@pytest.mark.parametrize("case", CAPACITY_CASES)
def test_experts_dropped_count_equals_one_process_and_an_independent_count(case):
    results = moe_run(*case)
    moe, tokens, _ = moe_case(*case)
    counted = dropped_by_counting(*case)
    assert sum(counted) > 0  # the capacity limit does drop assignments here
    assert [result["dropped"] for result in results] == counted
    assert [routing.dropped for routing in moe.routings(tokens, case[0])] == counted


def test_experts_capacity_keeps_first_choices_before_second_choices():
    chosen = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1]])  # 4 tokens' first and second choices
    # capacity 2. Expert 0's first choices: tokens 0, 1, 3 (token 3 is third: dropped); expert
    # 1's: token 2. Then second choices: expert 1 takes token 0 (its second), not 1 or 3; expert
    # 0 is already full for token 2.
    kept = experts.within_capacity(chosen, num_experts=2, capacity=2)
    assert kept.tolist() == [[True, True], [True, False], [True, False], [False, False]]


@pytest.mark.parametrize("case", MOE_CASES)
def test_experts_all_to_all_bytes_equal_the_formula(case):
    world_size = case[0]
    moe, tokens, _ = moe_case(*case)
    kept_counts = [routing.kept_per_expert(world_size).tolist()
                   for routing in moe.routings(tokens, world_size)]
    for rank, result in enumerate(moe_run(*case)):
        measured = {entry["phase"]: (entry["sent_bytes"], entry["received_bytes"])
                    for entry in result["traffic"]}
        formula = experts.all_to_all_bytes(kept_counts, rank, MOE_DIM, element_size=4)
        assert measured == {"dispatch": formula["dispatch"], "combine": formula["combine"],
                            # backward: each all-to-all reversed, in reverse order
                            "combine backward": formula["dispatch"],
                            "dispatch backward": formula["combine"]}
        assert [entry["phase"] for entry in result["traffic"]] == [
            "dispatch", "combine", "combine backward", "dispatch backward"]


def balanced_moe(world_size, tokens_per_rank, k):
    """An MoE whose router sends token i of every rank to experts i, i + 1, ... (mod E): every
    expert gets T k / E assignments from every rank."""
    moe = experts.make_moe(MOE_DIM, world_size, k)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(world_size, MOE_DIM))
        moe.router.bias.zero_()
    tokens = torch.zeros(world_size * tokens_per_rank, MOE_DIM)
    for row in range(len(tokens)):
        for choice in range(k):  # first choice scores k, second k - 1, ...
            tokens[row, (row + choice) % world_size] = k - choice
    return moe, tokens


def test_experts_balanced_routing_sends_the_uniform_share():
    world_size, k, tokens_per_rank = 4, 2, 8
    moe, tokens = balanced_moe(world_size, tokens_per_rank, k)
    out = run(workers.moe_worker, world_size, args=(moe, tokens, torch.ones_like(tokens)),
              show_output=False)
    uniform = experts.uniform_all_to_all_bytes(tokens_per_rank, k, MOE_DIM, world_size)
    assert uniform == 3 / 4 * 8 * 2 * MOE_DIM * 4
    for result in out:
        assert result["routed_per_expert"] == [tokens_per_rank * k // world_size] * world_size
        for entry in result["traffic"]:
            assert entry["sent_bytes"] == entry["received_bytes"] == uniform


def test_experts_need_one_expert_per_rank():
    moe, tokens, output_grad = moe_case(4, 1, None)
    with pytest.raises(WorkerError, match="one expert per rank: 4 experts on 2 ranks"):
        run(workers.moe_worker, 2, args=(moe, tokens, output_grad), show_output=False)


def test_experts_plot_shows_the_ranks_routing():
    results = moe_run(4, 2, 1.0)
    fig = plots.plot_routing(results)
    left, right = fig.axes
    routed = torch.tensor([result["routed_per_expert"] for result in results])
    heights = torch.tensor([bar.get_height() for bar in left.patches]).view(4, 4)
    assert torch.equal(heights, routed.float())  # one segment per source rank and expert
    assert f"{sum(dropped_by_counting(4, 2, 1.0))} of {4 * MOE_TOKENS_PER_RANK * 2} dropped" \
        in right.get_title()


def dispatch_assuming_even_splits(rank, world_size, tokens, destinations):
    import torch
    import torch.distributed as dist

    received = torch.empty_like(tokens)
    dist.all_to_all_single(received, tokens[torch.argsort(destinations, stable=True)])
    return received


def dispatch_without_grouping_by_destination(rank, world_size, tokens, destinations):
    import torch
    import torch.distributed as dist

    send_counts = torch.bincount(destinations, minlength=world_size)
    received_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(received_counts, send_counts)
    received = tokens.new_empty(int(received_counts.sum()), tokens.shape[1])
    dist.all_to_all_single(received, tokens, received_counts.tolist(), send_counts.tolist())
    return received


def dispatch_by_all_gather(rank, world_size, tokens, destinations):
    import torch.distributed as dist

    everyone = [None] * world_size
    dist.all_gather_object(everyone, (tokens, destinations))
    return torch.cat([rows[to == rank] for rows, to in everyone])


@pytest.mark.parametrize("mistake,says", [
    (dispatch_assuming_even_splits,
     "call all_to_all_single twice: first the counts, then the tokens"),
    (dispatch_without_grouping_by_destination, "On 2 ranks, rank 0: elements"),
    (dispatch_by_all_gather, "broke a rule: the task says: use dist.all_to_all_single only"),
])
def test_experts_checker_rejects_a_typical_mistake(mistake, says):
    expect_rejection("moe_dispatch", mistake, says)


# --- weights ------------------------------------------------------------------------------------


WEIGHTS_STEPS, NEW_TOKENS = 3, 6


def weights_lm_case():
    """In float64, like lm_case: the trainers' weights after AdamW steps equal one process's within
    assert_close's float64 default, and near-tied logits cannot pick other tokens."""
    model, batches = reference.in_float64(
        reference.make_lm(vocab=64, dim=32, heads=4, layers=2, max_seq_len=16),
        reference.lm_data(seed=5, batch_size=8, seq_len=16, vocab=64, steps=WEIGHTS_STEPS))
    return model, batches, batches[0].inputs[:2, :4]  # prompt: 2 sequences of 4 tokens


def one_process_generations(model, batches, prompt):
    """After each step k of single-process training: the greedy tokens and logits."""
    generated = []
    for steps in range(1, len(batches) + 1):
        trained = reference.train(model, batches[:steps], reference.lm_loss, "adamw", 1e-2)
        copy_of_model = copy.deepcopy(model)
        copy_of_model.load_state_dict(trained.parameters)
        generated.append(weights.greedy_generate(copy_of_model, prompt, NEW_TOKENS))
    return generated, trained.parameters


@pytest.mark.parametrize("variant", weights.VARIANTS)
def test_weights_inference_ranks_generate_like_one_process_after_every_step(variant):
    model, batches, prompt = weights_lm_case()
    expected, final_parameters = one_process_generations(model, batches, prompt)
    out = run(workers.weight_update_worker, 4, args=(2, model, batches, prompt, NEW_TOKENS,
                                                     variant, 2**14), show_output=False)
    assert [result["trainer"] for result in out] == [True, True, False, False]
    for rank in (2, 3):
        for step, (tokens, logits) in enumerate(expected):
            got = out[rank]["steps"][step]
            assert torch.equal(got["tokens"], tokens), (rank, step)
            torch.testing.assert_close(got["logits"], logits,
                                       msg=labelled(f"rank {rank}, step {step}"))
            # the same weights as trainer 0, bit for bit, so the same logits bit for bit
            assert torch.equal(got["logits"], out[0]["steps"][step]["logits"])
        for name, param in final_parameters.items():
            torch.testing.assert_close(out[rank]["parameters"][name], param, msg=labelled(name))


@functools.cache
def delivered(num_trainers, num_inference, bucket_bytes=3000):
    """A model whose 15224 parameters do not divide by 3 (padding when T * I = 3)."""
    model = reference.make_lm(vocab=61, dim=22, heads=2, layers=2)
    out = run(workers.delivered_weights_worker, num_trainers + num_inference,
              args=(num_trainers, model, bucket_bytes), show_output=False)
    return model, out.results


TRAINERS_AND_INFERENCE = [(2, 2), (1, 3), (3, 1)]


@pytest.mark.parametrize("num_trainers, num_inference", TRAINERS_AND_INFERENCE)
def test_weights_every_variant_delivers_the_trainers_weights_exactly(num_trainers,
                                                                      num_inference):
    model, results = delivered(num_trainers, num_inference)
    expected = reference.parameters(model)
    for variant in weights.VARIANTS:
        for rank, result in enumerate(results):  # inference ranks start from NaN
            got = result[variant]["parameters"]
            assert set(got) == set(expected)
            for name, param in expected.items():
                assert torch.equal(got[name], param), (variant, rank, name)


@pytest.mark.parametrize("num_trainers, num_inference", TRAINERS_AND_INFERENCE)
def test_weights_bytes_handed_to_each_call_match_the_formula(num_trainers, num_inference):
    model, results = delivered(num_trainers, num_inference)
    sizes = [param.numel() * 4 for param in model.parameters()]
    total = sum(sizes)  # 4 bytes per float32 parameter
    inference = range(num_trainers, num_trainers + num_inference)
    for rank, result in enumerate(results):
        calls = {variant: result[variant]["calls"] for variant in weights.VARIANTS}
        in_broadcast = rank == 0 or rank in inference
        # per-tensor: one broadcast per parameter, of its bytes
        assert calls["per-tensor broadcast"] == ([("broadcast", size) for size in sizes]
                                                 if in_broadcast else [])
        # bucketed: the same bytes in runs of consecutive parameters, each run but the last
        # reaching 3000 bytes, none reaching it before its last parameter
        bucketed = [size for _, size in calls["bucketed broadcast"]]
        if in_broadcast:
            assert sum(bucketed) == total and len(bucketed) < len(sizes)
            ends = [sum(bucketed[:index + 1]) for index in range(len(bucketed))]
            boundaries = [sum(sizes[:index + 1]) for index in range(len(sizes))]
            assert set(ends) <= set(boundaries)
            for start, end in zip([0, *ends], ends):
                inside = [b - start for b in boundaries if start < b <= end]
                assert all(held < 3000 for held in inside[:-1])
                assert inside[-1] >= 3000 or end == total
        else:
            assert bucketed == []
        # scatter + all_gather: pieces of ceil(P / (T I)) elements
        piece = 4 * math.ceil(total / 4 / (num_trainers * num_inference))
        if rank < num_trainers:
            assert calls["scatter + all_gather"] == [("isend", piece)] * num_inference
        else:
            assert calls["scatter + all_gather"] == [("irecv", piece)] * num_trainers + [
                ("all_gather", piece * num_trainers)]
    sent_by_trainers = sum(size for result in results[:num_trainers]
                           for _, size in result["scatter + all_gather"]["calls"])
    assert total <= sent_by_trainers < total + 4 * num_trainers * num_inference


def group_members_worker(rank, world_size, num_trainers):
    groups = weights.make_weight_groups(num_trainers, world_size)
    return {name: (dist.get_process_group_ranks(getattr(groups, name))
                   if rank in members else None)
            for name, members in [("trainers", groups.trainer_ranks),
                                  ("inference", groups.inference_ranks),
                                  ("source_and_inference", [0, *groups.inference_ranks])]}


def test_weights_groups_split_trainers_from_inference_ranks():
    out = run(group_members_worker, 5, args=(2,), show_output=False)
    for rank, groups in enumerate(out):
        assert groups["trainers"] == ([0, 1] if rank < 2 else None)
        assert groups["inference"] == ([2, 3, 4] if rank >= 2 else None)
        assert groups["source_and_inference"] == ([0, 2, 3, 4] if rank != 1 else None)
    for wrong in (0, 5):
        with pytest.raises(ValueError, match="trainers out of 5 ranks"):
            weights.make_weight_groups(wrong, 5)


def test_weights_greedy_generation_is_the_argmax_of_one_forward_of_its_output():
    model, _, prompt = weights_lm_case()
    tokens, logits = weights.greedy_generate(model, prompt, NEW_TOKENS)
    assert tokens.shape == (2, NEW_TOKENS) and logits.shape == (2, NEW_TOKENS, 64)
    with torch.no_grad():  # a causal model: position j's logits see only tokens 0..j
        whole = model(torch.cat([prompt, tokens], dim=1))
    length = prompt.shape[1]
    torch.testing.assert_close(logits, whole[:, length - 1:-1])
    assert torch.equal(tokens, whole[:, length - 1:-1].argmax(dim=-1))


def test_weights_sweep_times_every_variant_and_plots_it():
    out = run(workers.transfer_times_worker, 4, args=(2, (16, 32), 2, 2**12, 1),
              show_output=False)
    for width, record in zip((16, 32), out[0]):
        model = reference.make_lm(dim=width, layers=2)
        assert record["width"] == width
        assert record["parameters"] == sum(param.numel() for param in model.parameters())
        assert record["tensors"] == len(list(model.parameters()))
        assert set(record["seconds"]) == set(weights.VARIANTS)
        assert all(seconds > 0 for seconds in record["seconds"].values())
        assert sum(size for _, size in record["calls"]["bucketed broadcast"]) == \
            4 * record["parameters"]
        assert len(record["calls"]["per-tensor broadcast"]) == record["tensors"]
    assert [record["seconds"] for record in out[0]] == [record["seconds"] for record in out[3]]
    fig = plots.plot_transfer_times(out[0])
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == list(weights.VARIANTS)
    assert ax.get_xscale() == ax.get_yscale() == "log"


# --- ring attention -----------------------------------------------------------------------------


RING_SHAPES = [(1, 2, 24, 4), (2, 3, 48, 8)]  # (batch, heads, seq_len, head_dim): seq_len / 2N


@functools.cache
def ring_run(world_size, layout, shape, dtype=torch.float64):
    return run(workers.ring_attention_worker, world_size, args=(0, shape, layout, dtype),
               show_output=False).results


def positions_of(rank, world_size, seq_len, layout):
    """The sequence positions a rank holds, written out: contiguous, block r of N; zigzag,
    chunks r and 2N - 1 - r of 2N (Megatron-LM's get_batch_on_this_cp_rank)."""
    if layout == "contiguous":
        block = seq_len // world_size
        return list(range(rank * block, (rank + 1) * block))
    chunk = seq_len // (2 * world_size)
    return [chunk * index + offset for index in (rank, 2 * world_size - 1 - rank)
            for offset in range(chunk)]


def causal_logsumexp(q, k):
    """Each query's log-sum-exp over the keys it may see, from the masked score matrix."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).logsumexp(dim=-1)


@pytest.mark.parametrize("shape", RING_SHAPES)
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_equals_full_causal_attention(world_size, layout, shape):
    q, k, v = ring.attention_inputs(0, *shape, dtype=torch.float64)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected_lse = causal_logsumexp(q, k)
    for rank, result in enumerate(ring_run(world_size, layout, shape)):
        positions = positions_of(rank, world_size, shape[2], layout)
        torch.testing.assert_close(result.output, expected[:, :, positions])
        torch.testing.assert_close(result.logsumexp, expected_lse[:, :, positions])


def test_ring_attention_in_float32_on_3_ranks():
    shape = (2, 2, 36, 8)
    q, k, v = ring.attention_inputs(1, *shape)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = run(workers.ring_attention_worker, 3, args=(1, shape, "zigzag", torch.float32),
              show_output=False)
    assert out[0].output.dtype == torch.float32
    got = ring.whole_sequence([result.output for result in out], "zigzag")
    # Each of the 2 * 3 merges of the online softmax rescales the partial output once: a few
    # epsilons (2**-23) of relative error per merge, well inside 1e-5 relative; 1e-6 absolute
    # for outputs near zero (the values are of size 1).
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_work_per_rank_is_the_formulas(world_size, layout):
    """The pairs each rank counted in the run: the causal pairs of its positions, sum(p + 1),
    and the closed form; the scores it computed: (chunks of keys <= each of its query chunks)
    chunk^2; zigzag balances both."""
    shape = RING_SHAPES[1]
    seq_len, chunks = shape[2], ring.num_chunks(world_size, layout)
    results = ring_run(world_size, layout, shape)
    for rank, result in enumerate(results):
        positions = positions_of(rank, world_size, seq_len, layout)
        assert result.visible_pairs == sum(p + 1 for p in positions)
        assert result.visible_pairs == ring.visible_pairs_formula(rank, world_size, seq_len,
                                                                  layout)
        query_chunks = sorted({p * chunks // seq_len for p in positions})
        computed = sum(chunk + 1 for chunk in query_chunks) * (seq_len // chunks) ** 2
        assert result.computed_scores == computed
        assert result.computed_scores == ring.computed_scores_formula(rank, world_size, seq_len,
                                                                      layout)
    assert sum(r.visible_pairs for r in results) == seq_len * (seq_len + 1) // 2
    pairs = [result.visible_pairs for result in results]
    if layout == "zigzag":
        assert len(set(pairs)) == 1
    else:  # the last rank sees N blocks' worth of pairs, about 2N - 1 times the first's
        assert pairs == sorted(pairs) and pairs[-1] > (2 * world_size - 2) * pairs[0]


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_backward_equals_autograd(world_size, layout):
    shape = RING_SHAPES[1]
    q, k, v = (x.requires_grad_() for x in ring.attention_inputs(0, *shape, dtype=torch.float64))
    output = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    output.backward(ring.output_gradient(0, *shape, dtype=torch.float64))
    out = run(workers.ring_attention_backward_worker, world_size, args=(0, shape, layout),
              show_output=False)
    for rank, grads in enumerate(out):
        positions = positions_of(rank, world_size, shape[2], layout)
        for name, tensor in zip("qkv", (q, k, v)):
            torch.testing.assert_close(grads[name], tensor.grad[:, :, positions],
                                       msg=labelled(name))


def recorded_backward_worker(rank, world_size, log_dir, shape):
    from helpers import rules
    from helpers.composing import workers

    with rules.CallRecorder((), rules.log_path(log_dir, rank),
                            workers.ring_attention_backward_worker):
        workers.ring_attention_backward_worker(rank, world_size, 0, shape, "zigzag")


def test_ring_sends_only_to_the_next_rank_as_often_as_the_ring_needs(tmp_path):
    """Forward: K/V N - 1 times. Backward: K/V N - 1 times, and each dK/dV accumulator N times
    (the last hop brings it home). Every message goes to rank + 1, with isend."""
    from helpers import rules

    world_size = 4
    run(recorded_backward_worker, world_size, args=(str(tmp_path), RING_SHAPES[0]),
        show_output=False)
    logs = rules.read_logs(str(tmp_path), world_size)
    for rank in range(world_size):
        sent = rules.sends(logs[rank])
        assert sent == [(rank + 1) % world_size] * (3 * world_size - 2)
        assert {call.name for call in logs[rank]} == {"isend", "irecv"}


@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_ring_layout_puts_positions_where_the_ranks_expect_them(layout):
    world_size, seq_len = 4, 16
    positions = torch.arange(seq_len, dtype=torch.float64).view(1, 1, seq_len, 1)
    blocks = [ring.local_block(positions, rank, world_size, layout) for rank in range(world_size)]
    for rank, block in enumerate(blocks):
        assert block.flatten().long().tolist() == positions_of(rank, world_size, seq_len, layout)
    torch.testing.assert_close(ring.whole_sequence(blocks, layout), positions)


def test_ring_merge_keeps_masked_rows_and_huge_scores_finite():
    """Scores in the thousands (exp overflows in float64) and a row that sees no key of one
    set: the merge equals attention over both sets, computed at once."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 5, 4, dtype=torch.float64) for _ in range(3))
    scores = 500 * q @ k.transpose(-2, -1)
    scores[:, 1, :2] = float("-inf")  # query 1 sees none of set a's keys (keys 0 and 1)

    def attend(s, values):
        lse = s.logsumexp(dim=-1)
        return torch.nan_to_num((s - lse[..., None]).exp()) @ values, lse

    out_a, lse_a = attend(scores[..., :2], v[:, :2])
    out_b, lse_b = attend(scores[..., 2:], v[:, 2:])
    assert lse_a[:, 1].isneginf().all() and lse_b.max() > 710  # math.exp(710) overflows
    out, lse = ring.online_softmax_merge(out_a, lse_a, out_b, lse_b)
    expected_out, expected_lse = attend(scores, v)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)


def ring_attention_as_the_exercise(rank, world_size, q, k, v):
    from helpers.composing import ring_attention

    return ring_attention.ring_attention(q, k, v).output


def test_ring_attention_obeys_the_exercises_rules():
    """helpers' ring passes the exercise's checker: isend/irecv only, N - 1 sends to rank + 1."""
    expect_acceptance("ring_attention_forward", ring_attention_as_the_exercise)


def test_ring_work_plot_draws():
    visible = {"contiguous": [1, 3, 5, 7], "zigzag": [4, 4, 4, 4]}
    fig = plots.plot_ring_work(visible, visible, {"contiguous": [1, 2, 3, 4],
                                                  "zigzag": [2, 2, 2, 2]})
    assert len(fig.axes) == 2
    heights = [patch.get_height() for patch in fig.axes[0].patches]
    assert heights == visible["contiguous"] + visible["zigzag"]


def merge_with_a_running_maximum(out_a, lse_a, out_b, lse_b):
    import torch

    top = torch.maximum(lse_a, lse_b)  # FlashAttention's way: subtract the maximum
    weight_a, weight_b = (lse_a - top).exp(), (lse_b - top).exp()
    total = weight_a + weight_b
    out = (weight_a[..., None] * out_a + weight_b[..., None] * out_b) / total[..., None]
    return out, top + total.log()


def test_ring_merge_checker_accepts_the_running_maximum_way():
    expect_acceptance("online_softmax_merge", merge_with_a_running_maximum)


# The exercises: a typical mistake each checker must reject.

def merge_by_exponentiating(out_a, lse_a, out_b, lse_b):
    import torch

    weight_a, weight_b = torch.exp(lse_a), torch.exp(lse_b)  # overflows for scores > 709
    total = weight_a + weight_b
    return ((weight_a[..., None] * out_a + weight_b[..., None] * out_b) / total[..., None],
            torch.log(total))


def merge_by_averaging(out_a, lse_a, out_b, lse_b):
    import torch

    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_keeping_the_larger_lse(out_a, lse_a, out_b, lse_b):
    import torch

    lse = torch.logaddexp(lse_a, lse_b)
    out = (lse_a - lse).exp()[..., None] * out_a + (lse_b - lse).exp()[..., None] * out_b
    return out, torch.maximum(lse_a, lse_b)


def _ring_mistake(rank, world_size, q, k, v, diagonal_mask=True, merge="online", send_to=1,
                  gather=False, blocking=False):
    """The solution with one thing changed: no mask on the diagonal block, plain averaging as
    the merge, K/V sent to rank - 1 (and the block's owner counted accordingly), K/V gathered
    with all_gather, or blocking send/recv."""
    import torch
    import torch.distributed as dist

    def attend(kv, diagonal):
        scores = q @ kv[0].transpose(-2, -1) / q.shape[-1] ** 0.5
        if diagonal and diagonal_mask:
            future = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        lse = scores.logsumexp(dim=-1)
        return (scores - lse[..., None]).exp() @ kv[1], lse

    def merged(old, new):
        if old is None:
            return new
        if merge == "average":
            return (old[0] + new[0]) / 2, torch.logaddexp(old[1], new[1])
        lse = torch.logaddexp(old[1], new[1])
        return ((old[1] - lse).exp()[..., None] * old[0]
                + (new[1] - lse).exp()[..., None] * new[0], lse)

    kv, result = torch.stack((k, v)), None
    if gather:
        every = [torch.empty_like(kv) for _ in range(world_size)]
        dist.all_gather(every, kv)
        for source in range(rank + 1):
            result = merged(result, attend(every[source], source == rank))
        return result[0]
    for step in range(world_size):
        source = (rank - send_to * step) % world_size
        if step < world_size - 1:
            kv_next = torch.empty_like(kv)
            if blocking and rank % 2 == 0:
                dist.send(kv, dst=(rank + send_to) % world_size)
                dist.recv(kv_next, src=(rank - send_to) % world_size)
            elif blocking:
                dist.recv(kv_next, src=(rank - send_to) % world_size)
                dist.send(kv, dst=(rank + send_to) % world_size)
            else:
                transfers = [dist.isend(kv, dst=(rank + send_to) % world_size),
                             dist.irecv(kv_next, src=(rank - send_to) % world_size)]
        if source <= rank:
            result = merged(result, attend(kv, source == rank))
        if step < world_size - 1:
            if not blocking:
                for transfer in transfers:
                    transfer.wait()
            kv = kv_next
    return result[0]


def ring_without_the_diagonal_mask(rank, world_size, q, k, v):
    return _ring_mistake(rank, world_size, q, k, v, diagonal_mask=False)


def ring_merging_by_averaging(rank, world_size, q, k, v):
    return _ring_mistake(rank, world_size, q, k, v, merge="average")


def ring_sending_to_the_previous_rank(rank, world_size, q, k, v):
    return _ring_mistake(rank, world_size, q, k, v, send_to=-1)


def ring_gathering_every_kv(rank, world_size, q, k, v):
    return _ring_mistake(rank, world_size, q, k, v, gather=True)


def ring_with_blocking_sends(rank, world_size, q, k, v):
    return _ring_mistake(rank, world_size, q, k, v, blocking=True)


@pytest.mark.parametrize("name,mistake,says", [
    ("online_softmax_merge", merge_by_exponentiating,
     "the merged out: expected tensor([[-1.5313,  0.6318],"),
    ("online_softmax_merge", merge_by_averaging, "the merged out:"),
    ("online_softmax_merge", merge_keeping_the_larger_lse, "the merged lse:"),
    ("ring_attention_forward", ring_without_the_diagonal_mask, "On 2 ranks, rank 0:"),
    ("ring_attention_forward", ring_merging_by_averaging, "On 2 ranks, rank 1:"),
    ("ring_attention_forward", ring_sending_to_the_previous_rank,
     "On 3 ranks: each rank passes the K/V it holds to rank + 1 (mod N)"),
    ("ring_attention_forward", ring_gathering_every_kv, "Your code called dist.all_gather()"),
    ("ring_attention_forward", ring_with_blocking_sends, "Your code called dist.send()"),
])
def test_ring_checker_rejects_a_typical_mistake(name, mistake, says):
    expect_rejection(name, mistake, says)
