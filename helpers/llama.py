"""A Llama 3 model of the course's own: RMSNorm, rotary position embeddings, grouped-query attention
through PyTorch's scaled_dot_product_attention, and a SwiGLU MLP (Grattafiori et al., "The Llama 3
Herd of Models", 2024, section 3.2 and Table 3: a vocabulary of 128,000 tokens, to which the
released tokenizer adds 256 special ones, 128,256 in torchtitan's configurations; the module names
are those of pytorch/torchtitan@9dec370, torchtitan/models/llama/model.py). No biases, no dropout,
untied input and output embeddings. Lesson 11 measures what one block keeps for backward against the
projection's count.

`init_weights(model, seed=0)` is torchtitan's Llama initialisation (pytorch/torchtitan@9dec370,
torchtitan/models/llama/model.py, `init_weights` with depth_init): the token embedding N(0, 1),
the projections into attention and the MLP (wq, wk, wv, w1) a normal of std 0.02 truncated at ±2,
those out of them (wo, w2) and w3 std 0.02 / sqrt(2 (layer + 1)), the output head std dim^-1/2
truncated at ±3 std, the norms' weights ones. Each parameter is drawn whole, on the CPU, from a
generator seeded by `seed` and the parameter's name, and each rank keeps its own piece of it
(`distribute_tensor` with src_data_rank=None: no communication): the same weights under every
layout, one parameter's memory at a time (lesson 13 builds a model so, on the meta device).
"""

from __future__ import annotations

import functools
import math
import zlib
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


def _depth(name: str) -> int:
    """The block index in a parameter name "layers.7.attention.wo.weight"."""
    return int(name.split(".")[1])


def initial_value(name: str, shape: torch.Size, dim: int, seed: int = 0) -> torch.Tensor:
    """The whole initial value of the Llama parameter `name`, drawn from its own generator."""
    generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    value = torch.empty(shape)
    if name.endswith("norm.weight"):
        return value.fill_(1.0)
    if name == "tok_embeddings.weight":
        return nn.init.normal_(value, generator=generator)
    if name == "output.weight":
        std = dim ** -0.5
        return nn.init.trunc_normal_(value, std=std, a=-3 * std, b=3 * std, generator=generator)
    if name.endswith(("wo.weight", "w2.weight", "w3.weight")):
        std = 0.02 / math.sqrt(2 * (_depth(name) + 1))
        return nn.init.trunc_normal_(value, std=std, generator=generator)
    return nn.init.trunc_normal_(value, std=0.02, generator=generator)  # wq, wk, wv, w1


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every parameter of a Llama its initial value (whole, or this rank's piece of it, for a
    DTensor laid out on a mesh). Returns the model."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, parameter in model.named_parameters():
        value = initial_value(name, parameter.shape, model.shape.dim, seed)
        if isinstance(parameter, DTensor):
            value = distribute_tensor(value, parameter.device_mesh, parameter.placements,
                                      src_data_rank=None)
        parameter.copy_(value)
    return model


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
