"""Figures published elsewhere that lessons 04, 08, 10 and 13 set beside their measurements and
projections. None is measured here.

Every number is copied exactly from the file named, at the commit named: of S. Bekman's "Machine
Learning Engineering Open Book" (github.com/stas00/ml-engineering; its units: 1 KiB = 2**10
bytes, 1 GBps = 10**9 bytes per second), and of torchtitan's December 2024 benchmark (lesson 13).
"""

from typing import NamedTuple

BOOK = ("S. Bekman, Machine Learning Engineering Open Book, "
        "github.com/stas00/ml-engineering @744d01e")

# Per GPU (or per port), one direction, in bytes/s: (label, bytes/s, where in BOOK).
PUBLISHED_LINKS = [
    ("PCIe 4.0 x16", 31e9, "network/README.md, PCIe table: 31 GBps uni-dir."),
    ("PCIe 5.0 x16", 63e9, "network/README.md, PCIe table: 63 GBps uni-dir."),
    ("InfiniBand NDR400, one port", 50e9,
     "network/README.md, inter-node table: 400 Gbps, 50 GBps uni-dir."),
    ("NVLink 3 (A100)", 300e9, "network/README.md, NVLink table: 300 GBps uni-dir., 600 duplex"),
    ("NVLink 4 (H100, H200)", 450e9,
     "network/README.md, NVLink table: 450 GBps uni-dir., 900 duplex"),
]

# Peak dense matrix throughput, in floating-point operations per second: (label, FLOP/s, where).
PUBLISHED_FLOPS = [
    ("NVIDIA H100 SXM, bf16", 989e12,
     "compute/accelerator/README.md, TFLOPS comparison table: 989 (bf16, without sparsity)"),
]

KIB, MIB, GIB = 2**10, 2**20, 2**30
SIZES = [32 * KIB, 64 * KIB, 128 * KIB, 256 * KIB, 512 * KIB, 1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB,
         16 * MIB, 32 * MIB, 64 * MIB, 128 * MIB, 256 * MIB, 512 * MIB, 1 * GIB, 2 * GIB, 4 * GIB,
         8 * GIB, 16 * GIB]

# all_reduce busbw (GBps) against the size of the whole tensor, both measured with the book's own
# benchmarks/all_reduce_bench.py (torch.distributed.all_reduce timed with CUDA events after a
# barrier, algbw averaged over ranks and iterations; busbw = algbw * 2(n-1)/n), not nccl-tests.
H200_NODE_BUSBW = [1.44, 2.93, 5.73, 11.74, 23.94, 39.93, 64.53, 107.16, 155.53, 219.89, 275.84,
                   346.51, 401.93, 436.15, 450.29, 463.58, 469.17, 473.10, 477.45, 482.26]
B200_FOUR_NODES_BUSBW = [0.01, 0.04, 0.45, 1.33, 2.84, 5.37, 10.38, 18.90, 35.12, 64.43, 91.19,
                         156.74, 197.94, 229.09, 326.90, 361.99, 372.42, 377.34, 380.39, 381.80]

# (label, source, conditions, [(S bytes, busbw bytes/s)])
PUBLISHED_SWEEPS = [
    ("8x H200, one node (NVLink 4, NVSwitch)",
     f"{BOOK}, network/README.md, section 'Real network throughput'",
     "all_reduce_bench.py; the book's network/benchmarks/README.md gives torch 2.9.1+cu130, "
     "CUDA 13.0, NCCL 2.27.7 for its H200 sweep; NCCL used NVLS from 2 MiB up",
     [(size, gbps * 1e9) for size, gbps in zip(SIZES, H200_NODE_BUSBW)]),
    ("4 nodes of 8x B200 (32 GPUs; 8x 50 GBps EFA per node)",
     f"{BOOK}, network/README.md, section 'Inter-node speed depends on intra-node speed'",
     "all_reduce_bench.py on AWS P6-B200 nodes (NVLink 5 inside, 8x 50 GBps EFA v4 out), "
     "torch 2.9.1+cu130, CUDA 13.0, NCCL 2.27.7",
     [(size, gbps * 1e9) for size, gbps in zip(SIZES, B200_FOUR_NODES_BUSBW)]),
]


# Lesson 13: runs on GPUs, published with their conditions. The torchtitan team's benchmark
# (github.com/pytorch/torchtitan @b5bcd76, benchmarks/llama3_h100_202412_torchtitan.md; torch
# 1963fc8, torchtitan 9dec370, December 2024): H100s with 96 GB of HBM2e at 500 W, 8 to a host on
# NVLink, 400 Gb/s of RDMA per GPU between hosts; "TPS/GPU", tokens per second per GPU (train.py
# at 9dec370: a rank's tokens / (seconds x the non-data-parallel degree)), read at the 90th
# iteration; "Memory(GiB)", which the file does not name: almost certainly the CUDA allocator's
# peak reserved bytes, which torchtitan prints on its line of each logged step (train.py at
# 9dec370: device_mem_stats.max_reserved_gib; its metrics log max_active beside it), where a
# table's figure is read; FSDP2's mixed precision (float32
# shards, gathered in bfloat16, gradients reduced in float32: torchtitan's defaults), 8192 tokens a
# sequence (train_configs/llama3_8b.toml and llama3_70b.toml at 9dec370; the file gives none).
# recompute "op": the 8B toml's selective_ac_option (the benchmark says "selective").


class TorchtitanRun(NamedTuple):
    model: str
    gpus: int
    dp: int  # FSDP's degree
    tp: int
    local_batch: int  # sequences a data-parallel rank takes a step
    recompute: str
    techniques: str  # what else was on: torch.compile (of the blocks), Float8 (its linears)
    tokens_per_second: int  # TPS/GPU
    memory_gib: float  # Memory(GiB): max reserved
    where: str


TORCHTITAN_RUNS = [
    TorchtitanRun("Llama 3 8B", 8, 8, 1, 2, "op", "", 5762, 82.4, "Table 1, row FSDP"),
    TorchtitanRun("Llama 3 8B", 8, 8, 1, 2, "op", "torch.compile", 6667, 77.0,
                  "Table 1, row FSDP + torch.compile"),
    TorchtitanRun("Llama 3 8B", 8, 8, 1, 2, "op", "torch.compile, Float8", 8532, 76.8,
                  "Table 1, row FSDP + torch.compile + Float8"),
    TorchtitanRun("Llama 3 8B", 128, 128, 1, 2, "op", "", 5605, 67.0, "Table 3, row FSDP"),
    TorchtitanRun("Llama 3 8B", 128, 128, 1, 2, "op", "torch.compile", 6514, 62.0,
                  "Table 3, row FSDP + torch.compile"),
    TorchtitanRun("Llama 3 8B", 128, 128, 1, 2, "op", "torch.compile, Float8", 8380, 61.8,
                  "Table 3, row FSDP + torch.compile + Float8"),
    TorchtitanRun("Llama 3 70B", 256, 32, 8, 16, "full", "torch.compile, Float8", 829, 71.9,
                  "Table 4, row 2D"),
]
# The benchmark on MFU: "the 1D Llama 3.1 8B model training on 8 or 128 H100 GPUs without Float8
# achieves 33% to 39% MFU (with or without torch.compile, respectively)" [sic: its tables give 33 %
# without torch.compile and 39 % with], against the SXM's peak (its footnote 2: its 500 W HBM2e
# H100s peak lower, by an amount it does not know, so the true MFU is higher).
TORCHTITAN_MFU = (0.33, 0.39)
