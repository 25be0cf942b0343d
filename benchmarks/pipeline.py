"""Lesson 09's hand-built pipeline against torch.distributed.pipelining, and its bubble.

    python benchmarks/pipeline.py [--iterations 10]

The course's MLP, 8 layers of width 512, a batch of 256 in 8 micro-batches, cut into p = 2 and
4 stages. First the step times: the hand-built 1F1B and zero-bubble schedules
(helpers.pipeline_parallelism.schedule.pipeline_step, with no observer active) against
torch's Schedule1F1B, taking turns, each step after a barrier and as long as its slowest rank;
the medians and the ratio hand-built 1F1B / Schedule1F1B. Then the bubble measured from the
event logs at p = 2 for m = 1, 2, 4, 8, against (p - 1) / (m + p - 1), the median of 3 steps,
on a wider MLP (8 layers of width 2048, batch 64) whose stages compute for much longer than a
message takes (workers.bubble_worker).
"""

import argparse
import statistics

from helpers import reference, run
from helpers.pipeline_parallelism.ideal import bubble
from helpers.pipeline_parallelism.schedule import bubble_formula
from helpers.pipeline_parallelism.workers import CONTENDERS, bubble_worker, step_times_worker


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10)
    options = parser.parse_args()
    model = reference.make_mlp(512, 8)
    batch = reference.mlp_data(seed=4, batch_size=256, dim=512)[0]
    print("MLP: 8 layers of width 512, batch 256, 8 micro-batches; median of "
          f"{options.iterations} alternating steps (ms)\n")
    print(f"{'stages':>6} | " + " ".join(f"{name:>20}" for name in CONTENDERS)
          + " | hand 1F1B / torch")
    for world_size in (2, 4):
        times = run(step_times_worker, world_size, show_output=False, timeout=600, kwargs=dict(
            model=model, batch=batch, num_micro_batches=8, iterations=options.iterations))[0]
        ratio = times["hand-built 1F1B"] / times["torch Schedule1F1B"]
        print(f"{world_size:>6} | " + " ".join(f"{times[name] * 1e3:>20.1f}"
                                               for name in CONTENDERS)
              + f" | {ratio:>16.2f}x", flush=True)
    print("\nbubble at p = 2, 8 layers of width 2048, batch 64 (median of 3 steps)")
    print(f"{'m':>3} | {'formula':>8} | {'gpipe':>8} {'1f1b':>8} {'zb':>8}")
    for micro_batches in (1, 2, 4, 8):
        measured = {}
        for name in ("gpipe", "1f1b", "zb"):
            out = run(bubble_worker, 2, show_output=False, kwargs=dict(
                width=2048, num_layers=8, batch_size=64, num_micro_batches=micro_batches,
                schedule=name, steps=3))
            measured[name] = statistics.median(
                bubble([rank[step]["events"] for rank in out],
                       min(rank[step]["start"] for rank in out)) for step in range(3))
        print(f"{micro_batches:>3} | {100 * bubble_formula(2, micro_batches):>7.1f}% | "
              + " ".join(f"{100 * measured[name]:>7.1f}%" for name in ("gpipe", "1f1b", "zb")),
              flush=True)


if __name__ == "__main__":
    main()
