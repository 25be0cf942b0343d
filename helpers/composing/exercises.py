"""Lesson 10's exercises, checked by `helpers.exercises.check(name, your_function)`."""

import torch
import torch.nn.functional as F

from helpers.composing import ring_attention as ring
from helpers.exercises import Exercise
from helpers.reference import seeded_randn
from helpers.rules import Only, Rule, SendsTo

EXERCISES = {}

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
    rules=(Only("isend", "irecv", "batch_isend_irecv",
                text="use isend and irecv (or batch_isend_irecv) only: no blocking send or "
                     "recv, no collective"),
           SendsTo(lambda rank, n, *case: [(rank + 1) % n] * (n - 1),
                   text="each rank passes the K/V it holds to rank + 1 (mod N), K and V in one "
                        "tensor, once per step but the last: N - 1 times",
                   who="the ring")))
