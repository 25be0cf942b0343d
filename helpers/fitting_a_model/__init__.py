"""Lesson 11, fitting a model: notebooks/11_fitting_a_model.ipynb.

checkpointing: activation checkpointing (none, selective, full) on the course's Block, the bytes
autograd keeps measured against their formula, and the FLOPs recomputation adds, counted.
precision: mixed precision: autocast, what it keeps, float16 loss scaling, gradients reduced in
bfloat16, and lesson 07's compute_dtype beside FSDP2's MixedPrecisionPolicy. accumulation:
gradient accumulation under DDP, ZeRO-1/2/3 and FSDP2, bytes sent and gradients held against
their formulas. fsdp2_knobs: FSDP2's reshard_after_forward, prefetching and HSDP, measured.
plots: drawn in the kernel. exercises: the checked exercises; solutions: their reference
solutions.
"""

NOTEBOOK = "11_fitting_a_model.ipynb"
NEEDS = (7, 8, 10)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("fit a model in memory with recomputation, mixed precision and accumulation, and project "
          "it to a GPU")

# The names this lesson takes from earlier lessons, each a strategy or a formula it builds on
# (tests/test_structure.py checks the imports, name by name):
BUILDS_ON = {
    "tensor_parallelism.memory:block_formula":
        "lesson 08's count of the tensors a Block keeps for backward",
    "zero_and_fsdp.fsdp:FSDP": "lesson 07's FSDP, computing in bfloat16 beside FSDP2's policy",
}
