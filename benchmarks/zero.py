"""Lesson 07's hand-built ZeRO-3 (FSDP) against PyTorch's fully_shard, in one run.

    python benchmarks/zero.py [--world-sizes 2 4] [--dim 128] [--layers 4] [--vocab 512]
                              [--seq-len 64] [--batch 16] [--iterations 10]

Four copies of the same TinyLM (helpers.reference) train with AdamW on the same batch: the
hand-built FSDP and fully_shard, each with every Linear and Embedding its own unit, and each with
whole transformer blocks as units (as fully_shard's documentation wraps a transformer: fewer,
larger collectives; the hand-built one then recomputes each block's forward in its backward).
They take turns, step after step; each step starts after a barrier and lasts as long as the
slowest rank. Prints the median step time of each, the ratios of hand-built to fully_shard with
the same units, and the bytes of parameters, gradients and optimizer state each rank holds.
Then stage 1 the same way: the hand-built ShardedOptimizer against DDP with
ZeroRedundancyOptimizer.
"""

import argparse

from helpers import reference, run
from helpers.zero_and_fsdp.workers import (
    CONTENDERS,
    STAGE_1_CONTENDERS,
    stage_1_times_worker,
    step_times_worker,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="the global batch")
    parser.add_argument("--iterations", type=int, default=10)
    options = parser.parse_args()
    model = reference.make_lm(vocab=options.vocab, dim=options.dim, heads=4, layers=options.layers,
                              max_seq_len=options.seq_len, seed=0)
    batch = reference.lm_data(seed=1, batch_size=options.batch, seq_len=options.seq_len,
                              vocab=options.vocab)[0]
    parameters = sum(param.numel() for param in model.parameters())
    print(f"TinyLM: {parameters:,} parameters ({options.layers} blocks of width {options.dim}, "
          f"vocabulary {options.vocab}, sequences of {options.seq_len}); global batch "
          f"{options.batch}; AdamW; median of {options.iterations} alternating steps\n")
    print(f"{'ranks':>5} | " + " ".join(f"{name + ' (ms)':>26}" for name in CONTENDERS)
          + f" | {'per layer':>9} {'per block':>9} | state bytes per rank (hand / fully_shard)")
    for world_size in options.world_sizes:
        medians, held = run(step_times_worker, world_size,
                            args=(model, batch, options.iterations), show_output=False,
                            timeout=600)[0]
        times = " ".join(f"{medians[name] * 1e3:>26.1f}" for name in CONTENDERS)
        ratios = [medians[f"hand-built per {unit}"] / medians[f"fully_shard per {unit}"]
                  for unit in ("layer", "block")]
        state = {name: sum(parts.values()) for name, parts in held.items()}
        print(f"{world_size:>5} | {times} | {ratios[0]:>8.2f}x {ratios[1]:>8.2f}x | "
              f"{state['hand-built per block']:,} / {state['fully_shard per block']:,}",
              flush=True)
    print(f"\nstage 1\n{'ranks':>5} | " + " ".join(f"{name + ' (ms)':>28}"
                                                  for name in STAGE_1_CONTENDERS)
          + f" | {'hand / torch':>12} | state bytes per rank (hand / torch)")
    for world_size in options.world_sizes:
        medians, held = run(stage_1_times_worker, world_size,
                            args=(model, batch, options.iterations), show_output=False,
                            timeout=600)[0]
        hand, torch_zero = (medians[name] for name in STAGE_1_CONTENDERS)
        state = [sum(held[name].values()) for name in STAGE_1_CONTENDERS]
        print(f"{world_size:>5} | {hand * 1e3:>28.1f} {torch_zero * 1e3:>28.1f} | "
              f"{hand / torch_zero:>11.2f}x | {state[0]:,} / {state[1]:,}", flush=True)


if __name__ == "__main__":
    main()
