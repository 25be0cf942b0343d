"""Lesson 02, point to point: notebooks/02_point_to_point.ipynb.

workers: run in the ranks (torch only). plots: drawn in the kernel. exercises: the checked
exercises; solutions: their reference solutions.
"""

NOTEBOOK = "02_point_to_point.ipynb"
NEEDS = (1,)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("move tensors between ranks with send and recv, blocking or not, without deadlock")
# No rounding can change its notebook's outputs: the other-CPU tier leaves it out
# (helpers/lessons.py).
ROUNDING_FREE = True
