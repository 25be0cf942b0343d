"""A Llama 3 model of the course's own: RMSNorm, rotary position embeddings, grouped-query attention
through PyTorch's scaled_dot_product_attention, and a SwiGLU MLP (Grattafiori et al., "The Llama 3
Herd of Models", 2024, section 3.2 and Table 3: a vocabulary of 128,000 tokens, to which the
released tokenizer adds 256 special ones, 128,256 in torchtitan's configurations; the module names
are those of pytorch/torchtitan@9dec370, torchtitan/models/llama/model.py). No biases, no dropout,
untied input and output embeddings. Lesson 11 measures what one block keeps for backward against the
projection's count.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shape:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0  # Llama 3's base frequency (the paper, section 3.2)
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def swiglu_hidden(dim: int, multiple_of: int, multiplier: float) -> int:
    """torchtitan's compute_ffn_hidden_dim, as its llama3 configs call it: int(multiplier
    int(2 4 dim / 3)) rounded up to a multiple of `multiple_of`."""
    hidden = int(multiplier * int(2 * 4 * dim / 3))
    return multiple_of * math.ceil(hidden / multiple_of)


def rotary(seq_len: int, head_dim: int, theta: float, dtype=torch.float32,
           device=None) -> tuple:
    """(cos, sin), each seq_len x head_dim: position p turns the pair (i, i + head_dim / 2) by
    p theta^(-2i / head_dim)."""
    frequencies = theta ** (-torch.arange(0, head_dim, 2, device=device) / head_dim)
    angles = torch.arange(seq_len, device=device)[:, None] * frequencies[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x, cos, sin):
    """Rotary position embedding of x (..., seq_len, head_dim)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.wq = nn.Linear(shape.dim, shape.dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.kv_dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.kv_dim, bias=False)
        self.wo = nn.Linear(shape.dim, shape.dim, bias=False)

    def forward(self, x, cos, sin):
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                             is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.attention_norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.attention = Attention(shape)
        self.ffn_norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.feed_forward = FeedForward(shape.dim, shape.ffn)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, shape: Shape, max_seq_len: int = 2048):
        super().__init__()
        self.shape, self.max_seq_len = shape, max_seq_len
        self.tok_embeddings = nn.Embedding(shape.vocab, shape.dim)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.output = nn.Linear(shape.dim, shape.vocab, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        cos, sin = rotary(tokens.shape[1], self.shape.head_dim, self.shape.rope_theta,
                          x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def kept_by_block(shape: Shape, batch: int, seq_len: int, dtype=torch.bfloat16) -> dict:
    """{kind: bytes} one block in `dtype` keeps for backward on this machine, for `batch`
    sequences of `seq_len` tokens: "per token" for what grows with the tokens, "float32 copies"
    for the (batch, seq_len, dim) float32 tensors torch's RMSNorm keeps when it computes a 16-bit
    input in float32 (on the CPU); the rotary tables, one per model, are left out."""
    from helpers.instrument import saved_activations, saved_bytes_by_kind

    block = Block(shape).to(dtype)
    cos, sin = rotary(seq_len, shape.head_dim, shape.rope_theta, dtype)
    x = torch.randn(batch, seq_len, shape.dim, dtype=dtype, requires_grad=True)
    tables = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}

    def classify(tensor):
        if tensor.untyped_storage().data_ptr() in tables:
            return None
        if (tensor.dtype == torch.float32 != dtype
                and tensor.numel() == batch * seq_len * shape.dim):
            return "float32 copies"
        return "per token"

    with saved_activations(block, classify) as saved:
        block(x, cos, sin)
    return saved_bytes_by_kind(saved)


@functools.cache  # (a meta model is built to count: the step-time model asks often)
def flops_per_token(shape: Shape, seq_len: int) -> int:
    """torchtitan's count of a Llama's FLOPs per token, forward and backward
    (get_num_flop_per_token, pytorch/torchtitan@9dec370, torchtitan/utils.py): 6 x the
    parameters other than the token embedding (a lookup), plus 12 x layers x heads x head_dim x
    seq_len for attention's two products, after PaLM (Chowdhery et al., 2022, appendix B);
    recomputation is not counted, nor causal attention's skipped half. Lessons 13 and 14 use it
    for MFU and step time."""
    with torch.device("meta"):
        model = Llama(shape)
    parameters = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    return 6 * parameters + 12 * shape.layers * shape.heads * shape.head_dim * seq_len
