"""Lesson 05, how all-reduce works: notebooks/05_how_all_reduce_works.ipynb.

workers: the plain ring and the trees, run in the ranks, and the cost models (torch only).
pipelined_ring: the fast ring, for benchmarks/ring.py. plots and widgets: drawn in the kernel.
exercises: the checked exercises; solutions: their reference solutions.
"""

NOTEBOOK = "05_how_all_reduce_works.ipynb"
