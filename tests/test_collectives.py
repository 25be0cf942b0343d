"""Lesson 03 (helpers.collectives): workers, drawings, the explorer and exercises, each against a
reference computed here."""

import functools
import operator

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist
from checker import expect_rejection

from helpers import run
from helpers.collectives import widgets
from helpers.collectives import workers as collectives
from helpers.reference import seeded_randn

# Results that are numbers: `make test` runs these again on other CPU kernels (Makefile).
pytestmark = pytest.mark.numerical


def inputs(world_size):
    """Rank r's n numbers (10*r + position) and its single number (10*r), as the lesson defines."""
    mine = [10.0 * r + torch.arange(world_size, dtype=torch.float32) for r in range(world_size)]
    one = [torch.tensor([10.0 * r]) for r in range(world_size)]
    return mine, one


def expected_after(name, world_size):
    mine, one = inputs(world_size)
    total = torch.stack(mine).sum(0)
    n = world_size
    return {
        "broadcast": [mine[0]] * n,
        "scatter": [mine[0][r : r + 1] for r in range(n)],
        "gather": [torch.cat(one)] + [None] * (n - 1),
        "reduce": [total] + ["scratch"] * (n - 1),
        "all_gather": [torch.cat(one)] * n,
        "reduce_scatter": [total[r : r + 1] for r in range(n)],
        "all_reduce": [total] * n,
        "all_to_all": [torch.stack([mine[s][r] for s in range(n)]) for r in range(n)],
    }[name]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("name", collectives.COLLECTIVES)
def test_every_collective_gives_the_textbook_result(name, world_size):
    out = run(collectives.collective_worker, world_size, args=(name,), show_output=False)
    for rank, expected in enumerate(expected_after(name, world_size)):
        if expected is None:
            assert out[rank]["after"] is None
        elif isinstance(expected, str):  # "scratch": the values left there are gloo's business
            assert out[rank]["scratch"] is True
        else:
            torch.testing.assert_close(out[rank]["after"], expected)
            assert not out[rank].get("scratch", False)


def test_unknown_collective_is_an_error():
    from helpers import WorkerError

    with pytest.raises(WorkerError, match="unknown collective 'allreduce'"):
        run(collectives.collective_worker, 2, args=("allreduce",), show_output=False)


def test_barrier_releases_nobody_before_the_last_rank_arrives():
    out = run(collectives.barrier_worker, 3, args=(0.1,), show_output=False)
    last_arrival = max(events[0][2] for events in out)
    for events in out:
        (_, _, arrived), (_, barrier_start, left) = events
        assert barrier_start == arrived and left >= last_arrival - 0.02


def test_reduce_ops_on_gloo():
    world_size = 3
    out = run(collectives.reduce_ops_worker, world_size, show_output=False)
    rows = [collectives.reduce_op_input(r, torch.int64).tolist() for r in range(world_size)]
    columns = list(zip(*rows))
    combine = {
        "SUM": sum, "PRODUCT": lambda c: functools.reduce(operator.mul, c),
        "MIN": min, "MAX": max,
        "BAND": lambda c: functools.reduce(operator.and_, c),
        "BOR": lambda c: functools.reduce(operator.or_, c),
        "BXOR": lambda c: functools.reduce(operator.xor, c),
    }
    for rank in range(world_size):
        result = out[rank]
        for op, how in combine.items():
            assert result[(op, "int64")] == [how(column) for column in columns]
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):
            assert result[(op, "float32")] == [float(how) for how in result[(op, "int64")]]
        assert result[("AVG", "float32")] == pytest.approx([sum(c) / world_size for c in columns])
        assert "can't be cast" in result[("AVG", "int64")]
        for op in ("BAND", "BOR", "BXOR"):
            assert "non-integral dtype" in result[(op, "float32")]
        assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in result[("PREMUL_SUM", "float32")]


def test_scale_then_sum_equals_a_premultiplied_sum():
    out = run(collectives.scaled_sum_worker, 3, args=(2.5,), show_output=False)
    expected = 2.5 * sum(collectives.reduce_op_input(r, torch.float32) for r in range(3))
    for result in out:
        torch.testing.assert_close(result, expected)


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_equals_reduce_scatter_then_all_gather(world_size):
    numel, seed = 1024, 7
    out = run(collectives.two_step_all_reduce_worker, world_size, args=(numel, seed),
              show_output=False)
    total = sum(seeded_randn(seed + r, numel) for r in range(world_size))
    for rank, result in enumerate(out):
        torch.testing.assert_close(result["direct"], total)
        torch.testing.assert_close(result["two_step"], total)
        torch.testing.assert_close(result["shard"], total.chunk(world_size)[rank])


@pytest.mark.parametrize("world_size, length", [(2, 8), (3, 10), (4, 4)])
def test_sharded_softmax_and_l2_normalisation_equal_the_single_process_ones(world_size, length):
    vector = seeded_randn(length, length) * 5
    softmax = run(collectives.softmax_worker, world_size, args=(vector,), show_output=False)
    normalised = run(collectives.l2_normalize_worker, world_size, args=(vector,), show_output=False)
    torch.testing.assert_close(torch.cat(softmax.results), torch.softmax(vector, 0))
    torch.testing.assert_close(torch.cat(normalised.results), vector / vector.norm())


