"""Lesson 04, measuring communication: notebooks/04_measuring_communication.ipynb.

workers: timing in the ranks, and the formulas (torch only). published: figures from elsewhere,
with their sources. plots: drawn in the kernel. exercises: the checked exercises; solutions:
their reference solutions.
"""

NOTEBOOK = "04_measuring_communication.ipynb"
