"""Lesson 07's hand-built ZeRO against PyTorch's, in one run.

    python benchmarks/zero.py [--parts 3 1-2] [--world-sizes 2 4] [--repeats 3] [--dim 128]
                              [--layers 4] [--vocab 512] [--seq-len 64] [--batch 16]
                              [--iterations 10] [--bucket-mb 1]

Copies of the same TinyLM (helpers.reference) train with AdamW on the same batch, taking turns
step after step; each step starts after a barrier and lasts as long as the slowest rank. Every
line is one run (--repeats runs per number of ranks); it prints the median step time of each
contender, the ratios, and the bytes each rank holds.

Part 3: the hand-built FSDP and fully_shard, each with every Linear and Embedding its own unit,
and each with whole transformer blocks as units (as fully_shard's documentation wraps a
transformer: fewer, larger collectives; the hand-built one then recomputes each block's forward
in its backward).

Part 1-2: the readable ShardedOptimizer (ZeRO-1), the BucketedShardedOptimizer as ZeRO-1 and as
ZeRO-2 (buckets of --bucket-mb MiB, reduce-scattered during backward), and DDP with
ZeroRedundancyOptimizer (PyTorch's ZeRO-1; DDP's default buckets).
"""

import argparse

from helpers import reference, run
from helpers.strategies import step_times_worker
from helpers.zero_and_fsdp.workers import (
    STAGE_1_2,
    STAGE_1_2_LABELS,
    ZERO_3,
    ZERO_3_LABELS,
    stage_1_2_contenders,
)


def times_and_bytes(world_size, contenders, model, batch, options):
    """One run of strategies.step_times_worker: rank 0's (medians, held bytes)."""
    out = run(step_times_worker, world_size, show_output=False, timeout=600, kwargs=dict(
        contenders=contenders, model=model, batch=batch, iterations=options.iterations))[0]
    return out["seconds"], out["held"]


def stage_3(model, batch, options):
    print(f"{'ranks':>5} | " + " ".join(f"{ZERO_3_LABELS[key] + ' (ms)':>26}" for key in ZERO_3)
          + f" | {'per layer':>9} {'per block':>9} | state bytes per rank (hand / fully_shard)")
    for world_size in options.world_sizes:
        for _ in range(options.repeats):
            medians, held = times_and_bytes(world_size, ZERO_3, model, batch, options)
            times = " ".join(f"{medians[key] * 1e3:>26.1f}" for key in ZERO_3)
            ratios = [medians[f"hand_built_per_{unit}"] / medians[f"fully_shard_per_{unit}"]
                      for unit in ("layer", "block")]
            state = {key: sum(parts.values()) for key, parts in held.items()}
            print(f"{world_size:>5} | {times} | {ratios[0]:>8.2f}x {ratios[1]:>8.2f}x | "
                  f"{state['hand_built_per_block']:,} / {state['fully_shard_per_block']:,}",
                  flush=True)


def stages_1_and_2(model, batch, options):
    bucketed = ("bucketed_zero_1", "bucketed_zero_2")
    print(f"{'ranks':>5} | "
          + " ".join(f"{STAGE_1_2_LABELS[key] + ' (ms)':>27}" for key in STAGE_1_2)
          + " | " + " ".join(f"{STAGE_1_2_LABELS[key].split()[1] + ' / torch':>14}"
                             for key in bucketed)
          + " | optimizer state bytes on rank 0 (bucketed / torch)")
    for world_size in options.world_sizes:
        for _ in range(options.repeats):
            medians, held = times_and_bytes(world_size, stage_1_2_contenders(options.bucket_mb),
                                            model, batch, options)
            times = " ".join(f"{medians[key] * 1e3:>27.1f}" for key in STAGE_1_2)
            torch_zero = medians["zero_redundancy_optimizer"]
            ratios = " ".join(f"{medians[key] / torch_zero:>13.2f}x" for key in bucketed)
            print(f"{world_size:>5} | {times} | {ratios} | "
                  f"{held[bucketed[0]]['optimizer']:,} / "
                  f"{held['zero_redundancy_optimizer']['optimizer']:,}", flush=True)


PARTS = {"3": ("ZeRO-3: the hand-built FSDP against fully_shard", stage_3),
         "1-2": ("ZeRO-1 and ZeRO-2: the hand-built ShardedOptimizers against DDP + "
                 "ZeroRedundancyOptimizer", stages_1_and_2)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3, help="runs per number of ranks")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="the global batch")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--bucket-mb", type=float, default=1.0,
                        help="the BucketedShardedOptimizer's bucket size (MiB)")
    options = parser.parse_args()
    model = reference.make_lm(vocab=options.vocab, dim=options.dim, heads=4, layers=options.layers,
                              max_seq_len=options.seq_len, seed=0)
    batch = reference.lm_data(seed=1, batch_size=options.batch, seq_len=options.seq_len,
                              vocab=options.vocab)[0]
    parameters = sum(param.numel() for param in model.parameters())
    print(f"TinyLM: {parameters:,} parameters ({options.layers} blocks of width {options.dim}, "
          f"vocabulary {options.vocab}, sequences of {options.seq_len}); global batch "
          f"{options.batch}; AdamW; median of {options.iterations} alternating steps per run")
    for part in options.parts:
        title, measure = PARTS[part]
        print(f"\n{title}")
        measure(model, batch, options)


if __name__ == "__main__":
    main()
