"""Lesson 05 (helpers.how_all_reduce_works): ring and tree all-reduce against dist.all_reduce and
the single-process sum, bytes against their formulas, the trace, the cost models, the exercises."""

import math

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.distributed as dist
from checker import expect_rejection

from helpers import run
from helpers.how_all_reduce_works import algorithms, workers
from helpers.reference import seeded_randn

# Results that are numbers: `make test` runs these again on other CPU kernels (Makefile).
pytestmark = pytest.mark.numerical


def single_process_sum(numel, seed, world_size):
    return sum(seeded_randn(seed + r, numel) for r in range(world_size))


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("world_size, numel", [
    (2, 160), (4, 160), (3, 163), (5, 163), (6, 25), (7, 1000), (7, 5),
])
def test_ring_all_reduce_equals_the_sum_and_sends_2_n_minus_1_over_n(world_size, numel, pipelined):
    out = run(workers.ring_all_reduce_worker, world_size, args=(numel, 3, pipelined),
              show_output=False)
    total = single_process_sum(numel, 3, world_size)
    for result in out:
        torch.testing.assert_close(result["result"], total)
        torch.testing.assert_close(result["reference"], total)
    # n chunks whose sizes differ by at most one: the first numel % n of them one longer
    chunk_sizes = [numel // world_size + (c < numel % world_size) for c in range(world_size)]
    for rank, result in enumerate(out):
        # rank r sends chunks r, r-1, ..., each once per phase except the one it receives last
        sent_chunks = [(rank - step) % world_size for step in range(2 * (world_size - 1))]
        assert result["bytes_sent"] == 4 * sum(chunk_sizes[c] for c in sent_chunks)
        if numel % world_size == 0:
            assert result["bytes_sent"] == 2 * (world_size - 1) / world_size * numel * 4


def test_ring_trace_shows_partial_sums_spreading():
    world_size = 4
    traces = run(workers.ring_trace_worker, world_size, show_output=False).results
    everyone = sum(10.0**r for r in range(world_size))
    assert [len(trace) for trace in traces] == [1 + 2 * (world_size - 1)] * world_size
    for rank, trace in enumerate(traces):
        assert [step for step, _, _ in trace] == list(range(-1, 2 * (world_size - 1)))
        assert [sent for _, sent, _ in trace[1:]] == [(rank - s) % world_size
                                                     for s in range(2 * (world_size - 1))]
        start = torch.full((world_size,), 10.0**rank, dtype=torch.float64)
        torch.testing.assert_close(trace[0][2], start)
        # after the reduce-scatter phase rank r owns the full sum of chunk r + 1
        assert trace[world_size - 1][2][(rank + 1) % world_size] == everyone
        done = torch.full((world_size,), everyone, dtype=torch.float64)
        torch.testing.assert_close(trace[-1][2], done)
        # after reduce-scatter step s, the chunk received contains ranks r - s - 1 ... r
        for step in range(world_size - 1):
            chunk = (rank - step - 1) % world_size
            expected = sum(10.0 ** ((rank - k) % world_size) for k in range(step + 2))
            assert trace[1 + step][2][chunk] == expected


def test_nccl_binary_tree_is_the_one_drawn_in_trees_cc():
    # The illustration above ncclGetBtree in NVIDIA/nccl src/graph/trees.cc, for 14 ranks
    children = {0: [8], 8: [4, 12], 4: [2, 6], 12: [10, 13], 2: [1, 3], 6: [5, 7], 10: [9, 11]}
    tree = algorithms.nccl_binary_tree(14)
    for rank in range(14):
        parent, kids = tree[rank]
        assert sorted(kids) == children.get(rank, [])
        assert parent == next((p for p, c in children.items() if rank in c), None)


@pytest.mark.parametrize("world_size", [4, 5, 6, 7, 8])
def test_in_nccls_double_tree_no_rank_is_a_leaf_twice_and_nobody_sends_3_halves(world_size):
    first, second = algorithms.nccl_double_tree(world_size)
    for tree in (first, second):  # each is a tree: one root, and every edge seen from both ends
        assert sum(parent is None for parent, _ in tree.values()) == 1
        for rank, (parent, _) in tree.items():
            assert parent is None or rank in tree[parent][1]
    assert not [r for r in range(world_size) if not first[r][1] and not second[r][1]]
    sent = [(first[r][0] is not None) + len(first[r][1]) + (second[r][0] is not None)
            + len(second[r][1]) for r in range(world_size)]  # in halves of the tensor
    assert max(sent) <= 4  # at most 2 tensors, where one heap tree has ranks sending 3


def tree_bytes(tree, size):
    """Bytes each rank sends on a tree: once up (unless root), once per child down."""
    return [size * ((tree[r][0] is not None) + len(tree[r][1])) for r in range(len(tree))]


@pytest.mark.parametrize("world_size", [2, 3, 6, 7])
@pytest.mark.parametrize("double", [False, True])
def test_tree_all_reduce_equals_the_sum_and_counts_its_bytes(world_size, double):
    numel = 64
    out = run(workers.tree_all_reduce_worker, world_size, args=(numel, 5, double),
              show_output=False)
    total = single_process_sum(numel, 5, world_size)
    for result in out:
        torch.testing.assert_close(result["result"], total)
    if double:
        first, second = algorithms.nccl_double_tree(world_size)
        expected = [a + b for a, b in zip(tree_bytes(first, numel // 2 * 4),
                                          tree_bytes(second, numel // 2 * 4))]
    else:
        expected = tree_bytes(algorithms.heap_tree(world_size), numel * 4)
    assert [result["bytes_sent"] for result in out] == expected
    assert sum(expected) == 2 * (world_size - 1) * numel * 4  # every edge carries M up and M down


def test_a_heap_tree_has_ranks_that_send_3_times_the_tensor():
    assert tree_bytes(algorithms.heap_tree(6), 1) == [2, 3, 2, 1, 1, 1]


def test_double_tree_is_more_even_than_one_tree():
    world_size = 6
    busiest = {}
    for double in (False, True):
        out = run(workers.tree_all_reduce_worker, world_size, args=(64, 0, double),
                  show_output=False)
        busiest[double] = max(result["bytes_sent"] for result in out)
    assert busiest[True] < busiest[False]


def test_cost_models_follow_their_formulas():
    alpha, beta = 5e-6, 50e9
    ring = workers.ring_seconds(8, 1e6, alpha, beta)
    assert ring == pytest.approx(14 * (alpha + 1e6 / 8 / beta))
    assert workers.recursive_doubling_seconds(8, 1e6, alpha, beta) == pytest.approx(
        3 * alpha + 3 * 1e6 / beta)
    assert workers.halving_doubling_seconds(8, 1e6, alpha, beta) == pytest.approx(
        6 * alpha + 1.75 * 1e6 / beta)
    assert workers.tree_seconds(8, 1e6, alpha, beta) == pytest.approx(6 * alpha + 2e6 / beta)
    for topology in workers.TOPOLOGIES:
        seconds = workers.all_reduce_on(topology, 64, 1e8, 5e10)
        assert seconds == pytest.approx(2 * 63 / 64 * 1e8 / 5e10)
    hops = {"switch": 1, "torus_2d": math.sqrt(64) / 2, "ring": 64 / 4}
    for topology, h in hops.items():
        seconds = workers.all_to_all_on(topology, 64, 1e8, 5e10)
        assert seconds == pytest.approx(63 / 64 * 1e8 * h / 5e10)
    with pytest.raises(ValueError, match="unknown topology"):
        workers.all_reduce_on("hypercube", 8, 1e6, 1e9)


def test_stepper_and_topology_widgets_build():
    from helpers.how_all_reduce_works import widgets

    traces = run(workers.ring_trace_worker, 3, show_output=False).results
    stepper = widgets.ring_stepper(traces)
    # the slider's labels are the steps the panel's title shows: start, then 2(n - 1) steps
    assert [label for label, _ in stepper.children[0].options] == ["start", "0", "1", "2", "3"]
    explorer = widgets.topology_explorer(16, 10.0, 100.0)
    descriptions = [child.description for child in explorer.children[:3]]
    assert descriptions == ["devices", "MB each", "GB/s each"]


# Typical wrong answers to the exercises, and what the checker says.


def all_gather_with_a_collective(rank, world_size, piece, lengths):
    pieces = [torch.empty(length) for length in lengths]
    dist.all_gather(pieces, piece)  # fails anyway for unequal lengths on gloo; the rule comes first
    return torch.cat(pieces)


def ring_all_gather_wrong_piece(rank, world_size, piece, lengths):  # always sends its own piece
    pieces = [torch.empty(length) for length in lengths]
    pieces[rank] = piece.clone()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(world_size - 1):
        receive = (rank - step - 1) % world_size
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, pieces[rank], right),
                                               dist.P2POp(dist.irecv, pieces[receive], left)]):
            request.wait()
    return torch.cat(pieces)


def heap_tree_reduce(rank, world_size, tensor):  # right sum, the shown tree, not a binomial one
    incoming = torch.empty_like(tensor)
    for child in (2 * rank + 1, 2 * rank + 2):
        if child < world_size:
            dist.recv(incoming, src=child)
            tensor += incoming
    if rank > 0:
        dist.send(tensor, dst=(rank - 1) // 2)
        return None
    return tensor


def binomial_without_adding(rank, world_size, tensor):  # forwards what arrives, keeps its own
    incoming = torch.empty_like(tensor)
    distance = 1
    while distance < world_size:
        if rank & distance:
            dist.send(tensor, dst=rank - distance)
            return None
        if rank + distance < world_size:
            dist.recv(incoming, src=rank + distance)
        distance *= 2
    return tensor


def all_reduce_by_ring(rank, world_size, data):  # right sum, but 2(n-1) sends, not log2 n
    from helpers.how_all_reduce_works.algorithms import ring_all_reduce

    ring_all_reduce(data)
    return data


def doubling_without_the_partners_sum(rank, world_size, data):  # adds its own data back
    distance = 1
    while distance < world_size:
        partner = rank ^ distance
        incoming = torch.empty_like(data)
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, data, partner),
                                               dist.P2POp(dist.irecv, incoming, partner)]):
            request.wait()
        data = data + data
        distance *= 2
    return data


@pytest.mark.parametrize("name, mistake, says", [
    ("ring_all_gather", all_gather_with_a_collective,
     "broke a rule: the task says: use point-to-point calls only (no collectives). Your code "
     "called dist.all_gather()."),
    ("ring_all_gather", ring_all_gather_wrong_piece,
     "On 3 ranks:\nrank 1 died from signal SIGABRT"),
    ("binomial_tree_reduce", heap_tree_reduce,
     "in a binomial tree each rank sends once, to rank minus its lowest set bit: on 5 ranks, "
     "rank 3 sent to [1], where the tree sends to [2]."),
    ("binomial_tree_reduce", binomial_without_adding, "On 2 ranks, rank 0:"),
    ("recursive_doubling_all_reduce", all_reduce_by_ring,
     "On 2 ranks: recursive doubling sends log2 n times per rank: rank 0 sent 2 times on 2 ranks, "
     "where 1 is enough."),
    ("recursive_doubling_all_reduce", doubling_without_the_partners_sum, "On 2 ranks, rank 0:"),
])
def test_checker_rejects_a_typical_mistake(name, mistake, says):
    expect_rejection(name, mistake, says)
