"""The activations a rank keeps for backward: measured from the tensors autograd saves, and by
formula (lesson 08).

The paper's accounting (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", arXiv:2205.05198, Table 2), per transformer layer, in bytes, for 16-bit
activations, 1-byte dropout masks and attention scores kept (s sequence, b batch, h hidden,
a heads, t tensor-parallel ranks):
    no parallelism                  sbh (34 + 5as/h)
    tensor parallel                 sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel      sbh (34/t + 5as/(ht))
The 10 is what tensor parallelism leaves whole on every rank: the LayerNorms' inputs, the inputs
of the first linear layers of attention and MLP, and the dropout masks.

The course's block (helpers.reference.Block) keeps 32-bit activations, has no dropout, and its
attention (scaled_dot_product_attention on the CPU) keeps no s x s scores, so `block_formula`
counts its own tensors the same way: elements of (b, s, h) that each operation saves, times 4.
"""

from __future__ import annotations

# Tensors of b x s x h elements that the course's Block saves for backward, by where they are.
# Outside the parallel regions (whole on every rank without sequence parallelism):
OUTSIDE = {"norm1's input (the block's input)": 1, "q, k, v's input (norm1's output)": 1,
           "norm2's input": 1, "up's input (norm2's output)": 1}
# Inside (1/t on each rank): attention's q, k, v and its output (which is also out's input: the
# CPU kernel lays it out so that merging the heads needs no copy), GeLU's input and down's
# input (4h wide each).
INSIDE = {"attention's q, k, v": 3, "attention's output (out's input)": 1, "GeLU's input": 4,
          "down's input": 4}
# Of the inputs outside, sequence parallelism shards the LayerNorms' (the block's and the
# residual's): the inputs of q, k, v and of up are gathered, and kept whole by this course's
# layers (Megatron keeps only the shard and gathers it again in backward, §4.2.2).
GATHERED = {"q, k, v's input (norm1's output)", "up's input (norm2's output)"}


def paper_formula(s: int, b: int, h: int, a: int, t: int = 1,
                  sequence_parallel: bool = False) -> float:
    """Bytes of activations per layer per rank, Korthikanti et al. 2022, Table 2."""
    scores = 5 * a * s / (h * t)
    if sequence_parallel:
        return s * b * h * (34 / t + scores)
    return s * b * h * (10 + 24 / t + scores)


def block_formula(s: int, b: int, h: int, a: int, t: int = 1,
                  sequence_parallel: bool = False) -> dict:
    """Bytes this course's Block keeps per rank, by part: {'outside', 'inside', 'statistics'}.

    statistics: each LayerNorm's mean and 1/std (b s each), and attention's log-sum-exp (b a s),
    4 bytes each; with sequence parallelism the LayerNorms see s/t tokens."""
    sbh = s * b * h
    shard = t if sequence_parallel else 1
    outside = sum(count * sbh / (1 if sequence_parallel and name in GATHERED else shard)
                  for name, count in OUTSIDE.items())
    inside = sum(INSIDE.values()) * sbh / t
    statistics = 2 * 2 * b * s / shard + b * a * s / t
    return {"outside": 4 * outside, "inside": 4 * inside, "statistics": 4 * statistics}
