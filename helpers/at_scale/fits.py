"""What fits, decided by PyTorch, and how fast it runs: a layout run on fake ranks, its peak against
a GPU's memory, its step timed by the step-time model (step_time).

- `fits(shape, plan, memory)`: one step of `plan` for a Llama of `shape` on plan.gpus fake ranks
  (accounting.account_worker, in a process of its own); returns a `Verdict`: the peak bytes of
  rank 0, the bytes it sends in the step by collective, whether the peak fits in `memory` and by
  how much, and the step's estimated time on torchtitan's H100s (`.step`, a step_time.StepTime).
- `reserved(peak)`: what a GPU would reserve for a fake peak, by the published runs: the larger
  of `reserved_ratio()` times it and `reserved_excess()` more (`against_published()` gives
  each run's).
- `efficiency()`: the share of the GPU's peak FLOP/s at which the step-time model gives Table 1's
  published throughput (step_time.calibrate).
- `QUESTION`: the lesson's question (Llama 3 8B, a global batch of 8 sequences of 8192 tokens,
  8 GPUs) and `candidates()`, every layout of it: tp in 1, 2, 4, 8 (dp = 8 / tp, each data-parallel
  rank's micro-batch 8 / dp sequences), each recomputation.
- `python -m helpers.at_scale.fits` runs every candidate (with a progress bar) and writes their
  peaks and bytes to SWEEP (sweep_8b.json), which the lesson's figure and its design exercise
  read; `python -m helpers.at_scale.fits sizes [--again]` runs AT_SIZE (the 8B recipe of
  torchtitan's benchmark on 8 and 128 GPUs, Llama 3 70B in torchtitan's layouts, 8B on 1,024
  GPUs; those already recorded are kept, unless --again) and writes AT_SIZE_RUNS (at_size.json).
  A fake step gives the same bytes on any machine: the tests run a sample of each file again and
  require them.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import asdict, dataclass

from helpers.at_scale import step_time
from helpers.at_scale.accounting import account_worker
from helpers.layouts import RECOMPUTE, Plan
from helpers.published import TORCHTITAN_RUNS

SWEEP = os.path.join(os.path.dirname(__file__), "sweep_8b.json")
GiB = 2**30
SEQ_LEN = 8192  # the benchmark's (module docstring of helpers.published)


@dataclass(frozen=True)
class Verdict:
    plan: Plan
    peak: int  # bytes, rank 0's, from the fake run: comparable to a GPU's allocated peak
    sent: dict  # {collective: bytes} rank 0 sends in the step (FSDP's, and DTensor's)
    memory: int  # bytes per GPU
    step: step_time.StepTime  # the step's time on torchtitan's H100s, estimated

    @property
    def fits(self) -> bool:
        """The fake peak within the memory (with no margin for what a GPU reserves beyond it)."""
        return self.peak <= self.memory

    @property
    def spare(self) -> float:
        """The share of the memory left at the peak (negative: short by that share)."""
        return 1 - self.peak / self.memory

    @property
    def bytes_sent(self) -> float:
        return sum(self.sent.values())

    def __str__(self):
        verdict = (f"fits, {self.spare:.0%} to spare" if self.fits
                   else f"does not fit: {-self.spare:.0%} over")
        return (f"{self.plan}: peak {self.peak / GiB:.1f} GiB of {self.memory / GiB:.0f} "
                f"(fake ranks), {verdict}; {self.step.tokens_per_second:,.0f} tokens/s a GPU "
                "(estimated)")


def fits(shape, plan: Plan, memory: float, timeout: float = 600) -> Verdict:
    """Run one step of `plan` on fake ranks and say whether its peak fits in `memory` bytes, and
    how fast it would run. Raises ValueError before anything runs if the layout's degrees do not
    divide the model (Plan.check)."""
    found = fake_step(shape, plan, timeout)
    return verdict(shape, plan, found["peak"]["Total"], found["sent"], memory)


def fake_step(shape, plan: Plan, timeout: float = 600) -> dict:
    """accounting.account_worker's {"peak", "calls", "sent"} for one step of `plan` on fake ranks,
    in a process of its own. Raises ValueError before anything runs if the layout's degrees do
    not divide the model (Plan.check)."""
    from helpers.launcher import run

    plan.check(shape)
    return run(account_worker, 1, args=(shape, plan), init_group=False, show_output=False,
               kwargs={"fake": True, "measure": ("memory",)}, timeout=timeout)[0]


def verdict(shape, plan: Plan, peak: int, sent: dict, memory: float) -> Verdict:
    """The Verdict of a fake run's peak and bytes (a run of `fits`, or one recorded)."""
    return Verdict(plan, peak, sent, int(memory),
                   step_time.estimate(shape, plan, sent, efficiency()))


