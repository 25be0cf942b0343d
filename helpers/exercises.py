"""Exercises that check themselves: lessons 01-05 end with a few, each checked by `check`.

    from helpers.exercises import check
    check("broadcast_from_p2p", my_broadcast)

`check` runs the student's function through `helpers.run` on several world sizes and inputs,
compares every rank's result with the expected one (computed here, in the kernel, without any
communication), and answers in plain words: passed, or what differed on which rank, or where it
hung, or what it raised. Reference solutions: `helpers.solutions` (tested in tests/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from helpers.launch import run
from helpers.report import WorkerError, WorkerTimeout, is_consequence


@dataclass
class Exercise:
    lesson: str
    task: str  # one sentence: what the function must return on each rank
    cases: list  # [(world_size, args)] for workers; [args] for plain functions
    expected: callable  # expected(rank, world_size, *args) or expected(*args) for plain functions
    inputs: callable = None  # inputs(rank, world_size, *args): what the student's function gets
    distributed: bool = True
    timeout: float = 10

    def worker(self, function):
        """The worker that `run` starts: hands each rank its inputs, calls the student's code."""
        inputs = self.inputs or (lambda rank, world_size, *args: args)

        def call_with_inputs(rank, world_size, *args):
            return function(rank, world_size, *inputs(rank, world_size, *args))

        return call_with_inputs


@dataclass
class CheckResult:
    """What `check` found; shows as plain text (and green or red in JupyterLab)."""

    exercise: str
    passed: bool
    lines: list = field(default_factory=list)

    def __repr__(self):
        mark = "PASSED" if self.passed else "NOT YET"
        return "\n".join([f"[{mark}] {self.exercise}", *self.lines])

    def _repr_html_(self):
        import html

        color = "#2e7d32" if self.passed else "#c62828"
        return (f"<pre style='border-left: 4px solid {color}; padding-left: 8px'>"
                f"{html.escape(repr(self))}</pre>")


def _vector(seed, numel=8):
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


