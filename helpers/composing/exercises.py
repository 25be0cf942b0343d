"""Lesson 10's exercises, checked by `helpers.exercises.check(name, your_function)`."""

import torch
import torch.nn.functional as F

from helpers.composing import ring_attention as ring
from helpers.exercises import Exercise
from helpers.reference import seeded_randn
from helpers.rules import OffTheWorld, Only, OverlapsCompute, Rule, SameGroups, SendsTo

EXERCISES = {}

# --- composing: groups from a grid, and one data x tensor parallel step -----------------------


def _grid_members(rank, sizes) -> list:
    """For each dimension of the grid `sizes` (last varying fastest), the ranks whose
    coordinates differ from `rank`'s only along it, by arithmetic on the coordinates."""
    strides = [1] * len(sizes)
    for axis in range(len(sizes) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * sizes[axis + 1]
    mine = [rank // stride % size for stride, size in zip(strides, sizes)]
    return [[rank + (value - mine[axis]) * strides[axis] for value in range(sizes[axis])]
            for axis in range(len(sizes))]


EXERCISES["mesh_groups"] = Exercise(
    "the ranks form a grid of shape `sizes` (outermost dimension first, e.g. (2, 2, 2) for dp x "
    "pp x tp), numbered so that the last coordinate varies fastest. Along each dimension, your "
    "group is the ranks whose coordinates differ from yours only along it. Create every "
    "rank's groups with dist.new_group, as it requires (every rank creates every group, in "
    "the same order), and return a list with, for each dimension in order, the members of "
    "your group along it, as dist.get_process_group_ranks gives them",
    [(8, ((2, 2, 2),)), (6, ((3, 2),)), (6, ((1, 2, 3),))],
    lambda rank, n, sizes: _grid_members(rank, sizes),
    rules=(Only(text="no communication is needed: create the groups and read their members"),
           SameGroups()), points=3)

DP_TP_WIDTH, DP_TP_BATCH = 6, 12  # the MLP's width h (its hidden width is 4h) and the batch


def _dp_tp_inputs(rank, world_size, seed, tp):
    """Every rank gets the whole MLP and batch, in float64: W1 (4h x h), W2 (h x 4h), x, y."""
    h = DP_TP_WIDTH
    return (seeded_randn(seed, 4 * h, h).double() / h**0.5,
            seeded_randn(seed + 1, h, 4 * h).double() / (4 * h) ** 0.5,
            seeded_randn(seed + 2, DP_TP_BATCH, h).double(),
            seeded_randn(seed + 3, DP_TP_BATCH, h).double(), tp)


def _dp_tp_expected(rank, world_size, seed, tp):
    """One process: the whole batch through the whole MLP; then this rank's slices."""
    w1, w2, x, y, _ = _dp_tp_inputs(rank, world_size, seed, tp)
    w1, w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    (F.gelu(x @ w1.T) @ w2.T - y).square().mean().backward()
    t = rank % tp
    return w1.grad.chunk(tp)[t], w2.grad.chunk(tp, dim=1)[t]


def _dp_tp_hint(got, expected, world_size, seed, tp):
    """Gradients off by exactly a factor of dp (the denominator of the loss's mean) or of tp (a
    sum over the tp group done again in backward)."""
    dp = world_size // tp
    if not isinstance(got, tuple | list) or len(got) != len(expected):
        return None
    hints = [(dp, f"each of your gradients is dp = {dp} times the whole batch's: a mean over "
                  "your own slice of the batch, summed over the dp group, counts every sample dp "
                  "times. The loss is the mean over the whole batch: divide by its size, or "
                  "average over dp, not both or neither."),
             (1 / dp, f"each of your gradients is 1/dp = 1/{dp} of the whole batch's: is your "
                      "slice's gradient summed over the dp group? Or averaged twice: a loss "
                      "divided by the whole batch's size, and then averaged over dp as well?"),
             (tp, f"each of your gradients is tp = {tp} times what it should be: is a sum over "
                  "the tp group done again in backward? The all-reduce that ends a region "
                  "(lesson 08's g) is the identity in backward; torch.distributed.nn.functional."
                  "all_reduce, which autograd differentiates, sums the gradient once more.")]
    for factor, hint in hints:
        if factor != 1 and all(isinstance(part, torch.Tensor) and part.shape == want.shape
                               and torch.allclose(part, factor * want)
                               for part, want in zip(got, expected)):
            return hint
    return None


EXERCISES["dp_tp_step"] = Exercise(
    "one training step's gradients with data x tensor parallelism, for the MLP out = GeLU(x "
    "W1^T) W2^T (no biases) and the loss mean((out - y)**2) over the whole batch. The ranks form "
    "a dp x tp grid, tp given, rank = d * tp + t. Your rank holds piece t of W1's rows and piece "
    "t of W2's columns (each cut into tp equal pieces) and works on slice d of the batch (dp "
    "equal slices of x and y, in order). You get the whole W1, W2, x, y (float64) and tp. "
    "Return (the gradient of your W1 rows, the gradient of your W2 columns), equal to what one "
    "process computes for those pieces on the whole batch. Communicate only with all_reduce, and "
    "only within your dp group or your tp group (make them as dist.new_group requires)",
    [(6, (3, 2)), (4, (1, 2)), (6, (2, 3))],  # dp = 3 first: a factor of dp is not one of tp
    _dp_tp_expected,
    inputs=_dp_tp_inputs,
    names=("the gradient of your W1 rows", "the gradient of your W2 columns"),
    hint="which of your results is only your share of a sum, and over which group (tp or dp) "
         "must it be summed, in the forward or in the backward?",
    hint_for=_dp_tp_hint,
    rules=(Only("all_reduce", text="communicate only with all_reduce"),
           OffTheWorld("all_reduce", text="reduce only within your dp group or your tp group"),
           SameGroups()), points=3)

# --- experts ------------------------------------------------------------------------------------


DISPATCH_CASES = [(2, (0, 3)), (3, (1, 4)), (4, (2, 2))]  # (seed, dim)


def _dispatch_inputs(rank, world_size, seed, dim):
    """Rank r's tokens and their destinations. Row i of rank r is filled with 100 r + i, so a
    wrong row names itself; 2 to 8 tokens per rank; rank 0 sends nothing to the last rank."""
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    count = int(torch.randint(2, 9, (1,), generator=generator))
    destinations = torch.randint(world_size, (count,), generator=generator)
    if rank == 0:
        destinations[destinations == world_size - 1] = 0
    tokens = (100 * rank + torch.arange(count, dtype=torch.float32))[:, None].repeat(1, dim)
    return tokens, destinations


def _dispatch_expected(rank, world_size, seed, dim):
    """Every rank's tokens for `rank`, source rank by source rank, each in its original order."""
    pieces = []
    for source in range(world_size):
        tokens, destinations = _dispatch_inputs(source, world_size, seed, dim)
        pieces.append(tokens[destinations == rank])
    return torch.cat(pieces)


class CountsThenTokens(Rule):
    """Each rank calls all_to_all_single exactly twice, the first time on world_size counts."""

    def broken_by(self, logs, world_size, args=(), finished=True):
        for rank, calls in sorted(logs.items()):
            sizes = [call.numel for call in calls if call.name == "all_to_all_single"]
            right_number = len(sizes) == 2 if finished else len(sizes) <= 2
            if not right_number or sizes[:1] not in ([], [world_size]):
                return (f"{self.text}: rank {rank}'s all_to_all_single calls received "
                        f"{sizes} elements, where the task makes two calls, the first receiving "
                        f"{world_size} counts.")
        return None


EXERCISES["moe_dispatch"] = Exercise(
    "send each of your `tokens` (a tensor of shape (n, dim); row i of rank r is filled with "
    "100 r + i) to the rank in `destinations` (n integers, each in 0..world_size-1; the counts "
    "are uneven, and may be zero), and return the tokens this rank receives, as one tensor: "
    "rank 0's first, then rank 1's, and so on, each rank's in their original order. Exchange "
    "the counts first with dist.all_to_all_single (how many tokens you send each rank, and so "
    "how many each sends you), then the tokens with a second all_to_all_single and those uneven "
    "split sizes",
    DISPATCH_CASES, _dispatch_expected,
    inputs=_dispatch_inputs,
    rules=(Only("all_to_all_single",
                text="use dist.all_to_all_single only (no point-to-point, no other collective)"),
           CountsThenTokens("call all_to_all_single twice: first the counts, then the tokens")))

# --- ring attention -----------------------------------------------------------------------------


MERGE_CASES = [(0, (4, 2), 3, 2, 1.0, None), (1, (4, 2), 2, 3, 1.0, "b"),
               (2, (4, 2), 3, 3, 1000.0, None), (3, (2, 3, 2), 2, 2, 300.0, "a")]
# (seed, (..., queries, head_dim), keys in set a, keys in set b, scale of the scores,
#  which set hides every other query's keys entirely, if any)


def _merge_scores(seed, shape, keys_a, keys_b, scale, hidden_in):
    """float64 scores of seeded queries against both key sets (a's keys first), times `scale`
    (1000: scores in the thousands, whose exp overflows even in float64), -inf where a query
    may not see a key (`hidden_in`: odd queries see none of that set's keys), and the values."""
    *leading, queries, head_dim = shape
    q = seeded_randn(seed * 3, *shape).double() * scale
    k, v = (seeded_randn(seed * 3 + i, *leading, keys_a + keys_b, head_dim).double()
            for i in (1, 2))
    scores = q @ k.transpose(-2, -1)
    hidden = scores.new_zeros(scores.shape).bool()
    if hidden_in is not None:
        keys = slice(None, keys_a) if hidden_in == "a" else slice(keys_a, None)
        hidden[..., 1::2, keys] = True
    return scores.masked_fill(hidden, float("-inf")), v


def _attention_over(scores, v):
    """(out, lse) from scores and values, directly; a row with no visible key: (0, -inf)."""
    lse = scores.logsumexp(dim=-1)
    weights = (scores - lse.unsqueeze(-1)).exp().nan_to_num(0.0)
    return weights @ v, lse


def _merge_inputs(seed, shape, keys_a, keys_b, scale, hidden_in):
    """The partial results over key set a and over key set b: out_a, lse_a, out_b, lse_b."""
    scores, v = _merge_scores(seed, shape, keys_a, keys_b, scale, hidden_in)
    return (*_attention_over(scores[..., :keys_a], v[..., :keys_a, :]),
            *_attention_over(scores[..., keys_a:], v[..., keys_a:, :]))


def _merge_expected(*case):
    """Attention over both key sets at once: what the merge must reproduce."""
    return _attention_over(*_merge_scores(*case))


EXERCISES["online_softmax_merge"] = Exercise(
    "merge two partial attention results over disjoint sets of keys, (out_a, lse_a) and "
    "(out_b, lse_b), into the result over both sets: out (..., queries, head_dim) is the "
    "softmax-weighted sum of values, lse (..., queries) the log-sum-exp of the scores; return "
    "(out, lse). A row may see no key of one set (its lse is -inf and its out 0; never of both), "
    "and scores may be in the thousands, where exp overflows even in float64",
    MERGE_CASES, _merge_expected, inputs=_merge_inputs, distributed=False,
    names=("the merged out", "the merged lse"))

RING_CASES = [(2, (0, 1, 2, 4, 8)), (3, (1, 2, 1, 3, 4)), (4, (2, 1, 3, 2, 8)),
              (4, (3, 2, 2, 5, 4))]  # (seed, batch, heads, block, head_dim)


def _ring_inputs(rank, world_size, seed, batch, heads, block, head_dim):
    """Rank r's q, k, v: positions r * block .. (r + 1) * block - 1 of one seeded sequence."""
    whole = ring.attention_inputs(seed, batch, heads, block * world_size, head_dim)
    return tuple(x[..., rank * block:(rank + 1) * block, :] for x in whole)


def _ring_expected(rank, world_size, seed, batch, heads, block, head_dim):
    """Rank r's positions of causal attention over the whole sequence, in one process."""
    q, k, v = ring.attention_inputs(seed, batch, heads, block * world_size, head_dim)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)[
        ..., rank * block:(rank + 1) * block, :]


EXERCISES["ring_attention_forward"] = Exercise(
    "ring attention, forward: you hold q, k, v of your positions of the sequence, rank r the "
    "r-th block of `block` positions, each (batch, heads, block, head_dim); return your "
    "positions' causal attention over the whole sequence, equal to "
    "F.scaled_dot_product_attention(q, k, v, is_causal=True) on it (scores scaled by "
    "1/sqrt(head_dim)). The K/V blocks go around the ring: at each of N steps compute your q "
    "against the K/V block you hold (your own one first; skip a block from later positions; "
    "mask the future inside your own) and merge the result into your running one (out, lse) "
    "with online_softmax_merge, and pass the block you hold on to rank + 1 (mod N) while "
    "receiving the next from rank - 1: start that transfer (isend, irecv) before you compute, "
    "wait for it after. Send K and V stacked into one tensor, N - 1 times in all",
    RING_CASES, _ring_expected, inputs=_ring_inputs,
    hint="is every block from later positions skipped, the future inside your own block masked "
         "(on the diagonal only), and each block's result merged with online_softmax_merge?",
    rules=(Only("isend", "irecv", "batch_isend_irecv",
                text="use isend and irecv (or batch_isend_irecv) only: no blocking send or "
                     "recv, no collective"),
           SendsTo(lambda rank, n, *case: [(rank + 1) % n] * (n - 1),
                   text="each rank passes the K/V it holds to rank + 1 (mod N), K and V in one "
                        "tensor, once per step but the last: N - 1 times",
                   who="the ring"),
           OverlapsCompute(text="start each transfer (isend, irecv) before you compute, wait "
                                "for it after")), points=2)
