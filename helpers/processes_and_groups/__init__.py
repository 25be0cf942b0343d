"""Lesson 01, processes and process groups: notebooks/01_processes_and_groups.ipynb.

workers: run in the ranks (torch only). experiments: run from the kernel (they start ranks).
plots: drawn in the kernel. exercises: the checked
exercises; solutions: their reference solutions.
"""

NOTEBOOK = "01_processes_and_groups.ipynb"
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("start ranks that join one group, make subgroups on every rank, and read a failing rank's"
          " traceback")
# No rounding can change its notebook's outputs: the other-CPU tier leaves it out
# (helpers/lessons.py).
ROUNDING_FREE = True
