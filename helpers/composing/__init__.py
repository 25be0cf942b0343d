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
