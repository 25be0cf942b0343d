"""The training this lesson submits: lesson 14's capstone, smaller, so that a job takes seconds.

`LESSON_CONFIG`: 2 blocks of width 64 on 128-byte sequences, 8 a step, dp 2 x tp 2, a checkpoint
every 4 steps. `reference_losses(config)`: the same training under plain torchrun on this
machine, uninterrupted ({step: loss}), what every Slurm run of the lesson is compared with.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from helpers.capstone.train import Config

LESSON_CONFIG = Config(layers=2, dim=64, heads=4, kv_heads=2, seq_len=128, batch=8, steps=12,
                       warmup=2, save_every=4, eval_every=0)


def reference_losses(config: Config, timeout: float = 120) -> dict:
    """Rank 0's loss at every step of `config` under plain torchrun (`torchrun --standalone`,
    lesson 14's job), in a folder of its own under runs/ that is removed afterwards."""
    from helpers.capstone.job import torchrun_job
    from helpers.on_a_cluster.cluster import RUNS

    os.makedirs(RUNS, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="torchrun-", dir=RUNS)
    try:
        job = torchrun_job(directory, config, max_restarts=0, timeout=timeout)
        if job.returncode != 0 or job.result is None:
            raise RuntimeError("the plain torchrun run failed:\n"
                               + "\n".join(line for _, line in job.agent[-15:]))
        return {step: record["loss"] for step, record in job.result.steps.items()}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
