"""Lesson 03, collectives: notebooks/03_collectives.ipynb.

workers: run in the ranks (torch only). plots and widgets: drawn in the kernel. exercises: the
checked exercises; solutions: their reference solutions.
"""

NOTEBOOK = "03_collectives.ipynb"
NEEDS = (1,)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("choose the collective a pattern needs, and compute on sharded data with it")
