"""The course's small models, their seeded weights and data, and the single-process training that
every parallel lesson is checked against.

A parallel strategy is right when it trains *these* models to the same losses and parameters as
`train` does in one process (`torch.testing.assert_close`). Everything here is seeded and runs the
same in the kernel and in any rank:

    seeded_randn(seed, *shape)              the course's one way to draw random numbers
    seeded(seed, build)                     build() with torch's RNG seeded, the caller's untouched
    make_mlp(dim, num_layers, seed)         the lecture's GELU MLP stack (CS336 lecture 8)
    make_lm(vocab, dim, heads, layers, ...) a tiny pre-norm transformer language model
    make_block(dim, heads, seed)            one of its blocks
    mlp_data(...), lm_data(...)             seeded batches, one per training step
    train(model, batches, loss_fn, ...)     the single-process reference: losses and parameters
    gradients(model, batch, loss_fn)        one forward and backward: every parameter's gradient
    in_float64(model, batches)              the same model and data in float64, for comparisons
                                            of whole training runs (helpers.tolerance says why)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def seeded_randn(seed: int, *shape: int) -> torch.Tensor:
    """Standard normal numbers from their own generator: the same tensor for the same seed, in
    every process, whatever else has drawn random numbers before."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def seeded(seed: int, build):
    """Build a module with torch's global RNG set to `seed`, leaving the caller's RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class MLP(nn.Module):
    """`num_layers` times (Linear(dim, dim), then GELU): the lecture's MLP stack, as modules.

    The lecture multiplies by bare matrices (`x @ param`); `nn.Linear(dim, dim, bias=False)` is
    the same computation with the transposed matrix, and a name for every parameter."""

    def __init__(self, dim: int, num_layers: int, bias: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=bias) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x


def make_mlp(dim: int = 16, num_layers: int = 4, seed: int = 0, bias: bool = False) -> MLP:
    """An MLP whose weights depend only on `seed` (every layer different)."""
    return seeded(seed, lambda: MLP(dim, num_layers, bias))


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v projections.

    The head count is read from the projections' width (`view(..., -1, head_dim)`), so the same code
    runs on a tensor-parallel shard that holds only some of the heads.

    k has no bias: a bias on k adds the same q . b to every score of a row, which softmax ignores,
    so its gradient would be rounding noise, and Adam, which divides by the gradient's own size,
    would turn that noise into full-size steps that differ between any two ways of computing it."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), \
            nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        batch, seq, _ = x.shape

        def split_heads(t):
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q, k, v = split_heads(self.q(x)), split_heads(self.k(x)), split_heads(self.v(x))
        attended = self.core(q, k, v)
        return self.out(attended.transpose(1, 2).reshape(batch, seq, -1))

    def core(self, q, k, v):
        """softmax(q k^T / sqrt(head_dim)) v with the causal mask, per head: the attention
        core, which selective recomputation recomputes (lesson 11)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class FeedForward(nn.Module):
    """Linear(dim, 4 dim), GELU, Linear(4 dim, dim): the MLP of a transformer block."""

    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(norm(x)), then + feed-forward(norm(x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.attention = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.feed_forward = nn.LayerNorm(dim), FeedForward(dim)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.feed_forward(self.norm2(x))


def make_block(dim: int = 32, heads: int = 4, seed: int = 0) -> Block:
    """A Block whose weights depend only on `seed`."""
    return seeded(seed, lambda: Block(dim, heads))


class TinyLM(nn.Module):
    """Token and position embeddings, `layers` blocks, a final norm, and a head to the vocabulary.
    With `tie_weights` the head uses the token embedding's matrix (one parameter, two uses)."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_seq_len: int,
                 tie_weights: bool = False):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, dim)
        self.position_embedding = nn.Embedding(max_seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie_weights:
            self.head.weight = self.token_embedding.weight

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_lm(vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2,
            max_seq_len: int = 16, seed: int = 0, tie_weights: bool = False) -> TinyLM:
    """A TinyLM whose weights depend only on `seed`."""
    return seeded(seed, lambda: TinyLM(vocab, dim, heads, layers, max_seq_len, tie_weights))


@dataclass
class Batch:
    inputs: torch.Tensor
    targets: torch.Tensor

    def shard(self, rank: int, world_size: int) -> Batch:
        """Rank `rank`'s contiguous slice of the batch (dimension 0), as a data-parallel rank
        would load it. The batch size must divide by `world_size`."""
        size = self.inputs.shape[0]
        if size % world_size:
            raise ValueError(f"a batch of {size} does not split evenly over {world_size} ranks")
        local = size // world_size
        rows = slice(rank * local, (rank + 1) * local)
        return Batch(self.inputs[rows], self.targets[rows])

    def to(self, device) -> Batch:
        """The batch on `device` (the launcher's get_device(): a rank's GPU under NCCL)."""
        return Batch(self.inputs.to(device), self.targets.to(device))


def mlp_data(seed: int = 0, batch_size: int = 8, dim: int = 16, steps: int = 1) -> list:
    """`steps` batches of regression data: inputs x ~ N(0, 1), targets sin(x)."""
    batches = []
    for step in range(steps):
        inputs = seeded_randn(seed * 1000 + step, batch_size, dim)
        batches.append(Batch(inputs, torch.sin(inputs)))
    return batches


def lm_data(seed: int = 0, batch_size: int = 8, seq_len: int = 16, vocab: int = 64,
            steps: int = 1) -> list:
    """`steps` batches of token sequences that count up, each from its own start and with its own
    stride (1 to 3), modulo `vocab`: a pattern a tiny model learns in a few steps. The targets are
    the inputs shifted by one token."""
    batches = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(seed * 1000 + step)
        start = torch.randint(vocab, (batch_size, 1), generator=generator)
        stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
        tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
        batches.append(Batch(tokens[:, :-1], tokens[:, 1:]))
    return batches


def in_float64(model: nn.Module, batches: list) -> tuple:
    """A float64 copy of `model` and `batches` (token ids stay integers): the same weights and
    data with rounding 2**29 times finer, where AdamW's amplification of rounding stays far below
    any tolerance (helpers.tolerance)."""
    def widened(tensor):
        return tensor.double() if tensor.is_floating_point() else tensor

    return (copy.deepcopy(model).double(),
            [Batch(widened(batch.inputs), widened(batch.targets)) for batch in batches])


def mse_loss(outputs, targets):
    return F.mse_loss(outputs, targets)


def lm_loss(logits, targets):
    """Cross-entropy of the next token, averaged over every position of every sequence."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# The learning rate every lesson trains with, unless it says otherwise.
LR = 1e-2
# name -> (class, settings): a class and its settings, for code that builds its own inner
# optimizer (lesson 07's ShardedOptimizer, PyTorch's ZeroRedundancyOptimizer)
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"weight_decay": 0.01}),
    "sgd": (torch.optim.SGD, {"momentum": 0.9}),
}


