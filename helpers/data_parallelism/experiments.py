"""Lesson 06's experiment run from the kernel: where data parallelism stops equalling one
process (workers.EQUALITY_CASES), measured."""

from __future__ import annotations

import torch

from helpers import reference
from helpers.data_parallelism.workers import EQUALITY_CASES, LOSSES, data_parallel_worker
from helpers.launcher import run


def compare_with_one_process(case: str, world_size: int = 4, steps: int = 5) -> float:
    """Train the model of `case` (EQUALITY_CASES) for `steps` SGD steps on one process with the
    whole batch, and on `world_size` ranks with the naive loop; return the largest difference
    between the two runs' parameters."""
    options = EQUALITY_CASES[case]
    model = options.get("model", lambda: reference.make_mlp(dim=16, num_layers=3, seed=0))()
    batches = reference.mlp_data(seed=1, batch_size=options.get("batch_size", 8), dim=16,
                                 steps=steps)
    loss = options.get("loss", "mean")
    torch.manual_seed(0)  # the single process's dropout masks
    single = reference.train(model, batches, LOSSES[loss], optimizer="sgd", lr=0.01)
    parallel = run(data_parallel_worker, world_size, show_output=False, kwargs=dict(
        model=model, batches=batches, strategy="naive", optimizer="sgd", lr=0.01, loss=loss,
        seed_per_rank=options.get("seed_per_rank", False)))[0]
    return max((parallel["parameters"][name] - param).abs().max().item()
               for name, param in single.parameters.items())
