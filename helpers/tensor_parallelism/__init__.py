"""Lesson 08, tensor and sequence parallelism: notebooks/08_tensor_parallelism.ipynb.

lecture: CS336 lecture 8's tensor-parallel forward, run as it is, and rebuilt from slices of one
weight. megatron: the conjugate operators f and g, ColumnParallelLinear, RowParallelLinear and a
tensor-parallel transformer block, with sequence parallelism, and BLOCK_PLAN, which says how
the block is cut. memory: the activations a rank keeps for backward, by formula. cost: FLOPs and
bytes of a layer, and projections onto published hardware. checks: the dense module in one
process, and how far each rank is from it (in the kernel). workers: run in the ranks (torch
only). plots: drawn in the kernel. exercises: the checked exercises; solutions: their reference
solutions.
"""

NOTEBOOK = "08_tensor_parallelism.ipynb"
NEEDS = (3, 6)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("split a transformer's MLP, attention and sequence over ranks as Megatron does, equal to "
          "one process")
