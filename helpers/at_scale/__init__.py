"""Lesson 13, at scale without a cluster: notebooks/13_at_scale.ipynb.

Real model sizes on fake ranks, and PyTorch's own accounting of their memory and communication,
trusted only where it agrees with real ranks, then the time a step takes. meta_init: a model
built on the meta device, laid out, moved with `to_empty` and initialised the same under every
layout (by helpers.llama.init_weights). accounting: one training step of a layout (the course's
`layouts.Plan`) on real or fake ranks, under
FSDPMemTracker, CommDebugMode and the course's Observer. timeline: the same step's memory after
every operation. step_time: a step's time from its FLOPs and bytes, calibrated on a published
run. fits: whether a GPU holds a layout, decided by a fake run, and how fast it runs; the sweep
of the lesson's question (sweep_8b.json) and the runs at real size (at_size.json), written by its
script. plots: drawn in the kernel. exercises: the checked exercises; solutions: their reference
solutions.
"""

NOTEBOOK = "13_at_scale.ipynb"
NEEDS = (7, 8, 10, 11)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("size a real model's run on fake ranks: each layout's memory per GPU and time per step")
# Its notebook is one of a tier's longest files, and no rounding can change its outputs: a
# tier starts it first, and the other-CPU tier leaves it out (helpers/lessons.py).
SLOW = True
ROUNDING_FREE = True

# The names this lesson takes from earlier lessons (tests/test_structure.py checks the imports):
BUILDS_ON = {
    "composing.strategy:MODELS": "lesson 10's Llama 3 shapes, whose projection is checked here",
}