def make_optimizer(name: str, params, lr: float = LR) -> torch.optim.Optimizer:
    """The course's optimizers: AdamW (weight decay 0.01) and SGD (momentum 0.9)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {list(OPTIMIZERS)}")
    optimizer_class, settings = OPTIMIZERS[name]
    return optimizer_class(params, lr=lr, **settings)


@dataclass
class TrainingRun:
    losses: list  # one float per step
    parameters: dict  # name -> tensor after the last step (a copy)
    optimizer: dict  # name -> the optimizer's state of that parameter after the last step (copies)

    def losses_by_step(self) -> dict:
        """{step: loss}, the steps counted from 1, as a training loop that resumes counts them."""
        return dict(enumerate(self.losses, start=1))


def train(model: nn.Module, batches: list, loss_fn, optimizer: str = "adamw",
          lr: float = LR, *, max_grad_norm: float | None = None, scheduler=None,
          slices: int = 1) -> TrainingRun:
    """The single-process reference, every lesson's: one step per batch (forward, loss,
    backward, optimizer step) on a copy of `model`, which is left as it was. (The capstone's
    reference, with validation, micro-batches and autocast, is its own:
    helpers.capstone.train.one_process.)

    - `max_grad_norm`: clip the gradient to this global norm before each step
      (torch.nn.utils.clip_grad_norm_).
    - `scheduler(optimizer)`: a learning-rate scheduler, stepped after each step.
    - `slices` = n: data parallelism computed in one process: each step, every rank's slice of
      the batch goes through the model, the slices' gradients are summed (in the parameters'
      dtype) and divided by n; the loss is the slices' mean. With float32 compute this is the
      whole batch's step; with a low-precision model (with_compute_dtype) each slice's gradient
      is rounded as a rank's would be, which a step on the whole batch does not reproduce."""
    model = copy.deepcopy(model)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    schedule = scheduler(opt) if scheduler is not None else None
    losses = []
    for batch in batches:
        opt.zero_grad()
        losses.append(_backward(model, batch, loss_fn, slices))
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        if schedule is not None:
            schedule.step()
    names = {param: name for name, param in model.named_parameters()}
    return TrainingRun(losses, parameters(model),
                       {names[param]: {key: value.clone() for key, value in state.items()}
                        for param, state in opt.state.items()})


def _backward(model: nn.Module, batch: Batch, loss_fn, slices: int) -> float:
    """One step's backward, on the whole batch or slice by slice; the loss."""
    if slices == 1:
        loss = loss_fn(model(batch.inputs), batch.targets)
        loss.backward()
        return loss.item()
    total = 0.0
    for rank in range(slices):
        local = batch.shard(rank, slices)
        loss = loss_fn(model(local.inputs), local.targets)
        loss.backward()
        total += loss.item() / slices
    for param in model.parameters():
        if param.grad is not None:
            param.grad /= slices
    return total


def gradients(model: nn.Module, batch: Batch, loss_fn) -> dict:
    """Every parameter's gradient after one forward and backward of `batch` (on a copy)."""
    model = copy.deepcopy(model)
    loss_fn(model(batch.inputs), batch.targets).backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def parameters(model: nn.Module) -> dict:
    """name -> a detached copy of every parameter (tied parameters appear once)."""
    return {name: param.detach().clone() for name, param in model.named_parameters()}


class _CastLinear(nn.Linear):
    """An nn.Linear that computes in `compute_dtype`: weight, bias and input cast, output cast
    back; autograd brings the gradients back to the float32 parameters."""

    def forward(self, x):
        dtype = self.compute_dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.weight.to(dtype), bias).to(x.dtype)


class _CastEmbedding(nn.Embedding):
    """An nn.Embedding that looks up in its table cast to `compute_dtype`; float32 output."""

    def forward(self, ids):
        return F.embedding(ids, self.weight.to(self.compute_dtype)).float()


def with_compute_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` whose Linears and Embeddings compute in `dtype` (bfloat16, float16) while
    their parameters stay float32: the single-process twin of mixed-precision sharded training.
    Tied weights stay tied."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if type(module) in (nn.Linear, nn.Embedding):
            module.__class__ = _CastLinear if type(module) is nn.Linear else _CastEmbedding
            module.compute_dtype = dtype
    return model
