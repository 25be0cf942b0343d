"""Lesson 10, composing strategies: notebooks/10_composing.ipynb.

mesh: a grid of ranks and its groups. hybrid: data x tensor parallelism on a 2-D mesh, by hand and
with PyTorch's fully_shard and parallelize_module, and data x tensor x pipeline on 8 ranks.
experts: a mixture-of-experts layer, one expert per rank, tokens moved with uneven all-to-alls.
weights: trainer ranks sending updated weights to inference ranks. ring_attention: context
parallelism, K/V blocks circulating around a ring. strategy: which combination fits, for real
model sizes (projections). experts, weights and ring_attention each hold their own topic's
workers; workers: the ranks' code for mesh and hybrid (torch only). plots: drawn in the kernel.
exercises: the checked exercises; solutions: their reference solutions.
"""

NOTEBOOK = "10_composing.ipynb"
NEEDS = (6, 7, 8, 9)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("compose data, tensor, pipeline, expert and context parallelism on one device mesh")

# The names this lesson takes from earlier lessons, each a strategy or a formula it builds on
# (tests/test_structure.py checks the imports, name by name):
BUILDS_ON = {
    "data_parallelism.ddp:DDP": "lesson 06's DDP, around tensor-parallel blocks",
    "data_parallelism.ddp:average_gradients": "lesson 06's gradient average, over a dp group",
    "data_parallelism.ddp:Bucket": "lesson 06's buckets, for sending weights",
    "data_parallelism.ddp:bucket_indices": "lesson 06's buckets, for sending weights",
    "tensor_parallelism.megatron:parallelize_block": "lesson 08's blocks, cut on a mesh",
    "tensor_parallelism.megatron:ReduceFromRegion": "lesson 08's g, in the exercise's solution",
    "pipeline_parallelism.schedule:pipeline_step": "lesson 09's pipeline_step on a mesh",
    "zero_and_fsdp.memory:bytes_per_rank": "the projection: lesson 07's memory formulas",
    "tensor_parallelism.cost:layer_bytes_sent": "the projection: lesson 08's bytes per layer",
}