EXERCISES = {
    # Lesson 01
    "even_odd_sum": Exercise(
        "01", "put the even ranks in one group and the odd ranks in another (dist.new_group); "
        "return the sum of the ranks in your own group, as a Python int",
        [(2, ()), (4, ()), (5, ())],
        lambda rank, n: sum(r for r in range(n) if r % 2 == rank % 2)),
    "column_sum": Exercise(
        "01", "with the ranks in a grid of `rows` rows (rank r at row r // cols, column r % cols), "
        "return the sum of the ranks in your column, using one group per column",
        [(4, (2,)), (6, (2,)), (6, (3,))],
        lambda rank, n, rows: sum(r for r in range(n) if r % (n // rows) == rank % (n // rows))),
    # Lesson 02
    "broadcast_from_p2p": Exercise(
        "02", "rank 0 gets `tensor`, the others a tensor of zeros of the same shape; using only send "
        "and recv, give every rank rank 0's values, and return them",
        [(2, (_vector(1),)), (3, (_vector(2),)), (5, (_vector(3, 5),))],
        lambda rank, n, tensor: tensor,
        inputs=lambda rank, n, tensor: (tensor if rank == 0 else torch.zeros_like(tensor),)),
    "ring_shift": Exercise(
        "02", "you get `tensor` = full((3,), rank); send it to rank + 1 and receive from rank - 1 "
        "(wrapping around), without deadlock; return what you received",
        [(2, ()), (3, ()), (4, ())],
        lambda rank, n: torch.full((3,), float((rank - 1) % n)),
        inputs=lambda rank, n: (torch.full((3,), float(rank)),)),
    # Lesson 03
    "mean_and_variance": Exercise(
        "03", "you get `shard`, chunk `rank` of a vector that no rank holds whole; return the mean "
        "and the (population) variance of the whole vector, as a pair of floats",
        [(2, (_vector(4, 12),)), (3, (_vector(5, 12),)), (4, (_vector(6, 10),))],
        lambda rank, n, vector: (float(vector.mean()), float(vector.var(unbiased=False))),
        inputs=lambda rank, n, vector: (vector.chunk(n)[rank],)),
    "all_gather_from_all_reduce": Exercise(
        "03", "you get `mine` = tensor([10.0 * rank]); using only all_reduce, return the "
        "tensor of every rank's number, in rank order",
        [(2, ()), (3, ()), (4, ())],
        lambda rank, n: 10.0 * torch.arange(n, dtype=torch.float32),
        inputs=lambda rank, n: (torch.tensor([10.0 * rank]),)),
    # Lesson 04 (plain functions, no ranks)
    "bus_bandwidth": Exercise(
        "04", "given op, world size n, size S in bytes and time t in seconds, return busbw in "
        "bytes/s with nccl-tests' factors",
        [("all_reduce", 4, 2**26, 0.05), ("reduce_scatter", 8, 2**24, 0.01),
         ("broadcast", 2, 2**20, 0.001), ("all_gather", 3, 3 * 2**20, 0.002)],
        lambda op, n, size, seconds: size / seconds * {
            "all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_gather": (n - 1) / n, "broadcast": 1.0}[op],
        distributed=False),
    "alpha_beta_from_two_points": Exercise(
        "04", "given two measurements (size1, t1) and (size2, t2) of t = alpha + size / beta, "
        "return (alpha, beta)",
        [(1e3, 1e-3 + 1e3 / 2e9, 1e8, 1e-3 + 1e8 / 2e9), (4096, 5e-6 + 4096 / 4e10, 2**30, 5e-6 + 2**30 / 4e10)],
        lambda s1, t1, s2, t2: ((t1 * s2 - t2 * s1) / (s2 - s1), (s2 - s1) / (t2 - t1)),
        distributed=False),
    # Lesson 05
    "ring_all_reduce": Exercise(
        "05", "you get `data`, a random tensor of your own; sum it across the ranks with a ring "
        "of send/recv or isend/irecv (no collectives), and return the sum",
        [(2, (24,)), (3, (24,)), (4, (24,))],
        lambda rank, n, numel: sum(_vector(r, numel) for r in range(n)),
        inputs=lambda rank, n, numel: (_vector(rank, numel),)),
    "tree_reduce": Exercise(
        "05", "you get `tensor` = full((4,), rank + 1.0); sum it onto rank 0 along a binary tree "
        "(rank p's children are 2p+1 and 2p+2) with send/recv; rank 0 returns the sum, the "
        "others None",
        [(2, ()), (5, ()), (7, ())],
        lambda rank, n: torch.full((4,), n * (n + 1) / 2) if rank == 0 else None,
        inputs=lambda rank, n: (torch.full((4,), rank + 1.0),)),
}


def check(name: str, function, timeout: float | None = None) -> CheckResult:
    """Run `function` on every case of exercise `name` and say what differed, if anything.
    `timeout` (seconds per case) overrides the exercise's own."""
    if name not in EXERCISES:
        raise KeyError(f"no exercise named {name!r}; there are: {', '.join(EXERCISES)}")
    exercise = EXERCISES[name]
    if timeout is not None:
        exercise = replace(exercise, timeout=timeout)
    for case in exercise.cases:
        problem = _check_case(exercise, function, case)
        if problem:
            return CheckResult(name, False, problem)
    sizes = sorted({case[0] for case in exercise.cases}) if exercise.distributed else None
    where = f"on {', '.join(map(str, sizes))} ranks" if sizes else f"on {len(exercise.cases)} inputs"
    return CheckResult(name, True, [f"Every result was right, {where}."])


def _check_case(exercise, function, case):
    if not exercise.distributed:
        try:
            got = function(*case)
        except NotImplementedError:
            return _not_started(exercise)
        except Exception as error:  # noqa: BLE001 - the student's code may raise anything
            return [f"Your function raised {type(error).__name__}: {error}"]
        problem = _compare(got, exercise.expected(*case))
        return [f"For the input {case}: {problem}"] if problem else None
    world_size, args = case
    try:
        out = run(exercise.worker(function), world_size, args=args, timeout=exercise.timeout,
                  show_output=False)
    except WorkerTimeout as timeout:
        return [f"On {world_size} ranks your function did not finish within {exercise.timeout:g} s "
                "(a deadlock?). Where each rank was:", *str(timeout).splitlines()[1:]]
    except WorkerError as error:
        if error.type_name == "NotImplementedError":
            return _not_started(exercise)
        lines = [f"On {world_size} ranks:", *str(error).splitlines()]
        if is_consequence(error.message):
            lines.append(f"Hint: rank {error.rank} was still waiting for a partner that had "
                         "already returned or failed. Is there a recv without a matching send "
                         "(or a collective that not every rank calls)?")
        return lines
    for rank, got in enumerate(out):
        problem = _compare(got, exercise.expected(rank, world_size, *args))
        if problem:
            return [f"On {world_size} ranks, rank {rank}: {problem}"]
    return None


def _not_started(exercise):
    return ["This exercise is waiting for your code: replace the `raise NotImplementedError` "
            "line with your solution, then run the cell again.",
            f"The task: {exercise.task}."]


def _compare(got, expected) -> str | None:
    """None if `got` matches `expected`, else a sentence saying how it differs."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__} {got!r}"
        if got.shape != expected.shape:
            return f"expected shape {tuple(expected.shape)}, got shape {tuple(got.shape)}"
        if not torch.allclose(got.to(expected.dtype), expected, rtol=1e-5, atol=1e-5):
            return f"expected {expected}, got {got}"
        return None
    if isinstance(expected, tuple):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            return f"expected {len(expected)} values, got {got!r}"
        problems = [_compare(g, e) for g, e in zip(got, expected)]
        return next((p for p in problems if p), None)
    if isinstance(expected, float):
        value = float(got) if isinstance(got, (int, float, torch.Tensor)) and torch.tensor(got).numel() == 1 else None
        if value is None or not math.isclose(value, expected, rel_tol=1e-4, abs_tol=1e-6):
            return f"expected {expected:.6g}, got {got!r}"
        return None
    if got != expected:
        return f"expected {expected!r}, got {got!r}"
    return None