def published_plan(run) -> Plan:
    """The Plan of one of torchtitan's published runs (helpers.published.TorchtitanRun)."""
    return Plan(dp=run.dp, tp=run.tp, recompute=run.recompute, micro_batch=run.local_batch,
                seq_len=SEQ_LEN, bf16=True)


def recorded(model: str, plan: Plan) -> dict:
    """The committed fake run (AT_SIZE_RUNS) of `plan` for `model`."""
    found = {(name, ran): result for name, ran, result in load_at_size()}
    if (model, plan) not in found:
        raise KeyError(f"{model}, {plan}: not among the runs at size (AT_SIZE)")
    return found[model, plan]


def against_published() -> list:
    """[(published run, the fake run's peak, what the GPUs reserved), in bytes] for each of
    torchtitan's runs (helpers.published.TORCHTITAN_RUNS; a fake run sees neither torch.compile
    nor Float8, which lowered the reserved memory where Table 1 shows them)."""
    return [(run, recorded(run.model, published_plan(run))["peak"]["Total"], run.memory_gib * GiB)
            for run in TORCHTITAN_RUNS]


def reserved_ratio() -> float:
    """The most a published run reserved, per byte of its fake peak."""
    return max(reserved / fake for _, fake, reserved in against_published())


def reserved_excess() -> float:
    """The most bytes a published run reserved beyond its fake peak."""
    return max(reserved - fake for _, fake, reserved in against_published())


def reserved(peak: float) -> float:
    """What a GPU would reserve for a step whose fake peak is `peak` bytes, read from the published
    runs two ways: as a share of the peak (reserved_ratio) and as a fixed amount beyond it
    (reserved_excess). A handful of runs cannot tell the readings apart, and they part for a
    peak far from theirs: the larger of the two, which each of those runs would have fitted."""
    return max(peak * reserved_ratio(), peak + reserved_excess())


@functools.cache
def efficiency() -> float:
    """The share of the GPU's peak at which the step-time model gives the throughput torchtitan
    published for its 8B recipe on 8 GPUs (Table 1, row FSDP)."""
    from helpers.composing.strategy import MODELS

    table_1 = next(run for run in TORCHTITAN_RUNS
                   if run.model == "Llama 3 8B" and run.gpus == 8 and not run.techniques)
    plan = published_plan(table_1)
    return step_time.calibrate(MODELS[table_1.model], plan, recorded(table_1.model, plan)["sent"],
                               table_1.tokens_per_second)


QUESTION = {"model": "Llama 3 8B", "gpus": 8, "sequences": 8, "seq_len": 8192}
# The exercise's second question: the same tokens a GPU, on two hosts of 8 GPUs (its own sweep)
QUESTION_16 = {"model": "Llama 3 8B", "gpus": 16, "sequences": 16, "seq_len": 8192}
SWEEPS = {SWEEP: QUESTION, os.path.join(os.path.dirname(__file__), "sweep_8b_16.json"): QUESTION_16}


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
    """[(plan, peak, {collective: bytes sent})] from the committed sweep."""
    with open(path) as file:
        rows = json.load(file)["runs"]
    return [(Plan(**row["plan"]), row["peak"], row["sent"]) for row in rows]


