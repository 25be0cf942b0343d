"""Real text that every user already has: the source of Python's standard library, as bytes.

- `python_source(root=None, held_out_every=10)`: the `*.py` modules at the top of the standard
  library's folder (`sysconfig.get_path("stdlib")`, `os.py`, `argparse.py`, ...; not its
  packages, whose tests would dominate), read in name order at run time: the same text for a
  given Python, and nothing fetched or committed. Every `held_out_every`-th module is held out
  for validation, whole: a model is judged on files it never saw. Returns a `Corpus`.
- Tokens are bytes (a vocabulary of 256): nothing to train or download, and a loss in nats per
  token is a loss per byte (`bits_per_byte`).
- `Corpus.batch(split, step, sequences, seq_len, seed)`: `sequences` windows of seq_len + 1
  bytes at offsets drawn from a generator seeded by (seed, step): the same batch for a given
  step on every rank and after any restart, so a resumed run needs no sampler state.
- `unigram_bits(corpus, windows=None)`: the baseline a model must beat: the validation text's
  cross-entropy under the training text's byte frequencies (add-one smoothed), in bits per
  byte; with `windows` (a batch of it), on the bytes a model is scored on there, its targets.
"""

from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass

import torch

VOCAB = 256  # one token per byte value
SPLITS = ("train", "validation")


class CorpusError(ValueError):
    """The corpus is missing or too small for what was asked of it."""


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8, the training modules one after another
    validation: torch.Tensor  # uint8, the held-out modules
    files: tuple  # (train names, validation names)
    root: str

    def split(self, name: str) -> torch.Tensor:
        if name not in SPLITS:
            raise ValueError(f"split is one of {SPLITS}, not {name!r}")
        return getattr(self, name)

    def batch(self, split: str, step: int, sequences: int, seq_len: int, seed: int = 0):
        """(sequences, seq_len + 1) int64 tokens: windows at random offsets of `split`, drawn
        from a generator seeded by `seed` and `step`. Inputs are [:, :-1], targets [:, 1:]."""
        text = self.split(split)
        if len(text) < seq_len + 2:
            raise CorpusError(f"the {split} text has {len(text):,} bytes, fewer than one "
                              f"sequence of {seq_len + 1}")
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(text) - seq_len - 1, (sequences,), generator=generator)
        return torch.stack([text[start:start + seq_len + 1] for start in starts.tolist()]).long()


def python_source(root: str | None = None, held_out_every: int = 10,
                  min_bytes: int = 100_000) -> Corpus:
    """The top-level modules of the standard library at `root` (this Python's by default)."""
    root = root or sysconfig.get_path("stdlib")
    if not os.path.isdir(root):
        raise CorpusError(f"no standard library source at {root!r}: this Python ships none "
                          "(an embedded or stripped build); pass root= a folder of .py files")
    names = sorted(name for name in os.listdir(root) if name.endswith(".py"))
    parts = {"train": [], "validation": []}
    for index, name in enumerate(names):
        with open(os.path.join(root, name), "rb") as source:
            split = "validation" if index % held_out_every == held_out_every - 1 else "train"
            parts[split].append((name, source.read()))
    sizes = {split: sum(len(text) for _, text in files) for split, files in parts.items()}
    if min(sizes.values()) < min_bytes // held_out_every or sum(sizes.values()) < min_bytes:
        raise CorpusError(f"{root!r} holds {len(names)} .py files, {sizes['train']:,} bytes "
                          f"to train on and {sizes['validation']:,} held out: too little text "
                          f"(at least {min_bytes:,} bytes, a tenth of them held out)")

    def joined(files):
        return torch.frombuffer(bytearray(b"".join(text for _, text in files)), dtype=torch.uint8)

    return Corpus(joined(parts["train"]), joined(parts["validation"]),
                  (tuple(name for name, _ in parts["train"]),
                   tuple(name for name, _ in parts["validation"])), root)


def bits_per_byte(nats_per_token: float) -> float:
    """A byte-level model's loss in nats per token, in bits per byte."""
    return nats_per_token / math.log(2)


def unigram_bits(corpus: Corpus, windows: torch.Tensor | None = None) -> float:
    """Bits per byte of the validation text under the training text's byte frequencies (each
    count plus one, so that no byte has probability 0); with `windows`, (sequences, seq_len +
    1) tokens as Corpus.batch draws them, of the bytes predicted there (windows[:, 1:]): the
    baseline on the very bytes a model's validation loss is measured on."""
    counts = torch.bincount(corpus.train.long(), minlength=VOCAB).double() + 1
    probabilities = counts / counts.sum()
    scored = corpus.validation if windows is None else windows[:, 1:].flatten()
    seen = torch.bincount(scored.long(), minlength=VOCAB).double()
    return float(-(seen * probabilities.log2()).sum() / seen.sum())
