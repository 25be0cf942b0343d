"""The capstone's training run: a Llama (helpers.llama) learns to write Python from the standard
library's source (helpers.capstone.corpus), with everything the course taught at once.

- `Config`: the model's size, the layout (dp x tp ranks), and the recipe: recomputation,
  bfloat16, gradient accumulation (`micro_batches`), warmup then cosine learning rate, clipping
  by the global gradient norm, a DCP checkpoint every `save_every` steps. `Config.check()` says
  what is wrong before anything runs.
- `build(config, mesh)`: the model made on the meta device, laid out by the course's `lay_out`
  (helpers.layouts: tensor and sequence parallelism over "tp", recomputation, FSDP2 over "dp"),
  then given memory and torchtitan's initialisation: the same weights under every layout.
- `train_step(model, optimizer, scheduler, tokens, config)`: one step over this rank's share of
  the batch, in `config.micro_batches` parts; returns the loss and the gradients' norm.
- `train_worker(rank, world_size, config, directory=None, *, stop_after=None, on_event=None,
  stop=None)`: the loop. With a `directory` it resumes from the newest complete checkpoint
  there and saves every `config.save_every` steps and after the last; `stop_after` ends this
  run after that step; `on_event(what, step, history)` hears "started" (after the step it
  resumed from), each "step" and "saved" (a log, a progress bar, a kill); `stop(step)`, if
  given, is asked after every step, and True saves and ends the run (every rank must answer
  alike). Returns the run's `History`.
- `one_process(config, steps)`: the same recipe without any of the distribution, written again
  from PyTorch's own pieces (clip_grad_norm_, LambdaLR, AdamW): the reference a float64 run equals.
  The capstone's own, not helpers.reference.train: its point is the whole recipe (validation
  losses, micro-batches, the schedule, autocast's bfloat16) checked against one process.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from helpers.capstone.corpus import VOCAB, bits_per_byte, python_source
from helpers.checkpoints_and_failures.resume import checkpoint_path, keep_last, latest_checkpoint
from helpers.launcher.result import get_device
from helpers.layouts import Plan, clip_to_norm, lay_out, make_mesh
from helpers.llama import Llama, Shape, init_weights, swiglu_hidden
from helpers.timing import Clock, slowest, synchronize
from helpers.training import mean_over


@dataclass(frozen=True)
class Config:
    # the model: a Llama of the course's own, bytes in and out
    layers: int = 4
    dim: int = 128
    heads: int = 4
    kv_heads: int = 2
    seq_len: int = 256
    # the layout: dp x tp ranks
    dp: int = 2
    tp: int = 2
    # the recipe
    batch: int = 16  # sequences a step, the whole job's: each dp rank trains on batch / dp
    micro_batches: int = 2  # gradient accumulation: a rank's share in this many parts
    steps: int = 200
    lr: float = 3e-3  # the peak, after `warmup` steps; then a cosine down to lr x final_lr_share
    warmup: int = 20
    final_lr_share: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0  # the largest global gradient norm
    recompute: str = "op"  # layouts.apply_ac's mode for every block: "none", "op" or "full"
    bf16: bool = True  # FSDP2's mixed precision: bfloat16 compute, float32 gradient reduction
    float64: bool = False  # every weight and gradient in float64, for equality with one process
    save_every: int = 50  # steps between DCP checkpoints (0: none)
    keep: int = 2  # checkpoints kept
    eval_every: int = 25  # steps between validation losses (0: none)
    eval_sequences: int = 32
    seed: int = 0

    @property
    def shape(self) -> Shape:
        return Shape(layers=self.layers, dim=self.dim, heads=self.heads, kv_heads=self.kv_heads,
                     ffn=swiglu_hidden(self.dim, 64, 1.0), vocab=VOCAB)

    @property
    def plan(self) -> Plan:
        """The layout and one micro-batch as the course's `lay_out` takes them (helpers.layouts)."""
        return Plan(dp=self.dp, tp=self.tp, recompute=self.recompute, seq_len=self.seq_len,
                    micro_batch=max(1, self.batch // (self.dp * self.micro_batches)),
                    bf16=self.bf16)

    @property
    def ranks(self) -> int:
        return self.dp * self.tp

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    def check(self, world_size: int | None = None) -> None:
        """Raises ValueError, before anything runs, if this run cannot be laid out as asked."""
        if world_size is not None and world_size != self.ranks:
            raise ValueError(f"a mesh of dp {self.dp} x tp {self.tp} needs {self.ranks} ranks, "
                             f"not {world_size}")
        if self.batch % (self.dp * self.micro_batches):
            raise ValueError(f"a batch of {self.batch} sequences does not split into dp "
                             f"{self.dp} x {self.micro_batches} micro-batches")
        if self.eval_sequences % self.dp:
            raise ValueError(f"dp {self.dp} does not divide the {self.eval_sequences} "
                             "validation sequences")
        if self.bf16 and self.float64:
            raise ValueError("bf16 and float64 are two different precisions: choose one")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"a warmup of {self.warmup} steps leaves no room in {self.steps}")
        self.plan.check(self.shape)


