"""Lesson 04, measuring communication: notebooks/04_measuring_communication.ipynb.

workers: timing in the ranks (torch only); the formulas are helpers.cost_model's and the published
figures helpers.published's. experiments: the size sweeps, run from the kernel. plots: drawn in
the kernel. exercises: the checked exercises;
solutions: their reference solutions.
"""

NOTEBOOK = "04_measuring_communication.ipynb"
NEEDS = (3,)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("time a collective as its slowest rank, tell algbw from busbw, and fit the alpha-beta "
          "model")
# Its notebook is one of a tier's longest files, and no rounding can change its outputs: a
# tier starts it first, and the other-CPU tier leaves it out (helpers/lessons.py).
SLOW = True
ROUNDING_FREE = True
