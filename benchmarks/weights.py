"""Lesson 10's weight transfer from trainer ranks to inference ranks: three variants side by side.

    python benchmarks/weights.py [--repeats 10] [--bucket-mb 1]

World 4: ranks 0-1 are trainers, ranks 2-3 inference ranks. For TinyLMs of 4 blocks and widths
64 to 512 (helpers.reference.make_lm, built on every rank), the median seconds of --repeats
transfers, on the slowest rank, by (a) one broadcast per parameter from trainer 0, (b) one
broadcast per bucket of at least --bucket-mb MiB from trainer 0, (c) each trainer sending half of
the flat weights, then an all_gather between the inference ranks
(helpers.composing.weights.transfer_times_worker; the variants take turns). Then the ratios
(a) / (b) and (c) / (b), and (a - b) / (calls of a - calls of b): what each extra call cost.
"""

import argparse

from helpers import run
from helpers.composing.weights import VARIANTS, transfer_times_worker

WIDTHS = (64, 128, 256, 512)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    options = parser.parse_args()
    sweep = run(transfer_times_worker, 4, show_output=False, timeout=600, kwargs=dict(
        num_trainers=2, widths=WIDTHS, layers=4, bucket_bytes=options.bucket_mb * 2**20,
        repeats=options.repeats))[0]
    per_tensor, bucketed, scattered = VARIANTS  # the keys
    print(f"2 trainers -> 2 inference ranks, 4 blocks, buckets of {options.bucket_mb} MiB; "
          f"median of {options.repeats} transfers (ms)\n")
    print(f"{'width':>5} {'MB':>6} {'calls a/b':>9} | {'(a) per-tensor':>14} {'(b) bucketed':>12} "
          f"{'(c) scatter+ag':>14} | {'a / b':>6} {'c / b':>6} | {'per extra call':>14}")
    for record in sweep:
        seconds, calls = record["seconds"], record["calls"]
        extra_calls = len(calls[per_tensor]) - len(calls[bucketed])
        per_call = (seconds[per_tensor] - seconds[bucketed]) / extra_calls
        print(f"{record['width']:>5} {record['parameters'] * 4 / 1e6:>6.2f} "
              f"{len(calls[per_tensor]):>4}/{len(calls[bucketed]):<4} | "
              f"{seconds[per_tensor] * 1e3:>14.2f} {seconds[bucketed] * 1e3:>12.2f} "
              f"{seconds[scattered] * 1e3:>14.2f} | "
              f"{seconds[per_tensor] / seconds[bucketed]:>5.1f}x "
              f"{seconds[scattered] / seconds[bucketed]:>5.1f}x | {per_call * 1e6:>11.0f} us")


if __name__ == "__main__":
    main()
