"""Lesson 09, pipeline parallelism: notebooks/09_pipeline_parallelism.ipynb.

lecture: CS336 lecture 8's pipeline-parallel forward, run as it is, and its backward added.
schedule: pipeline_step, one training step of a stage with the GPipe, 1F1B or zero-bubble schedule
(its order, zb's rule, F, B and W, and the event log from an Observer's spans). p2p: its messages.
stages: the course's MLP cut into stages. ideal: the schedules with ideal times,
and the bubble of an event log. workers: run in the ranks (torch only). plots and widgets: drawn in
the kernel. exercises: the checked exercises; solutions: their reference solutions.
"""

NOTEBOOK = "09_pipeline_parallelism.ipynb"
NEEDS = (2, 6)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("run a model's stages as a pipeline under GPipe and 1F1B, and measure its bubble")
# Its notebook is one of a tier's longest files: a tier starts it first (helpers/lessons.py).
SLOW = True