def test_strided_view_is_reduced_wrongly_unless_made_contiguous():
    world_size = 2
    matrices = [torch.arange(8, dtype=torch.float32).reshape(2, 4) + 100 * r
                for r in range(world_size)]
    expected = [m.clone() for m in matrices]
    for m in expected:
        m[:, ::2] = sum(x[:, ::2] for x in matrices)
    fixed = run(collectives.strided_view_worker, world_size, args=(True,), show_output=False)
    broken = run(collectives.strided_view_worker, world_size, args=(False,), show_output=False)
    for rank in range(world_size):
        torch.testing.assert_close(fixed[rank], expected[rank])
        assert not torch.equal(broken[rank][:, 1::2], matrices[rank][:, 1::2])  # outside the view
        assert not torch.equal(broken[rank], expected[rank])


def test_uneven_all_gather_by_padding_and_by_objects():
    world_size = 3
    out = run(collectives.uneven_all_gather_worker, world_size, show_output=False)
    expected = [torch.arange(r + 1, dtype=torch.float32) + 10 * r for r in range(world_size)]
    for result in out:
        for key in ("padded", "objects"):
            for got, want in zip(result[key], expected, strict=True):
                torch.testing.assert_close(got, want)


def test_uneven_all_to_all_delivers_every_pair_its_own_count():
    world_size = 3
    out = run(collectives.uneven_all_to_all_worker, world_size, show_output=False)
    for rank, result in enumerate(out):
        sent = torch.cat([torch.full((rank + j + 1,), 10.0 * rank + j) for j in range(world_size)])
        received = torch.cat([torch.full((r + rank + 1,), 10.0 * r + rank)
                              for r in range(world_size)])
        torch.testing.assert_close(result["before"], sent)
        torch.testing.assert_close(result["after"], received)


def test_strings_travel_with_all_gather_object():
    out = run(collectives.strings_worker, 3, show_output=False)
    assert out.results == [[f"rank {r} says hello" for r in range(3)]] * 3


@pytest.mark.once  # no rounding changes what it checks
def test_explorer_offers_every_collective_and_draws_every_buffer():
    explorer = widgets.collective_explorer("gather", 3)
    assert explorer.children[0].options == tuple(collectives.COLLECTIVES)
    plt.close("all")
    widgets.show_collective("all_to_all", 3)
    axes = plt.gcf().axes
    assert [len(ax.patches) for ax in axes] == [9, 9]
    labels = {text.get_text() for text in axes[1].texts}
    assert {"0", "10", "20", "rank 2"} <= labels


# Typical wrong answers to the exercises, and what the checker says.


def average_of_local_variances(rank, world_size, shard):
    moments = torch.stack([shard.mean(), shard.var(unbiased=False)])
    dist.all_reduce(moments)
    return tuple((moments / world_size).tolist())


def forgot_to_divide(rank, world_size, shard):
    moments = torch.stack([shard.sum(), shard.square().sum()])
    dist.all_reduce(moments)
    return tuple(moments.tolist())


def slots_not_zeroed(rank, world_size, mine):
    everyone = torch.ones(world_size)
    everyone[rank] = mine
    dist.all_reduce(everyone)
    return everyone


def all_gather_in_disguise(rank, world_size, mine):  # "only all_reduce", broken
    everyone = torch.empty(world_size)
    dist.all_gather_into_tensor(everyone, mine)
    return everyone


def max_instead_of_sum(rank, world_size, mine):  # right only while every number is positive
    everyone = torch.zeros(world_size)
    everyone[rank] = mine
    dist.all_reduce(everyone, op=dist.ReduceOp.MAX)
    return everyone


def moments_as_tensors(rank, world_size, shard):
    moments = torch.stack([torch.tensor(float(shard.numel())), shard.sum(), shard.square().sum()])
    dist.all_reduce(moments)
    mean = moments[1] / moments[0]
    return mean, moments[2] / moments[0] - mean**2


def two_passes(rank, world_size, shard):  # right values, numerically careful, one call too many
    sums = torch.stack([torch.tensor(float(shard.numel())), shard.sum()])
    dist.all_reduce(sums)
    mean = float(sums[1] / sums[0])
    deviations = (shard - mean).square().sum()
    dist.all_reduce(deviations)
    return mean, float(deviations / sums[0])


def argmax_with_local_index(rank, world_size, shard):  # forgets where its piece starts
    largest = shard.max().reshape(1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    hits = (shard == largest).nonzero()
    index = torch.tensor([int(hits[0]) if len(hits) else 10**9])
    dist.all_reduce(index, op=dist.ReduceOp.MIN)
    return float(largest), int(index)


@pytest.mark.parametrize("name, mistake, says", [
    ("mean_and_variance", average_of_local_variances, "On 2 ranks, rank 0: the variance: expected"),
    ("mean_and_variance", forgot_to_divide, "On 2 ranks, rank 0: the mean: expected"),
    ("mean_and_variance", moments_as_tensors,
     "On 2 ranks, rank 0: the mean: expected a Python float (tensor.item() gives one), got Tensor"),
    ("mean_and_variance", two_passes,
     "On 2 ranks: one collective call: rank 0 made 2 calls (all_reduce, all_reduce) on 2 ranks, "
     "where 1 is enough."),
    ("all_gather_from_all_reduce", slots_not_zeroed,
     "On 2 ranks, rank 0: expected tensor([-15.,  -5.]), got tensor([-14.,  -4.])"),
    ("all_gather_from_all_reduce", all_gather_in_disguise,
     "broke a rule: the task says: use only all_reduce. Your code called "
     "dist.all_gather_into_tensor()."),
    ("all_gather_from_all_reduce", max_instead_of_sum,
     "On 2 ranks, rank 0: expected tensor([-15.,  -5.]), got tensor([0., 0.])"),
    ("global_argmax", argmax_with_local_index, "On 4 ranks, rank 0: its index: expected 1, got 0"),
])
def test_checker_rejects_a_typical_mistake(name, mistake, says):
    expect_rejection(name, mistake, says)
