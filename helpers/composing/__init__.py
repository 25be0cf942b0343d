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

# Earlier lessons' strategies this one builds on (tests/test_structure.py checks the imports):
BUILDS_ON = {
    "data_parallelism.ddp": "DDP around tensor-parallel blocks; its buckets",
    "tensor_parallelism.megatron": "lesson 08's blocks and plan on a mesh",
    "pipeline_parallelism.schedule": "lesson 09's pipeline_step on a mesh",
    "zero_and_fsdp.memory": "the projection: lesson 07's memory formulas",
    "tensor_parallelism.cost": "the projection: lesson 08's bytes per layer",
}