def sweep_path(question: dict = QUESTION) -> str:
    """The committed sweep of `question` (one of SWEEPS')."""
    return next(path for path, swept in SWEEPS.items() if swept == question)


def sweep_verdicts(memory_gib: float, question: dict = QUESTION) -> list:
    """A Verdict for each layout of `question`'s committed sweep, on GPUs of `memory_gib` GiB."""
    from helpers.composing.strategy import MODELS

    path = sweep_path(question)
    with open(path) as file:
        recorded_for = json.load(file)["question"]
    if recorded_for != question:
        raise ValueError(f"{path} holds the sweep of {recorded_for}, not of {question}: run "
                         "python -m helpers.at_scale.fits")
    shape = MODELS[question["model"]]
    return [verdict(shape, plan, peak, sent, memory_gib * GiB)
            for plan, peak, sent in load_sweep(path)]


# Real sizes, run by `python -m helpers.at_scale.fits sizes` and committed (AT_SIZE_RUNS):
# torchtitan's 8B recipe (train_configs/llama3_8b.toml at 9dec370: FSDP alone, op-level
# recomputation, seq_len 8192) with its benchmark's local batch of 2 on 8 and 128 GPUs (Tables 1
# and 3, which the lesson runs again and whose published memory sets the margin a plan keeps);
# torchtitan's 70B recipe (train_configs/llama3_70b.toml at 9dec370: tensor_parallel_degree 8,
# batch_size 8, seq_len 8192, full recomputation) on 64 GPUs; the same model in FSDP alone on
# 64, one sequence each; torchtitan's 256-GPU benchmark layout (FSDP 32 x TP 8, local batch 16,
# full recomputation), without its torch.compile and Float8; and the 8B recipe on 1,024 GPUs.
RECIPE_8B = Plan(dp=8, recompute="op", micro_batch=2, seq_len=8192, bf16=True)
AT_SIZE = [
    ("Llama 3 8B", RECIPE_8B),
    ("Llama 3 8B", Plan(dp=128, recompute="op", micro_batch=2, seq_len=8192, bf16=True)),
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
    """Write every sweep of SWEEPS (what="sweep") or AT_SIZE_RUNS ("sizes"); the runs a file
    already records for the same model and plan are kept, unless `again`."""
    import torch

    from helpers.composing.strategy import MODELS

    files = ({path: [(question["model"], plan) for plan in candidates(
        question["gpus"], question["sequences"], question["seq_len"])]
        for path, question in SWEEPS.items()} if what == "sweep" else {AT_SIZE_RUNS: AT_SIZE})
    for path, jobs in files.items():
        kept = {}
        if os.path.exists(path) and not again:
            kept = ({(model, plan): found for model, plan, found in load_at_size(path)}
                    if what == "sizes" else {(jobs[0][0], plan): {"peak": {"Total": peak},
                                                                  "sent": sent}
                                             for plan, peak, sent in load_sweep(path)})
        runs = []
        for done, (model, plan) in enumerate(jobs, start=1):
            found = kept.get((model, plan)) or (at_size(model, plan) if what == "sizes"
                                                else fake_step(MODELS[model], plan))
            peak = found["peak"]["Total"]
            runs.append({"model": model, "plan": asdict(plan), "found": found} if what == "sizes"
                        else {"plan": asdict(plan), "peak": peak, "sent": found["sent"]})
            bar = "#" * done + "." * (len(jobs) - done)
            print(f"[{bar}] {done}/{len(jobs)} {model}, {plan}: {peak / GiB:.1f} GiB", flush=True)
        with open(path, "w") as file:
            json.dump({"made_by": f"python -m helpers.at_scale.fits {what}",
                       "torch": torch.__version__, "fake_ranks": True,
                       **({"question": SWEEPS[path]} if what == "sweep" else {}), "runs": runs},
                      file, indent=1)
        print(f"wrote {len(runs)} runs to {path}")


if __name__ == "__main__":
    main(*sys.argv[1:2], again="--again" in sys.argv)
