"""helpers: the package every notebook of the course calls.

`run(worker, world_size)` starts the ranks and brings their results back (helpers.launch); each
lesson's worker functions live in a module of their own (helpers.groups for lesson 01, ...).
"""

from helpers.launch import RunResult, default_backend, get_device, run
from helpers.report import WorkerError, WorkerTimeout

__all__ = ["RunResult", "WorkerError", "WorkerTimeout", "default_backend", "get_device", "run"]