# --- the recipe ---------------------------------------------------------------------------------

def lr_factor(config: Config, step: int) -> float:
    """The learning rate of step `step` (counted from 0) as a share of config.lr: a linear warmup
    up to 1 at step config.warmup - 1, then half a cosine down to config.final_lr_share at the
    last step, config.steps - 1."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    progress = (step - config.warmup + 1) / (config.steps - config.warmup)
    share = config.final_lr_share
    return share + (1 - share) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model, config: Config) -> tuple:
    """AdamW with Llama's betas and weight decay, and its warmup-then-cosine schedule."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, config))
    return optimizer, scheduler


def build(config: Config, mesh):
    """The model on the meta device, laid out on `mesh`, then given memory and its weights."""
    with torch.device("meta"):
        model = Llama(config.shape, max_seq_len=config.seq_len)
    if config.float64:
        model.double()
    lay_out(model, mesh, config.plan)  # TP over "tp", recomputation, FSDP2 over "dp"
    model.to_empty(device=get_device())
    return init_weights(model, seed=config.seed)  # the same weights whatever the layout


def whole(value) -> torch.Tensor:
    """A DTensor's whole value (a loss under loss_parallel is one), or the tensor itself."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def parallel_loss(config: Config):
    """With tensor parallelism the logits stay cut by the vocabulary, and the loss and its
    backward run inside loss_parallel (no rank ever holds them whole); else nothing."""
    return loss_parallel() if config.tp > 1 else contextlib.nullcontext()


def next_token_loss(model, tokens):
    """Cross-entropy of each next byte, on logits in float32 at least (bfloat16 ones upcast, as
    torchtitan does; float64 ones kept), inside parallel_loss."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(at_least_float32(logits.flatten(0, 1)), tokens[:, 1:].flatten())


