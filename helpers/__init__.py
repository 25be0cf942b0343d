"""helpers: the package every notebook of the course calls.

`run(worker, world_size)` starts the ranks and brings their results back; `spawn(fn, args,
nprocs)` does the same for code that starts its own process group (helpers.launcher). Each lesson
has a package named after its notebook: notebooks/03_collectives.ipynb uses helpers.collectives.
The models and the single-process training every parallel lesson is checked against are in
helpers.reference.

Imported in a Jupyter kernel, this starts the worker pool in the background (it imports torch
once, a few seconds), so that the first launch finds it ready. On a CPU without bfloat16
instructions, it has every process of the course compute bfloat16 matrix products in float32
and round them, the same arithmetic many times faster (helpers.bfloat16).
"""

import helpers.launcher  # starts the worker pool in a Jupyter kernel, before torch is imported

# isort: split
import helpers.bfloat16

helpers.bfloat16.install()  # nothing where PyTorch has fast bfloat16 kernels

__all__ = ["RunResult", "WorkerError", "WorkerInterrupted", "WorkerTimeout", "default_backend",
           "get_device", "run", "spawn", "warm_up"]


def __getattr__(name):
    """The launcher's names, loaded on first use (helpers.launcher)."""
    if name in __all__:
        return getattr(helpers.launcher, name)
    raise AttributeError(f"module 'helpers' has no attribute {name!r}")
