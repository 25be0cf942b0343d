"""Lesson 11, fitting a model: notebooks/11_fitting_a_model.ipynb.

checkpointing: activation checkpointing (none, selective, full) on the course's Block, the bytes
autograd keeps measured against their formula, and the FLOPs recomputation adds, counted. plots:
drawn in the kernel. exercises: the checked exercises; solutions: their reference solutions.
"""

NOTEBOOK = "11_fitting_a_model.ipynb"

# Earlier lessons' strategies this one builds on (tests/test_structure.py checks the imports):
BUILDS_ON = {
    "tensor_parallelism.memory": "lesson 08's count of the tensors a Block keeps for backward",
}
