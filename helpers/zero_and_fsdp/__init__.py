"""Lesson 07, ZeRO and FSDP: notebooks/07_zero_and_fsdp.ipynb.

memory: where the bytes go, per parameter and per rank (the ZeRO paper's formulas), and a
calculator; what a rank actually holds is counted by helpers.strategies.held_bytes. sharding:
cutting a tensor into n equal flat shards, and the two collectives that move them (all-gather,
reduce-scatter). sharded_optimizer: ZeRO stages 1 and 2, readable. bucketed_optimizer: the same
in flat buckets, reduce-scattered during backward, as they are shipped. fsdp: ZeRO stage 3.
workers: run in the ranks (torch only). plots and widgets: drawn in the kernel. exercises and
solutions: the checked exercises.
"""

NOTEBOOK = "07_zero_and_fsdp.ipynb"
NEEDS = (6,)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("shard optimizer state, gradients and weights (ZeRO 1 to 3, FSDP2) and predict each "
          "rank's memory to the byte")
# Its notebook is one of a tier's longest files: a tier starts it first (helpers/lessons.py).
SLOW = True

# The names this lesson takes from earlier lessons, each a strategy or a formula it builds on
# (tests/test_structure.py checks the imports, name by name):
BUILDS_ON = {
    "data_parallelism.ddp:bucket_indices": "lesson 06's buckets, reduce-scattered",
    "data_parallelism.ddp:at_end_of_backward":
        "lesson 06's DDP finishes its sync at the end of backward; so do the bucketed ZeRO "
        "and ZeRO-3",
    "data_parallelism.ddp:broadcast_from_first": "lesson 06's DDP starts replicas equal",
}
