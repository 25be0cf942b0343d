"""Ring attention (context parallelism): causal attention over a sequence cut among the ranks
(notebooks/10_composing.ipynb).

Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(2023, arXiv:2310.01889). The sequence is cut along its length: each of the N ranks holds the
queries, keys and values of its own positions, each (batch, heads, block, head_dim). A query
needs every earlier key, so the K/V blocks travel around the ring:

    step s = 0 .. N-1: rank r holds the K/V block that started on rank (r - s) mod N.
      1. it starts passing that block on (isend to r + 1, irecv of the next one from r - 1),
      2. computes its queries against the block it holds, while the transfer runs,
      3. merges that partial result into its running one, and waits for the transfer.
    each K/V block makes N - 1 hops; after N steps every rank has seen every key block and holds
    the causal attention output of its own positions (and their log-sum-exp).

The merge is the online softmax (Milakov & Gimelshein, "Online normalizer calculation for
softmax", 2018, arXiv:1805.02867; FlashAttention, Dao et al. 2022, merges its blocks the same
way, with a running maximum and sum). A partial
result over some keys is `out` (the softmax-weighted values over those keys) and `lse` (the
log-sum-exp of their scores); two of them combine into the result over both key sets:

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

without exponentiating anything larger than 0 (logaddexp subtracts the maximum first).

Causal masking makes the work uneven. With the `contiguous` layout rank r holds block r, and
its queries see r + 1 blocks: the last rank computes N blocks to the first rank's one, and
about 2N - 1 times as many (query, key) pairs that the mask leaves visible.
The `zigzag` layout cuts the sequence into 2N chunks and gives rank r chunks r and 2N - 1 - r,
one early and one late, so every rank computes the same amount. This is the layout of
Megatron-LM's context parallelism (`get_batch_on_this_cp_rank`, megatron/core/utils.py:
"chunk_0 and chunk_3 are assigned to GPU0, chunk_1 and chunk_2 are assigned to GPU1") and of
`zigzag_ring_flash_attn_func` in github.com/zhuzilin/ring-flash-attention.

Within a rank, every pair (query chunk i, key chunk j) is one of three cases: j < i, the keys
are all earlier, the whole block is visible; j == i, the diagonal block, causal inside; j > i,
all in the future: skipped, never computed.

The backward (ring_attention_backward) runs the ring once more: the K/V blocks go around again,
each followed by an accumulator of its gradients dK, dV, to which every rank adds its queries'
share; one last hop brings each accumulator home.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.reference import seeded_randn

LAYOUTS = ("contiguous", "zigzag")


def chunks_held(rank: int, world_size: int, layout: str) -> list[int]:
    """The sequence chunks that `rank` holds, in order: contiguous, chunk `rank` of N; zigzag,
    chunks `rank` and 2N - 1 - `rank` of 2N."""
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")


def num_chunks(world_size: int, layout: str) -> int:
    """How many chunks the sequence is cut into: N (contiguous) or 2N (zigzag)."""
    return world_size * len(chunks_held(0, world_size, layout))


def local_block(x: torch.Tensor, rank: int, world_size: int, layout: str) -> torch.Tensor:
    """Rank `rank`'s part of a whole-sequence tensor (..., seq, head_dim): its chunks, in order."""
    chunks = x.chunk(num_chunks(world_size, layout), dim=-2)
    return torch.cat([chunks[i] for i in chunks_held(rank, world_size, layout)], dim=-2)


def whole_sequence(blocks: list, layout: str) -> torch.Tensor:
    """The inverse of local_block: every rank's block (rank order) put back in sequence order."""
    world_size = len(blocks)
    placed = {}
    for rank, block in enumerate(blocks):
        held = chunks_held(rank, world_size, layout)
        placed |= dict(zip(held, block.chunk(len(held), dim=-2)))
    return torch.cat([placed[i] for i in range(len(placed))], dim=-2)


