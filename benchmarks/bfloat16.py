"""bfloat16 products on this CPU: PyTorch's own kernel against helpers.bfloat16's, and float32's.

    python benchmarks/bfloat16.py [--repeats 10] [--steps 2]

In one process, taking turns: the GFLOP/s of square products (the median of --repeats) for
sizes 128 to 1024 in float32, in bfloat16 by PyTorch's kernel, and in bfloat16 by helpers.bfloat16
(float32 products of the bfloat16 values, rounded once); then lesson 14's model trained for
--steps steps in one process (helpers.capstone.train.one_process, 8 sequences a step) each way.
On a CPU where PyTorch has oneDNN's bfloat16 (helpers.bfloat16.native()), `import helpers`
leaves its kernels alone; the third column shows what they would be replaced with.
"""

import argparse
import dataclasses
import statistics
import time

import torch

import helpers.bfloat16 as bfloat16
from helpers.capstone import train

SIZES = (128, 256, 512, 1024)


def rate(size: int, dtype, repeats: int) -> float:
    """GFLOP/s of a size x size product, the median of `repeats`."""
    left, right = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    left @ right
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        left @ right
        seconds.append(time.perf_counter() - start)
    return 2 * size ** 3 / statistics.median(seconds) / 1e9


def with_kernels(ours: bool, measure, *args):
    """measure(*args) with helpers.bfloat16's kernels (ours) or PyTorch's."""
    with bfloat16.kernels(ours):
        return measure(*args)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=2)
    options = parser.parse_args()
    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads, vector instructions "
          f"{torch.backends.cpu.get_cpu_capability()}; PyTorch's bfloat16 kernels use oneDNN: "
          f"{bfloat16.native()}\n")
    print(f"{'size':>5} | {'float32':>8} {'bf16 PyTorch':>12} {'bf16 helpers':>12} GFLOP/s | "
          f"{'helpers / PyTorch':>17}")
    for size in SIZES:
        single = with_kernels(False, rate, size, torch.float32, options.repeats)
        theirs = with_kernels(False, rate, size, torch.bfloat16, options.repeats)
        ours = with_kernels(True, rate, size, torch.bfloat16, options.repeats)
        print(f"{size:>5} | {single:>8.1f} {theirs:>12.1f} {ours:>12.1f}         | "
              f"{ours / theirs:>16.1f}x")
    config = train.Config(batch=8, steps=options.steps, warmup=0, eval_every=0, save_every=0)

    def seconds(bf16: bool) -> float:
        start = time.perf_counter()
        train.one_process(dataclasses.replace(config, bf16=bf16))
        return time.perf_counter() - start

    with_kernels(True, seconds, True)  # the first run pays for the corpus and imports
    timings = {"float32": with_kernels(False, seconds, False),
               "bf16 PyTorch": with_kernels(False, seconds, True),
               "bf16 helpers": with_kernels(True, seconds, True)}
    print(f"\nlesson 14's model, {options.steps} steps of {config.batch} sequences in one "
          "process (s): " + ", ".join(f"{name} {value:.2f}" for name, value in timings.items())
          + f"; PyTorch / helpers {timings['bf16 PyTorch'] / timings['bf16 helpers']:.1f}x")


if __name__ == "__main__":
    main()
