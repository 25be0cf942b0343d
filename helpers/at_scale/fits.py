"""What fits, decided by PyTorch: a layout run on fake ranks, its peak against a GPU's memory.

- `fits(shape, plan, memory)`: one step of `plan` for a Llama of `shape` on plan.gpus fake ranks
  (accounting.account_worker, in a process of its own); returns a `Verdict`: the peak bytes of
  rank 0, the bytes it sends in the step, whether the peak fits in `memory` and by how much.
- `QUESTION`: the lesson's question (Llama 3 8B, a global batch of 8 sequences of 8192 tokens,
  8 GPUs) and `candidates()`, every layout of it: tp in 1, 2, 4, 8 (dp = 8 / tp, each data-parallel
  rank's micro-batch 8 / dp sequences), each recomputation.
- `python -m helpers.at_scale.fits` runs every candidate (with a progress bar) and writes their
  verdicts to SWEEP (sweep_8b.json), which the lesson's figure and its design exercise read;
  `python -m helpers.at_scale.fits sizes [--again]` runs AT_SIZE (Llama 3 70B in torchtitan's
  layouts, 8B on 1,024 GPUs; those already recorded are kept, unless --again) and writes
  AT_SIZE_RUNS (at_size.json). A fake step gives the same bytes on any machine: the tests
  run a sample of each file again (one of the sweep in make test, three more and the 70B FSDP run
  in the soak tier) and require them.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass

from helpers.at_scale.accounting import RECOMPUTE, Plan, account_worker

SWEEP = os.path.join(os.path.dirname(__file__), "sweep_8b.json")
GiB = 2**30


@dataclass(frozen=True)
class Verdict:
    plan: Plan
    peak: int  # bytes, rank 0's, from the fake run
    sent: int  # bytes rank 0 sends in the step (instrument.Observer: its collectives, by ring)
    memory: int  # bytes per GPU

    @property
    def fits(self) -> bool:
        return self.peak <= self.memory

    @property
    def spare(self) -> float:
        """The share of the memory left at the peak (negative: short by that share)."""
        return 1 - self.peak / self.memory

    def __str__(self):
        verdict = (f"fits, {self.spare:.0%} to spare" if self.fits
                   else f"does not fit: {-self.spare:.0%} over")
        return (f"{self.plan}: peak {self.peak / GiB:.1f} GiB of {self.memory / GiB:.0f} "
                f"(fake ranks), sends {self.sent / GiB:.1f} GiB: {verdict}")


def fits(shape, plan: Plan, memory: float, timeout: float = 600) -> Verdict:
    """Run one step of `plan` on fake ranks and say whether its peak fits in `memory` bytes.
    Raises ValueError before anything runs if the layout cannot hold the model."""
    from helpers.launcher import run

    plan.check(shape)
    found = run(account_worker, 1, args=(shape, plan), init_group=False, show_output=False,
                kwargs={"fake": True, "measure": ("memory",)}, timeout=timeout)[0]
    return Verdict(plan, found["peak"]["Total"], int(sum(found["sent"].values())), int(memory))


QUESTION = {"model": "Llama 3 8B", "gpus": 8, "sequences": 8, "seq_len": 8192}


def candidates(gpus: int = QUESTION["gpus"], sequences: int = QUESTION["sequences"],
               seq_len: int = QUESTION["seq_len"]) -> list:
    """Every layout of the question: tp a power of two up to 8, dp = gpus / tp, each dp rank's
    share of the sequences in one micro-batch, each recomputation; bfloat16."""
    found = []
    tp = 1
    while tp <= min(8, gpus):
        dp = gpus // tp
        if sequences % dp == 0:
            found += [Plan(dp=dp, tp=tp, recompute=recompute, micro_batch=sequences // dp,
                           seq_len=seq_len, bf16=True) for recompute in RECOMPUTE]
        tp *= 2
    return found


def load_sweep(path: str = SWEEP) -> list:
    """[(plan, peak, sent)] from the committed sweep."""
    with open(path) as file:
        rows = json.load(file)["runs"]
    return [(Plan(**row["plan"]), row["peak"], row["sent"]) for row in rows]


# Real sizes whose fake runs take minutes, run by `python -m helpers.at_scale.fits sizes` and
# committed (AT_SIZE_RUNS): torchtitan's 70B recipe (train_configs/llama3_70b.toml at 9dec370:
# tensor_parallel_degree 8, batch_size 8, seq_len 8192, full recomputation) on 64 GPUs; the same
# model in FSDP alone on 64, one sequence each; and torchtitan's 256-GPU benchmark layout (FSDP 32 x
# TP 8, local batch 16, full recomputation), without its torch.compile and Float8; and the 8B recipe
# of the lesson on 1,024 GPUs.
AT_SIZE = [
    ("Llama 3 70B", Plan(dp=8, tp=8, recompute="full", micro_batch=8, seq_len=8192, bf16=True)),
    ("Llama 3 70B", Plan(dp=64, recompute="full", micro_batch=1, seq_len=8192, bf16=True)),
    ("Llama 3 70B", Plan(dp=32, tp=8, recompute="full", micro_batch=16, seq_len=8192, bf16=True)),
    ("Llama 3 8B", Plan(dp=1024, recompute="op", micro_batch=2, seq_len=8192, bf16=True)),
]
AT_SIZE_RUNS = os.path.join(os.path.dirname(__file__), "at_size.json")


def at_size(model: str, plan: Plan) -> dict:
    """{"peak": {kind: bytes}, "calls", "sent", "loss": {kind: bytes}}: one step of `plan` for
    `model` (a name in composing.strategy.MODELS) on fake ranks, and its loss alone."""
    from helpers.at_scale.accounting import loss_worker
    from helpers.composing.strategy import MODELS
    from helpers.launcher import run

    shape = MODELS[model]
    found = run(account_worker, 1, args=(shape, plan), init_group=False, show_output=False,
                kwargs={"fake": True, "measure": ("memory",)}, timeout=1800)[0]
    found["loss"] = run(loss_worker, 1, args=(shape, plan), init_group=False,
                        show_output=False, timeout=600)[0]
    return found


def load_at_size(path: str = AT_SIZE_RUNS) -> list:
    """[(model, plan, found)] from the committed runs at real sizes."""
    with open(path) as file:
        rows = json.load(file)["runs"]
    return [(row["model"], Plan(**row["plan"]), row["found"]) for row in rows]


def main(what: str = "sweep", again: bool = False) -> None:
    """Write SWEEP (what="sweep") or AT_SIZE_RUNS ("sizes"); for the latter, runs already
    recorded for the same model and plan are kept unless `again`."""
    import torch

    from helpers.composing.strategy import MODELS

    jobs = ([(QUESTION["model"], plan) for plan in candidates()] if what == "sweep"
            else AT_SIZE)
    recorded = ({} if again or what == "sweep" or not os.path.exists(AT_SIZE_RUNS)
                else {(model, plan): found for model, plan, found in load_at_size()})
    runs = []
    for done, (model, plan) in enumerate(jobs, start=1):
        if what == "sweep":
            verdict = fits(MODELS[model], plan, memory=1)
            runs.append({"plan": asdict(plan), "peak": verdict.peak, "sent": verdict.sent})
            peak = verdict.peak
        else:
            found = recorded.get((model, plan)) or at_size(model, plan)
            runs.append({"model": model, "plan": asdict(plan), "found": found})
            peak = found["peak"]["Total"]
        bar = "#" * done + "." * (len(jobs) - done)
        print(f"[{bar}] {done}/{len(jobs)} {model}, {plan}: {peak / GiB:.1f} GiB", flush=True)
    path = SWEEP if what == "sweep" else AT_SIZE_RUNS
    with open(path, "w") as file:
        json.dump({"made_by": f"python -m helpers.at_scale.fits {what}",
                   "torch": torch.__version__, "fake_ranks": True,
                   **({"question": QUESTION} if what == "sweep" else {}), "runs": runs},
                  file, indent=1)
    print(f"wrote {len(runs)} runs to {path}")


if __name__ == "__main__":
    main(*sys.argv[1:2], again="--again" in sys.argv)
