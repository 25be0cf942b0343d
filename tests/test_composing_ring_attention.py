"""Lesson 10, ring attention (helpers.composing.ring_attention): equal to full causal attention
forward and backward, the work per rank against the formulas, the exercises' checkers."""

import matplotlib

matplotlib.use("Agg")

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from checker import expect_acceptance, expect_rejection
from compare import labelled

from helpers import run
from helpers.composing import plots
from helpers.composing import ring_attention as ring

# Results that are numbers: `make test` runs these again on other CPU kernels (Makefile).
pytestmark = pytest.mark.numerical

RING_SHAPES = [(1, 2, 24, 4), (2, 3, 48, 8)]  # (batch, heads, seq_len, head_dim): seq_len / 2N


@functools.cache
def ring_run(world_size, layout, shape, dtype=torch.float64):
    return run(ring.ring_attention_worker, world_size, show_output=False, kwargs=dict(
        seed=0, shape=shape, layout=layout, dtype=dtype)).results


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
    out = run(ring.ring_attention_worker, 3, show_output=False, kwargs=dict(
        seed=1, shape=shape, layout="zigzag", dtype=torch.float32))
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
    out = run(ring.ring_attention_backward_worker, world_size, args=(0, shape, layout),
              show_output=False)
    for rank, grads in enumerate(out):
        positions = positions_of(rank, world_size, shape[2], layout)
        for name, tensor in zip("qkv", (q, k, v)):
            torch.testing.assert_close(grads[name], tensor.grad[:, :, positions],
                                       msg=labelled(name))


def recorded_backward_worker(rank, world_size, log_dir, shape):
    from helpers import rules

    with rules.CallRecorder((), rules.log_path(log_dir, rank),
                            ring.ring_attention_backward_worker):
        ring.ring_attention_backward_worker(rank, world_size, 0, shape, "zigzag")


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
                  gather=False, blocking=False, wait_first=False):
    """The solution with one thing changed: no mask on the diagonal block, plain averaging as
    the merge, K/V sent to rank - 1 (and the block's owner counted accordingly), K/V gathered
    with all_gather, blocking send/recv, or each transfer waited for before the computation it
    should overlap."""
    import torch

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
                if wait_first:
                    for transfer in transfers:
                        transfer.wait()
        if source <= rank:
            result = merged(result, attend(kv, source == rank))
        if step < world_size - 1:
            if not blocking and not wait_first:  # (a gloo request waited for twice hangs)
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


def ring_waiting_before_computing(rank, world_size, q, k, v):
    return _ring_mistake(rank, world_size, q, k, v, wait_first=True)


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
    ("ring_attention_forward", ring_waiting_before_computing,
     "On 3 ranks: start each transfer (isend, irecv) before you compute, wait for it after: on "
     "3 ranks, rank 0 computed with no transfer in flight, after waiting for receive number 1"),
])
def test_ring_checker_rejects_a_typical_mistake(name, mistake, says):
    expect_rejection(name, mistake, says)
