"""Lesson 05, how all-reduce works: notebooks/05_how_all_reduce_works.ipynb.

algorithms: the plain ring and the trees, from point-to-point calls. pipelined_ring: the fast ring,
for benchmarks/ring.py. workers: run in the ranks (torch only), and the cost models. plots and
widgets: drawn in the kernel. exercises: the checked exercises; solutions: their reference
solutions.
"""

NOTEBOOK = "05_how_all_reduce_works.ipynb"
NEEDS = (2, 3, 4)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("run ring and tree all-reduce step by step, and say which wins at which size and scale")
