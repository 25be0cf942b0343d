"""Lesson 12, checkpoints and failures: notebooks/12_checkpoints_and_failures.ipynb.

sharded: a full state dict gathered to rank 0 beside torch.distributed.checkpoint (DCP), the
bytes each rank writes and reads, the metadata's map of pieces, and loads into another world size
and layout (FSDP on 2 ranks, DP × TP, one process), and lesson 08's hand-built tensor-parallel
block given to DCP as DTensors. resume: a training loop that resumes exactly
from its newest checkpoint (model, optimizer, sampler position, RNG states), keep_last, and
async_save. resize: resuming on another number of ranks, the data position one count of samples
consumed. interval: how often to save (Young's formula) and the time lost.
elastic: the same loop under torchrun --max-restarts, a rank killed and the job restarted.
failures: what peers see when a rank dies or freezes, and a rank out of step found with
TORCH_DISTRIBUTED_DEBUG=DETAIL, monitored_barrier and the flight recorder. plots: drawn in the
kernel. exercises: the checked exercises; solutions: their reference solutions.
"""

NOTEBOOK = "12_checkpoints_and_failures.ipynb"
NEEDS = (7, 8, 10)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("checkpoint and resume a sharded run exactly, reshard it on load, and find the rank that "
          "failed")
# Its notebook is one of a tier's longest files, and no rounding can change its outputs: a
# tier starts it first, and the other-CPU tier leaves it out (helpers/lessons.py).
SLOW = True
ROUNDING_FREE = True

# The names this lesson takes from earlier lessons, each a strategy or a formula it builds on
# (tests/test_structure.py checks the imports, name by name):
BUILDS_ON = {
    "tensor_parallelism.megatron:parallelize_block":
        "lesson 08's hand-built tensor-parallel block, saved with DCP",
    "tensor_parallelism.megatron:plan_style": "lesson 08's plan: which of its layers are cut how",
}
