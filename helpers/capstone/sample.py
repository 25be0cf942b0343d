"""What a model writes: bytes sampled one after another from a whole model in this process.

- `generate(weights, config, prompt, length, temperature=0.8, seed=0)`: `length` bytes after
  `prompt`, each drawn from the model's distribution over the next byte (its logits divided by
  `temperature`), with a generator seeded by `seed`; the model sees the last config.seq_len bytes.
- `weights_from_checkpoint(directory, config)`: the whole weights of the newest checkpoint in
  `directory`, read in this one process (DCP puts the ranks' pieces together).
- `printable_share(text)`: the share of the bytes of `text` that are printable ASCII, spaces,
  tabs, newlines or carriage returns: 98 of the 256 byte values, so about 0.38 of what a model
  that guesses uniformly writes, and nearly all of what the standard library's source holds.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp

from helpers.checkpoints_and_failures.resume import latest_checkpoint
from helpers.llama import Llama

PRINTABLE = frozenset(range(32, 127)) | {9, 10, 13}


@torch.no_grad()
def generate(weights: dict, config, prompt: bytes, length: int, temperature: float = 0.8,
             seed: int = 0) -> bytes:
    model = Llama(config.shape, max_seq_len=config.seq_len)
    model.load_state_dict(weights)
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    for _ in range(length):
        context = torch.tensor([tokens[-config.seq_len:]])
        logits = model(context)[0, -1].float() / temperature
        tokens.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
    return bytes(tokens)


def weights_from_checkpoint(directory, config) -> dict:
    path, step = latest_checkpoint(directory)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint in {directory}")
    model = Llama(config.shape, max_seq_len=config.seq_len)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # it says it assumes one process: this is one, on purpose
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]


def printable_share(text: bytes) -> float:
    return sum(byte in PRINTABLE for byte in text) / max(1, len(text))