def at_least_float32(tensor):
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def train_step(model, optimizer, scheduler, tokens, config: Config) -> tuple:
    """One step on this rank's sequences `tokens`, in config.micro_batches parts, gradients
    reduced over dp only after the last; then clipped, and AdamW's step at this step's rate.
    Returns (the mean loss of this rank's sequences, the global gradient norm before clipping)."""
    parts = tokens.chunk(config.micro_batches)
    loss_sum = 0.0
    for index, part in enumerate(parts):
        model.set_requires_gradient_sync(index == len(parts) - 1)  # accumulate, then reduce
        with parallel_loss(config):
            loss = next_token_loss(model, part) / len(parts)
            loss.backward()
        loss_sum += whole(loss.detach()).item()
    norm = clip_to_norm(model, config.clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss_sum, whole(norm).item()


@torch.no_grad()
def validation_loss(model, corpus, config: Config, mesh) -> float:
    """Bits per byte on config.eval_sequences held-out windows, the same at every evaluation;
    each dp rank computes its share, and the mean is taken over dp."""
    mine = validation_windows(corpus, config).chunk(config.dp)[dp_rank(mesh)].to(get_device())
    with parallel_loss(config):
        loss = whole(next_token_loss(model, mine)).item()
    return bits_per_byte(mean_over(loss, group=dp_group(mesh)))


def validation_windows(corpus, config: Config):
    """The held-out windows every validation loss is measured on: the same at every step."""
    return corpus.batch("validation", 0, config.eval_sequences, config.seq_len,
                        seed=config.seed + 1)


def dp_rank(mesh) -> int:
    return mesh["dp"].get_local_rank()


def dp_group(mesh):
    return mesh["dp"].get_group()


# --- checkpoints --------------------------------------------------------------------------------

class CheckpointMismatch(ValueError):
    """A checkpoint that holds another model than the one being trained."""


def training_state(model, optimizer, scheduler, step: int) -> dict:
    """What a checkpoint holds: model and optimizer by name (DTensors: each rank saves its
    pieces), the schedule's position and the step. The batches need nothing: a step's batch is
    drawn from its own seed (corpus.Corpus.batch)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(), "step": step}


def check_checkpoint(path: str, model) -> None:
    """Raises CheckpointMismatch unless the checkpoint at `path` holds every weight of `model`,
    whole shape for whole shape. (Another layout of the same model is fine: DCP reshards.)"""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    problems = []
    for name, parameter in model.named_parameters():
        key = f"model.{name}"
        if key not in saved:
            problems.append(f"{name} is not in it")
        elif tuple(saved[key].size) != tuple(parameter.shape):
            problems.append(f"{name} is {tuple(saved[key].size)} there, "
                            f"{tuple(parameter.shape)} here")
    if problems:
        raise CheckpointMismatch(f"{path} holds another model: " + "; ".join(problems[:3])
                                 + (f"; and {len(problems) - 3} more" if len(problems) > 3 else ""))


def resume(directory, model, optimizer, scheduler) -> int:
    """Load the newest complete checkpoint in `directory`, if any; returns its step (0: none)."""
    path, _ = latest_checkpoint(directory)
    if path is None:
        return 0
    check_checkpoint(path, model)
    state = training_state(model, optimizer, scheduler, 0)
    dcp.load(state, checkpoint_id=path)  # fills the tensors in place, replaces the plain values
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"]


def save(directory, model, optimizer, scheduler, step: int, keep: int) -> None:
    dcp.save(training_state(model, optimizer, scheduler, step),
             checkpoint_id=checkpoint_path(directory, step))
    if dist.get_rank() == 0:
        keep_last(directory, keep)


# --- the loop -----------------------------------------------------------------------------------

@dataclass
class History:
    """What a run did, the same on every rank: per step its loss (nats per byte, the whole
    batch's), learning rate, gradient norm before clipping and seconds (the slowest rank's);
    validation losses (bits per byte) by step; the step it started after (a resumed run: its
    checkpoint's); the whole weights at the end (rank 0 only, if asked)."""

    config: Config
    started_after: int = 0
    steps: dict = field(default_factory=dict)  # step: {"loss", "lr", "norm", "seconds"}
    validation: dict = field(default_factory=dict)  # step: bits per byte
    weights: dict | None = None

    def losses(self) -> dict:
        return {step: record["loss"] for step, record in self.steps.items()}


def train_worker(rank, world_size, config: Config, directory=None, *, stop_after=None,
                 on_event=None, stop=None, weights=False) -> History:
    config.check(world_size)
    corpus = python_source()
    mesh = make_mesh(config.plan)  # ("dp", "tp"), or ("dp",) without tensor parallelism
    model = build(config, mesh)
    optimizer, scheduler = make_optimizer(model, config)
    step = resume(directory, model, optimizer, scheduler) if directory else 0
    history = History(config, started_after=step)
    if config.eval_every and step == 0:
        history.validation[0] = validation_loss(model, corpus, config, mesh)
    on_event = on_event or (lambda what, step, history: None)
    on_event("started", step, history)
    clock = Clock()
    while step < min(config.steps, stop_after or config.steps):
        batch = corpus.batch("train", step, config.batch, config.seq_len, seed=config.seed)
        mine = batch.chunk(config.dp)[dp_rank(mesh)].to(get_device())  # tp ranks: the same
        lr, started = scheduler.get_last_lr()[0], clock()
        loss, norm = train_step(model, optimizer, scheduler, mine, config)
        synchronize()
        step += 1
        history.steps[step] = {"loss": mean_over(loss, group=dp_group(mesh)), "lr": lr,
                               "norm": norm, "seconds": slowest(clock() - started)}
        if config.eval_every and step % config.eval_every == 0:
            history.validation[step] = validation_loss(model, corpus, config, mesh)
        on_event("step", step, history)
        saving = bool(directory and config.save_every
                      and (step % config.save_every == 0 or step == config.steps))
        if saving:
            save(directory, model, optimizer, scheduler, step, config.keep)
            on_event("saved", step, history)
        if stop is not None and stop(step):  # every rank must give the same answer
            if directory and not saving:
                save(directory, model, optimizer, scheduler, step, config.keep)
                on_event("saved", step, history)
            break
    if weights:
        history.weights = whole_weights(model)
    return history


def whole_weights(model) -> dict:
    """Every weight whole, on the CPU, on rank 0 ({} elsewhere); every rank must call it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


# --- one process --------------------------------------------------------------------------------

def one_process(config: Config, steps: int | None = None) -> History:
    """The same training in this process, without meshes, FSDP or DTensor: the reference. Its
    bfloat16 is torch.autocast's (products in bfloat16 from float32 weights)."""
    config = replace(config, dp=1, tp=1)
    corpus = python_source()
    model = Llama(config.shape, max_seq_len=config.seq_len)
    model = init_weights(model.double() if config.float64 else model, seed=config.seed)
    optimizer, scheduler = make_optimizer(model, config)
    history = History(config)

    def loss_of(tokens):
        with torch.autocast("cpu", torch.bfloat16, enabled=config.bf16):  # CPU on purpose
            logits = model(tokens[:, :-1])
        return F.cross_entropy(at_least_float32(logits.flatten(0, 1)), tokens[:, 1:].flatten())

    def validate(step):
        if config.eval_every and step % config.eval_every == 0:
            with torch.no_grad():
                history.validation[step] = bits_per_byte(loss_of(validation_windows(
                    corpus, config)).item())

    validate(0)
    for step in range(config.steps if steps is None else steps):
        batch = corpus.batch("train", step, config.batch, config.seq_len, seed=config.seed)
        optimizer.zero_grad()
        loss = loss_of(batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        history.steps[step + 1] = {"loss": loss.item(), "lr": scheduler.get_last_lr()[0],
                                   "norm": norm.item()}
        optimizer.step()
        scheduler.step()
        validate(step + 1)
    history.weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return history
