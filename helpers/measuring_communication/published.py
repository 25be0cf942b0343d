"""Figures published elsewhere that lesson 04 sets beside its measurements, each with its source.
None of them is measured here.
"""

# Vendor peak figures for comparison, NOT measured here. Per GPU, one direction.
PUBLISHED_LINKS = [
    ("PCIe 4.0 x16", 32e9, "PCI-SIG: 16 GT/s x 16 lanes, 128b/130b encoding"),
    ("PCIe 5.0 x16", 64e9, "PCI-SIG: 32 GT/s x 16 lanes"),
    ("InfiniBand NDR, one port", 50e9, "NVIDIA ConnectX-7: 400 Gb/s"),
    ("NVLink 3 (A100)", 300e9, "NVIDIA A100 datasheet: 600 GB/s total, both directions"),
    ("NVLink 4 (H100 SXM)", 450e9, "NVIDIA H100 datasheet: 900 GB/s total, both directions"),
]

# Published all_reduce sweeps, NOT measured here: (label, source, [(S bytes, busbw bytes/s)]).
_ML_ENGINEERING = ("S. Bekman, Machine Learning Engineering Open Book, "
                   "network/benchmarks/README.md (github.com/stas00/ml-engineering)")
PUBLISHED_SWEEPS = [
    ("8x H200, one node (NVLink 4 + NVSwitch), nccl-tests", _ML_ENGINEERING,
     [(2**15, 3.20e9), (2**20, 72.45e9), (2**24, 242.45e9), (2**26, 369.82e9),
      (2**30, 464.00e9), (2**34, 480.70e9)]),
    ("4 nodes of 8x B200 (32 ranks, across the network)", _ML_ENGINEERING,
     [(2**15, 0.65e9), (2**20, 12.47e9), (2**24, 71.80e9), (2**26, 197.77e9),
      (2**30, 365.99e9), (2**34, 376.71e9)]),
]
