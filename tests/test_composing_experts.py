"""Lesson 10, mixture of experts (helpers.composing.experts): one expert per rank over uneven
all-to-alls equal to one process, capacity and dropping, the bytes of each all-to-all against the
formula, the exercise's checker."""

import matplotlib

matplotlib.use("Agg")

import functools

import pytest
import torch
import torch.distributed as dist
from checker import expect_rejection
from compare import labelled

from helpers import WorkerError, reference, run
from helpers.composing import experts, plots

# Results that are numbers: `make test` runs these again on other CPU kernels (Makefile).
pytestmark = pytest.mark.numerical

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
    return run(experts.moe_worker, world_size, args=moe_case(world_size, k, capacity_factor),
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
        # the four all-to-alls of rows, in the order they ran
        measured = [(entry["sent_bytes"], entry["received_bytes"]) for entry in result["traffic"]]
        formula = experts.all_to_all_bytes(kept_counts, rank, MOE_DIM, element_size=4)
        # backward: each all-to-all reversed, in reverse order
        assert measured == [formula["dispatch"], formula["combine"], formula["dispatch"],
                            formula["combine"]]


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
    out = run(experts.moe_worker, world_size, args=(moe, tokens, torch.ones_like(tokens)),
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
        run(experts.moe_worker, 2, args=(moe, tokens, output_grad), show_output=False)


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

    received = torch.empty_like(tokens)
    dist.all_to_all_single(received, tokens[torch.argsort(destinations, stable=True)])
    return received


def dispatch_without_grouping_by_destination(rank, world_size, tokens, destinations):
    import torch

    send_counts = torch.bincount(destinations, minlength=world_size)
    received_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(received_counts, send_counts)
    received = tokens.new_empty(int(received_counts.sum()), tokens.shape[1])
    dist.all_to_all_single(received, tokens, received_counts.tolist(), send_counts.tolist())
    return received


def dispatch_by_all_gather(rank, world_size, tokens, destinations):

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