def attention_inputs(seed: int, batch: int, heads: int, seq_len: int, head_dim: int,
                     dtype=torch.float32):
    """Seeded q, k, v of one whole sequence, (batch, heads, seq_len, head_dim) each."""
    return tuple(seeded_randn(seed * 4 + i, batch, heads, seq_len, head_dim).to(dtype)
                 for i in range(3))


def output_gradient(seed: int, batch: int, heads: int, seq_len: int, head_dim: int,
                    dtype=torch.float32):
    """A seeded gradient of the attention output, for the backward (another draw than q, k, v)."""
    return seeded_randn(seed * 4 + 3, batch, heads, seq_len, head_dim).to(dtype)


def full_causal_attention(q, k, v):
    """The single-process reference: causal attention over the whole sequence."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def causal_mask(length: int) -> torch.Tensor:
    """True where a query (row) may see a key (column) of the same chunk: key <= query."""
    return torch.ones(length, length, dtype=torch.bool).tril()


def block_attention(q, k, v, mask=None):
    """Attention of a query block against one key/value block: (out, lse), out the
    softmax-weighted values, lse the log-sum-exp of the scores over these keys (scores scaled
    by 1/sqrt(head_dim), as F.scaled_dot_product_attention's). `mask` (queries x keys, True =
    visible) hides the future on the diagonal block; every row must see at least one key."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def online_softmax_merge(out_a, lse_a, out_b, lse_b):
    """Two partial attention results over disjoint key sets, (out, lse) each, merged into the
    result over both: lse = log(exp(lse_a) + exp(lse_b)), and each out weighted by its share
    exp(lse_x - lse) of the softmax's denominator. out: (..., queries, head_dim), lse:
    (..., queries). A row with lse = -inf (no visible key) gets weight 0, as long as the other
    side of that row has a visible key."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return weight_a * out_a + weight_b * out_b, lse


@dataclass
class RingAttentionResult:
    """One rank's part of ring attention: the output of its queries (batch, heads, block,
    head_dim) and their log-sum-exp (batch, heads, block); its work, per head and sequence: the
    (query, key) pairs it computed that the causal mask leaves visible, and the scores it
    computed (a diagonal block is computed whole, then half masked); and its compute seconds,
    CPU time of its thread (time.thread_time: time spent waiting for a core, or for a message,
    does not count)."""

    output: torch.Tensor
    logsumexp: torch.Tensor
    visible_pairs: int
    computed_scores: int
    compute_seconds: float


def pass_on(block, arriving, rank, world_size, tag=0):
    """Start sending `block` to rank + 1 and receiving the next one from rank - 1 (into
    `arriving`); the backward's two kinds of message differ by their tag."""
    return [dist.isend(block, dst=(rank + 1) % world_size, tag=tag),
            dist.irecv(arriving, src=(rank - 1) % world_size, tag=tag)]


def attend(partials, query_chunks, queries, key_chunks, kv):
    """Our query chunks against one visiting K/V block, each partial merged into `partials`
    (one (out, lse) or None per query chunk). Returns the visible (query, key) pairs and the
    scores computed."""
    keys, values = kv[0].chunk(len(key_chunks), dim=-2), kv[1].chunk(len(key_chunks), dim=-2)
    visible = computed = 0
    for index, (query_chunk, q) in enumerate(zip(query_chunks, queries)):
        for key_chunk, k, v in zip(key_chunks, keys, values):
            if key_chunk > query_chunk:
                continue  # every key in the future of every query: masked out, skipped
            mask = causal_mask(q.shape[-2]) if key_chunk == query_chunk else None
            partial = block_attention(q, k, v, mask)
            computed += q.shape[-2] * k.shape[-2]
            visible += int(mask.sum()) if mask is not None else q.shape[-2] * k.shape[-2]
            partials[index] = partial if partials[index] is None \
                else online_softmax_merge(*partials[index], *partial)
    return visible, computed


