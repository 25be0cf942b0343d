"""Lesson 14, the capstone: notebooks/14_capstone.ipynb.

A Llama of the course's own learns to write Python from the standard library's source, on a 2 x 2
mesh with everything the course taught at once, survives a killed rank under torchrun, and is
profiled. corpus: the text, its held-out split and the unigram baseline. train: the recipe
(`Config`), the loop (`train_worker`, every step equal in float64 to `one_process`) and its
checkpoints. job: the same loop as a torchrun script, with a kill, Ctrl-C and a progress line;
__main__: `make train`, that script for 600 steps, and the committed record of one such run
(trained.json). sample: what a model writes. profiled: two steps under torch.profiler, what each
choice of the recipe costs, and the machine's matmul peak; traces: compute, communication and
their overlap, read from the profiler's traces. plots: drawn in the kernel. exercises: the checked
exercises; entry: the torchrun script the entry-point exercise's checker runs; solutions: their
reference solutions.
"""

NOTEBOOK = "14_capstone.ipynb"
NEEDS = (8, 10, 11, 12, 13)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("write one training loop that combines every technique, and make it survive a kill")
# Its notebook, a minute of training (two under make test's load), runs in a tier of its own
# (make long), so that make test keeps its 8 minutes. It is left out of the other-CPU tier too:
# its rounding-dependent outputs are verdicts with wide margins (half a bit per byte below the
# baseline; 0.1 between the 4 ranks' and one process's validation losses); its float64
# equalities run there as tests (tests/test_capstone.py, marked numerical). Checked once by
# hand under that tier's setting.
TIER = "long"

# The names this lesson takes from earlier lessons (tests/test_structure.py checks the imports):
BUILDS_ON = {
    "checkpoints_and_failures.resume:checkpoint_path": "lesson 12's checkpoint folders",
    "checkpoints_and_failures.resume:keep_last": "lesson 12's checkpoint folders",
    "checkpoints_and_failures.resume:latest_checkpoint": "lesson 12's checkpoint folders",
    "checkpoints_and_failures.resume:load_training": "lesson 12's checkpoint (the exercise's "
                                                     "reference solution)",
    "checkpoints_and_failures.resume:training_state": "lesson 12's checkpoint (the exercise's "
                                                      "reference solution)",
    "checkpoints_and_failures.elastic:FINAL_FILE": "lesson 12's torchrun job",
    "checkpoints_and_failures.elastic:Job": "lesson 12's torchrun job",
    "checkpoints_and_failures.elastic:agent_story": "lesson 12's reading of torchrun's agent "
                                                    "(the entry-point exercise's messages)",
    "checkpoints_and_failures.elastic:run_torchrun": "lesson 12's torchrun job",
    "checkpoints_and_failures.elastic:torchrun_command": "lesson 12's torchrun job",
    "checkpoints_and_failures.elastic:torchrun_environment": "lesson 12's torchrun job",
    "tensor_parallelism.megatron:plan_style": "lesson 08's plan, which the capstone exercise's "
                                              "reference solution lays out",
}
