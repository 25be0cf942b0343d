"""Lesson 03, collectives: notebooks/03_collectives.ipynb.

workers: run in the ranks (torch only). plots and widgets: drawn in the kernel. exercises: the
checked exercises; solutions: their reference solutions.
"""

NOTEBOOK = "03_collectives.ipynb"