def ring_attention(q, k, v, layout: str = "contiguous") -> RingAttentionResult:
    """Causal attention over a sequence cut among the ranks (the steps at the top of this file).

    Before: each rank holds q, k, v of its own positions (local_block of the whole sequence,
    for `layout`). After: it holds their output, equal to its local_block of
    full_causal_attention of the whole sequence. Each rank sends N - 1 messages, all to
    rank + 1: K and V stacked into one tensor."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    query_chunks = chunks_held(rank, world_size, layout)
    queries = q.chunk(len(query_chunks), dim=-2)
    partials = [None] * len(query_chunks)
    kv = torch.stack((k, v))  # the block that travels: one message per step
    visible = computed = 0
    seconds = 0.0
    for step in range(world_size):
        last = step == world_size - 1
        if not last:  # the next block's transfer starts before we compute on this one
            kv_next = torch.empty_like(kv)
            transfers = pass_on(kv, kv_next, rank, world_size)
        source = (rank - step) % world_size  # whose K/V we hold at this step
        started = time.thread_time()
        work = attend(partials, query_chunks, queries, chunks_held(source, world_size, layout),
                       kv)
        visible, computed = visible + work[0], computed + work[1]
        seconds += time.thread_time() - started
        if not last:
            for transfer in transfers:
                transfer.wait()
            kv = kv_next
    output = torch.cat([out for out, _ in partials], dim=-2)
    lse = torch.cat([lse for _, lse in partials], dim=-1)
    return RingAttentionResult(output, lse, visible, computed, seconds)


def _block_gradients(q, k, v, grad_out, lse, delta, mask):
    """The backward of one (query block, key block) pair, as FlashAttention-2's (Dao, 2023): the
    probabilities recomputed from the scores and the saved lse, P = exp(S - lse); with
    delta = rowsum(dO * O): dV = P^T dO, dS = P * (dO V^T - delta), dQ = dS K / sqrt(d),
    dK = dS^T Q / sqrt(d). Returns this pair's (dq, dk, dv)."""
    scale = q.shape[-1] ** -0.5
    scores = q @ k.transpose(-2, -1) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    grad_scores = probs * (grad_out @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return grad_scores @ k * scale, grad_scores.transpose(-2, -1) @ q * scale, \
        probs.transpose(-2, -1) @ grad_out


def _attend_backward(saved, query_chunks, key_chunks, kv, grad_q):
    """Our query chunks' gradients against one visiting K/V block: dQ added into `grad_q`
    (one per query chunk), the block's dK and dV returned, stacked as K and V travel."""
    grad_kv = torch.zeros_like(kv)
    blocks = [x.chunk(len(key_chunks), dim=-2) for x in (*kv, *grad_kv)]  # views: += lands
    for index, query_chunk in enumerate(query_chunks):
        q, grad_out, lse, delta = saved[index]
        for key_chunk, k, v, grad_k, grad_v in zip(key_chunks, *blocks):
            if key_chunk > query_chunk:
                continue
            mask = causal_mask(k.shape[-2]) if key_chunk == query_chunk else None
            dq, dk, dv = _block_gradients(q, k, v, grad_out, lse, delta, mask)
            grad_q[index] += dq
            grad_k += dk
            grad_v += dv
    return grad_kv


def ring_attention_backward(q, k, v, output, lse, grad_output, layout: str = "contiguous"):
    """The backward of ring_attention: the same ring, run once more.

    Before: each rank holds q, k, v, the output and log-sum-exp of its positions (from the
    forward) and the gradient of that output. The K/V blocks go around as in the forward
    (N - 1 sends); behind each travels an accumulator of its gradients dK, dV: at every step a
    rank adds its queries' share to the block it holds, sends the accumulator on to rank + 1
    once it has it, and the last step's send brings each accumulator home (N sends). After:
    (dq, dk, dv) of its own positions, equal to autograd's through full causal attention."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    query_chunks = chunks_held(rank, world_size, layout)
    pieces = len(query_chunks)
    delta = (grad_output * output).sum(dim=-1)
    saved = list(zip(q.chunk(pieces, dim=-2), grad_output.chunk(pieces, dim=-2),
                     lse.chunk(pieces, dim=-1), delta.chunk(pieces, dim=-1)))
    grad_q = [torch.zeros_like(chunk) for chunk in q.chunk(pieces, dim=-2)]
    kv, arriving = torch.stack((k, v)), None  # arriving: the held block's accumulator, in transit
    for step in range(world_size):
        last = step == world_size - 1
        if not last:
            kv_next = torch.empty_like(kv)
            transfers = pass_on(kv, kv_next, rank, world_size, tag=0)
        source = (rank - step) % world_size
        grad_kv = _attend_backward(saved, query_chunks, chunks_held(source, world_size, layout),
                                   kv, grad_q)
        if arriving is not None:  # add what the ranks before us gave this block
            received, in_transit = arriving
            for transfer in in_transit:
                transfer.wait()
            grad_kv += received
        received = torch.empty_like(grad_kv)
        arriving = received, pass_on(grad_kv, received, rank, world_size, tag=1)
        if not last:
            for transfer in transfers:
                transfer.wait()
            kv = kv_next
    for transfer in arriving[1]:
        transfer.wait()
    return torch.cat(grad_q, dim=-2), arriving[0][0], arriving[0][1]


def visible_pairs_formula(rank: int, world_size: int, seq_len: int, layout: str) -> int:
    """The (query, key) pairs a rank's queries see under the causal mask, in closed form.
    Contiguous, block b = S/N: rank r's queries r b .. r b + b - 1 see r b + 1 .. r b + b keys,
    b^2 r + b(b+1)/2 in all. Zigzag, chunk c = S/2N: chunks r and 2N-1-r give
    c^2 (2N - 1) + c(c+1), the same on every rank."""
    if layout == "contiguous":
        block = seq_len // world_size
        return block * block * rank + block * (block + 1) // 2
    chunk = seq_len // num_chunks(world_size, layout)
    return chunk * chunk * (2 * world_size - 1) + chunk * (chunk + 1)


def computed_scores_formula(rank: int, world_size: int, seq_len: int, layout: str) -> int:
    """The scores a rank computes when every diagonal block is computed whole. Contiguous: r + 1
    blocks of b^2. Zigzag: its own K/V gives its 2 diagonal chunks and the late query chunk
    against the early key chunk, every other rank's K/V 2 chunk pairs (both query chunks
    against the earlier key chunk, or the late query chunk against both): (2N + 1) c^2."""
    if layout == "contiguous":
        return (rank + 1) * (seq_len // world_size) ** 2
    chunk = seq_len // num_chunks(world_size, layout)
    return (2 * world_size + 1) * chunk * chunk


# --- the workers (lesson 10's notebook and tests run them) --------------------------------------

def ring_attention_worker(rank, world_size, seed, shape, layout, dtype=torch.float64):
    """Ring attention (above) on seeded inputs: every rank draws the
    whole sequence's q, k, v, `shape` = (batch, heads, seq_len, head_dim), from `seed` (nothing
    large travels to the ranks), keeps its own positions under `layout`, and runs the ring.
    Returns its RingAttentionResult: its block of the output and of the log-sum-exp, the
    visible (query, key) pairs it computed, and its compute seconds."""
    q, k, v = (local_block(x, rank, world_size, layout)
               for x in attention_inputs(seed, *shape, dtype=dtype))
    dist.barrier()  # every rank starts the ring together: the seconds are its compute's
    return ring_attention(q, k, v, layout)


def ring_attention_backward_worker(rank, world_size, seed, shape, layout, dtype=torch.float64):
    """Ring attention's forward, then its backward (ring_attention_backward) for a seeded
    gradient of the whole sequence's output, of which each rank keeps its positions. Returns
    this rank's gradients of its q, k and v, {"q": ..., "k": ..., "v": ...}."""
    q, k, v, grad_output = (
        local_block(x, rank, world_size, layout)
        for x in (*attention_inputs(seed, *shape, dtype=dtype),
                  output_gradient(seed, *shape, dtype=dtype)))
    result = ring_attention(q, k, v, layout)
    grads = ring_attention_backward(q, k, v, result.output, result.logsumexp, grad_output,
                                         layout)
    return dict(zip("qkv", grads))
