"""Lesson 06, data parallelism: notebooks/06_data_parallelism.ipynb.

lecture: CS336 lecture 8's data-parallel loop, run as it is. ddp: average_gradients (the naive
loop) and DDP, a hand-built DistributedDataParallel. step_model: the alpha-beta model of a
training step's communication. workers: run in the ranks (torch only). experiments: run from the
kernel (they start ranks).
plots and widgets: drawn in the kernel. exercises: the checked exercises; solutions: their
reference solutions.
"""

NOTEBOOK = "06_data_parallelism.ipynb"
NEEDS = (3, 5)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("train with data parallelism equal to one process, by hand and with DDP, and count its "
          "bytes")

# The names this lesson takes from earlier lessons, each a strategy or a formula it builds on
# (tests/test_structure.py checks the imports, name by name):
BUILDS_ON = {
    "how_all_reduce_works.algorithms:ring_all_reduce": "lesson 05's ring, on gradients",
}
