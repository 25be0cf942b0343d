"""The exercise engine: `check(name, your_function)` runs a learner's function, says what differed.

    from helpers.exercises import check
    check("broadcast_from_p2p", my_broadcast)

Each lesson's exercises live with the lesson (`helpers.<lesson>.exercises`, a dict `EXERCISES` of
name -> `Exercise`), and their reference solutions beside them (`helpers.<lesson>.solutions`, one
function per exercise, of the same name). `check` runs the learner's function through
`helpers.run` on several world sizes and inputs, compares every rank's result with the expected
one (computed here, in the kernel, without any communication), and answers in plain words:
passed, or what differed on which rank, or where it hung, or what it raised.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import os
import reprlib
import shutil
import tempfile
import textwrap
import traceback
from dataclasses import dataclass, field, replace

import torch

from helpers import rules as rules_module
from helpers.launcher import run
from helpers.launcher.report import (
    WorkerError,
    WorkerTimeout,
    format_traceback,
    is_consequence,
    stable_message,
)
from helpers.rules import CallRecorder, RuleBroken

HTML_WIDTH = 100  # characters a line of a checker's message takes, shown as HTML (_wrapped)
# A line of a message longer than this (a long task's statement, about 8 lines of a slide) is shown
# folded in HTML, under its label ("The task"), so that the message fits a slide: a click unfolds it
FOLDED_LINE = 800


@dataclass
class Exercise:
    task: str  # one sentence: what the function must return on each rank
    cases: list  # [(world_size, args)] for workers; [args] for plain functions
    expected: callable  # expected(rank, world_size, *args) or expected(*args) for plain functions
    inputs: callable = None  # inputs(rank, world_size, *args), or inputs(*args): what it is given
    distributed: bool = True
    timeout: float = 10
    rules: tuple = ()  # helpers.rules.Rule: what the task forbids or requires, checked in the ranks
    names: tuple = ()  # for a tuple result, what each element is: ("the mean", "the variance")
    hint: str = ""  # shown under a wrong value: a question that points at the usual mistake
    hint_for: callable = None  # hint_for(got, expected, world_size, *args), or (got, expected,
    # *case) for plain functions: a hint for this
    # wrong value in particular (a known mistake recognised), or None for `hint`
    harness: callable = None  # plain functions: harness(function, *inputs) calls the learner's
    # function and returns what is compared with expected (values measured around the call), or
    # a sentence (a str) that says what went wrong before there was any value to compare
    lesson: str = ""  # the lesson's package, e.g. "helpers.collectives" (filled in by `exercises`)
    rel_tol: float = 1e-4  # how near a float must be (see _compare); a float64 result that must
    # repeat the same operations, as a resumed run's losses, asks for far less
    points: int = 1  # what it is worth when graded (helpers.grading): 1, 2 for one its notebook
    # calls harder, 3 for a design exercise, whose statement says what must hold, not how
    by_hand: str = ""  # why the grader's sandbox cannot check it, where it cannot: its rows then
    # say "by hand" and why, and the instructor runs the student's cell

    def worker(self, function, log_dir: str):
        """The worker that `run` starts: hands each rank its inputs and calls the learner's code,
        with every communication call logged to `log_dir` and checked against the rules."""
        inputs = self.inputs or (lambda rank, world_size, *args: args)
        task_rules = self.rules

        def call_with_inputs(rank, world_size, *args):
            log_file = rules_module.log_path(log_dir, rank)
            with CallRecorder(task_rules, log_file, function):
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
        """The message, green or red; a line longer than FOLDED_LINE folded under its label (the
        words before its first colon), to be unfolded with a click."""
        import html

        color = "#2e7d32" if self.passed else "#c62828"
        style = f"border-left: 4px solid {color}; padding-left: 8px"
        shown, kept = [], []
        for line in repr(self).split("\n"):
            label, colon, _ = line.partition(": ")
            if len(line) <= FOLDED_LINE or not colon:
                kept.append(line)
                continue
            if kept:
                shown.append(f"<pre style='{style}'>{html.escape(_wrapped(chr(10).join(kept)))}"
                             "</pre>")
                kept = []
            shown.append(f"<details style='{style}'><summary>{html.escape(label)} (a click "
                         f"unfolds it)</summary><pre>{html.escape(_wrapped(line))}</pre></details>")
        if kept:
            shown.append(f"<pre style='{style}'>{html.escape(_wrapped(chr(10).join(kept)))}</pre>")
        return "".join(shown)


def _wrapped(text: str, width: int = HTML_WIDTH) -> str:
    """Every line of `text` cut at `width` characters, its continuation indented under it: a
    message's long lines must not run off a slide (JupyterLab's sanitizer drops the CSS that
    would wrap them)."""
    lines = []
    for line in text.split("\n"):
        indent = line[:len(line) - len(line.lstrip())]
        lines.append(textwrap.fill(line, width, subsequent_indent=indent + "    ",
                                   break_long_words=True, break_on_hyphens=False)
                     if len(line) > width else line)
    return "\n".join(lines)


@functools.cache
def exercises() -> dict:
    """Every lesson's exercises, name -> Exercise, in course order."""
    from helpers.lessons import lessons

    found = {}
    for lesson in lessons():
        try:
            module = importlib.import_module(f"{lesson.package}.exercises")
        except ModuleNotFoundError as error:
            if error.name != f"{lesson.package}.exercises":
                raise
            continue
        for name, exercise in module.EXERCISES.items():
            if name in found:
                raise ValueError(f"two lessons define an exercise named {name!r}")
            found[name] = replace(exercise, lesson=lesson.package)
    return found


class SolutionWithheld(LookupError):
    """A student release (`make release`) has no reference solutions."""


def solution(name: str):
    """The reference solution of exercise `name` (helpers.<lesson>.solutions.<name>); in a
    student release, which has none, SolutionWithheld says so."""
    package = _exercise(name).lesson
    try:
        module = importlib.import_module(f"{package}.solutions")
    except ModuleNotFoundError as error:
        if error.name != f"{package}.solutions":
            raise
        raise SolutionWithheld(
            f"the reference solution of {name!r} is withheld in this copy of the course (a "
            "student release): your instructor has it. check() tells you what differs.") from None
    return getattr(module, name)


def solutions_withheld() -> bool:
    """Whether this copy of the course is a student release, without reference solutions."""
    from helpers.lessons import lessons

    return not any(importlib.util.find_spec(f"{lesson.package}.solutions")
                   for lesson in lessons())


def _exercise(name: str) -> Exercise:
    known = exercises()
    if name not in known:
        raise KeyError(f"no exercise named {name!r}; there are: {', '.join(known)}")
    return known[name]


def check(name: str, function, timeout: float | None = None) -> CheckResult:
    """Run `function` on every case of exercise `name` and say what differed, if anything.
    `timeout` (seconds per case) overrides the exercise's own."""
    exercise = _exercise(name)
    if not callable(function):
        return CheckResult(name, False, [
            f"check() needs your function itself, got {type(function).__name__} "
            f"{reprlib.repr(function)}: "
            f"pass the function's name, without calling it: check({name!r}, my_function)"])
    if _only_raises_not_implemented(function):  # the notebook's stub: greeted, nothing started
        return CheckResult(name, False, _not_started(exercise))
    if timeout is not None:
        exercise = replace(exercise, timeout=timeout)
    for case in exercise.cases:
        problem = _check_case(exercise, function, case)
        if problem:
            return CheckResult(name, False, problem)
    sizes = sorted({case[0] for case in exercise.cases}) if exercise.distributed else None
    if sizes:
        where = f"on {', '.join(map(str, sizes))} ranks"
    else:
        where = f"on {len(exercise.cases)} inputs"
    return CheckResult(name, True, [f"Every result was right, {where}."])


def _check_case(exercise, function, case):
    mismatch = _signature_problem(exercise, function, case)
    if mismatch:
        return mismatch
    if not exercise.distributed:
        given = exercise.inputs(*case) if exercise.inputs else case
        where = (f"the case {_labelled(exercise.expected, given)}" if exercise.harness
                 else f"the input {_labelled(function, given)}")
        try:
            got = exercise.harness(function, *given) if exercise.harness else function(*given)
        except NotImplementedError:
            return _not_started(exercise)
        except Exception as error:  # noqa: BLE001 - the student's code may raise anything
            said = f": {error}" if str(error) else " (with no message)"
            # a rank's error (a harness that runs ranks) carries that rank's traceback already
            ranks = isinstance(error, (WorkerError, WorkerTimeout))
            return [f"For {where}, your function raised {type(error).__name__}{said}",
                    *([] if ranks else _learners_traceback(error, exercise))]
        expected = exercise.expected(*case)
        if exercise.harness and isinstance(got, str) and not isinstance(expected, str):
            problem = got  # the harness's own sentence: what went wrong before any value
        else:
            problem = _compare(got, expected, exercise.names, exercise.rel_tol)
        if not problem:
            return None
        hint = (exercise.hint_for and exercise.hint_for(got, expected, *case)) or exercise.hint
        return [f"For {where}: {problem}", *([f"Hint: {hint}"] if hint else [])]
    world_size, args = case
    log_dir = tempfile.mkdtemp(prefix="helpers-check-")
    try:
        problem = _check_ranks(exercise, function, world_size, args, log_dir)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    if problem and args and problem != _not_started(exercise):
        # which case, by the names the task's own expected() gives them
        names = list(inspect.signature(exercise.expected).parameters)[2:]
        if len(names) == len(args):
            problem = [*problem, "The case: " + ", ".join(
                f"{name}={_described(value)}" for name, value in zip(names, args)) + "."]
    return problem


def _described(value) -> str:
    """A case's argument as the learner would write it; a tensor by its shape and dtype (its
    values are in the message above, where they differ)."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, {str(value.dtype).replace('torch.', '')}"
    return repr(value)


def _signature_problem(exercise, function, case) -> list | None:
    """Where the learner's function cannot take the arguments the task calls it with, say so
    before anything runs (a TypeError raised at the call itself shows no line of theirs). A
    harness, or an exercise's own worker, calls the function its own way, and checks nothing
    here."""
    if exercise.harness is not None or type(exercise).worker is not Exercise.worker:
        return None
    if exercise.distributed:
        world_size, args = case
        given = (0, world_size, *(exercise.inputs(0, world_size, *args) if exercise.inputs
                                  else args))
    else:
        given = exercise.inputs(*case) if exercise.inputs else case
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a callable without one (a builtin): let the call say
        return None
    try:
        signature.bind(*given)
    except TypeError as error:
        names = list(inspect.signature(exercise.expected).parameters)
        called = ", ".join(names) if len(names) == len(given) else f"{len(given)} arguments"
        return [f"Your function cannot be called as the task calls it, with ({called}): "
                f"{getattr(function, '__name__', 'it')}{signature} says: {error}.",
                f"The task: {exercise.task}."]
    return None


def _learners_traceback(error, exercise) -> list:
    """The traceback of an exception raised in a plain function, from the learner's own code on
    (the engine's and the harness's frames left out, torch's folded as the launcher folds them);
    empty if the learner's code is not in it (the harness itself raised)."""
    frames = [(frame.filename, frame.lineno, frame.name)
              for frame in traceback.extract_tb(error.__traceback__)]
    own = {os.path.abspath(__file__)}
    if exercise.harness is not None:
        own.add(os.path.abspath(inspect.getsourcefile(exercise.harness)))
    while frames and os.path.abspath(frames[0][0]) in own:
        frames.pop(0)
    if not frames:
        return []
    text = format_traceback(frames, type(error).__name__, stable_message(str(error)), rank=None)
    return ["Traceback (most recent call last):", *text.splitlines()[1:]]


def _check_ranks(exercise, function, world_size, args, log_dir):
    on = f"On {world_size} ranks"
    failure = out = None
    try:
        out = run(exercise.worker(function, log_dir), world_size, args=args,
                  timeout=exercise.timeout, show_output=False)
    except (WorkerTimeout, WorkerError) as error:
        failure = error
    if isinstance(failure, WorkerError) and failure.type_name == "NotImplementedError":
        return _not_started(exercise)
    if isinstance(failure, WorkerError) and failure.type_name == RuleBroken.__name__:
        return [f"{on}, rank {failure.rank} broke a rule: {failure.message}"]
    logs = rules_module.read_logs(log_dir, world_size)
    broken = next((problem for rule in exercise.rules
                   if (problem := rule.broken_by(logs, world_size, args,
                                                 finished=failure is None))), None)
    if broken:  # a broken rule explains a hang or a wrong value better than the symptom does
        return [f"{on}: {broken}"]
    if isinstance(failure, WorkerTimeout):
        return [f"{on} your function did not finish within {exercise.timeout:g} s "
                "(a deadlock?). Where each rank was:", *str(failure).splitlines()[1:],
                "Each rank's last communication call, the one it waits in if it is blocked:",
                *(f"  rank {rank}: {_describe(made[-1])}"
                  for rank, calls in sorted(logs.items())
                  if (made := [call for call in calls if call.name not in rules_module.MARKS]))]
    if isinstance(failure, WorkerError):
        lines = [f"{on}:", *str(failure).splitlines()]
        if is_consequence(failure.message):
            lines.append(f"Hint: rank {failure.rank} was still waiting for a partner that had "
                         "already returned or failed. Is there a recv without a matching send "
                         "(or a collective that not every rank calls)?")
        return lines
    for rank, got in enumerate(out):
        expected = exercise.expected(rank, world_size, *args)
        problem = _compare(got, expected, exercise.names, exercise.rel_tol)
        if problem:
            hint = (exercise.hint_for and exercise.hint_for(got, expected, world_size, *args)
                    ) or exercise.hint
            return [f"{on}, rank {rank}: {problem}", *([f"Hint: {hint}"] if hint else [])]
    return None


def _describe(call) -> str:
    """A logged call as code: dist.recv(src=0), dist.all_reduce(group=[0, 1])."""
    if call.name in ("send", "isend"):
        return f"dist.{call.name}(dst={call.detail})"
    if call.name in ("recv", "irecv"):
        return f"dist.{call.name}(src={call.detail})"
    if call.name == "batch_isend_irecv":
        ops = ", ".join(f"{op} {'to' if op == 'isend' else 'from'} {peer}"
                        for op, peer in call.detail)
        return f"dist.batch_isend_irecv([{ops}])"
    if call.name == "new_group":
        return f"dist.new_group({call.detail['ranks']})"
    return f"dist.{call.name}({'' if call.detail is None else f'group of ranks {call.detail}'})"


def _labelled(function, given: tuple) -> str:
    """The inputs by the names of the learner's own parameters: `world_size=4, rank=3`."""
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return repr(given)
    if len(names) != len(given):
        return repr(given)
    return ", ".join(f"{name}={value!r}" for name, value in zip(names, given))


def _only_raises_not_implemented(function) -> bool:
    """Whether `function` is a stub, `raise NotImplementedError` and nothing else: the only name
    its code uses. (A check that starts ranks or torchrun for it takes seconds to say so.)"""
    code = getattr(function, "__code__", None)
    return code is not None and code.co_names == ("NotImplementedError",)


def _not_started(exercise):
    return ["This exercise is waiting for your code: replace the `raise NotImplementedError` "
            "line with your solution, then run the cell again.",
            f"The task: {exercise.task}."]


def _compare(got, expected, names=(), rel_tol=1e-4) -> str | None:
    """None if `got` matches `expected`, else a sentence saying how it differs. The type asked
    for is part of the answer: a tensor is not an int, and a float is not a tensor."""
    if isinstance(expected, torch.Tensor):
        return _compare_tensors(got, expected)
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            return f"expected a dict with keys {sorted(expected)}, got {_short(got)}"
        for key, want in expected.items():
            problem = _compare(got[key], want, rel_tol=rel_tol)
            if problem:
                return f"{key!r}: {problem}"
        return None
    if isinstance(expected, (tuple, list)) and any(isinstance(e, torch.Tensor) for e in expected) \
            or isinstance(expected, tuple):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            return f"expected {len(expected)} values, got {_short(got)}"
        for index, (one, want) in enumerate(zip(got, expected)):
            problem = _compare(one, want, rel_tol=rel_tol)
            if problem:
                return f"{names[index]}: {problem}" if names else f"value {index}: {problem}"
        return None
    if isinstance(expected, bool) or not isinstance(expected, (int, float)):
        return None if got == expected else f"expected {expected!r}, got {got!r}"
    kind = type(expected).__name__
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        how = " (tensor.item() gives one)" if isinstance(got, torch.Tensor) else ""
        return f"expected a Python {kind}{how}, got {type(got).__name__} {got!r}"
    if isinstance(expected, int) and not isinstance(got, int):
        if got != expected:  # a wrong value first: the type is the smaller mistake
            return f"expected {expected}, got {got!r}"
        return f"expected a Python int, got {type(got).__name__} {got!r}"
    if isinstance(expected, int):  # counts (bytes, elements) are exact
        return None if got == expected else f"expected {expected}, got {got}"
    # A number a learner computes (a norm, a mean loss, a fitted time) may come from float32
    # sums in another order than the solution's, or from a fit on other points: 1e-4 relative is
    # hundreds of float32 epsilons (2**-23), while a wrong formula misses by its own size.
    if not math.isclose(got, expected, rel_tol=rel_tol, abs_tol=min(1e-6, rel_tol)):
        return f"expected {_side_by_side(expected, got)}"
    return None


def _side_by_side(expected: float, got: float) -> str:
    """"a, got b" with as many significant digits as it takes for them to differ (6 at least),
    trailing zeros kept: the same precision on both sides."""
    for digits in range(6, 18):
        a, b = f"{expected:#.{digits}g}", f"{got:#.{digits}g}"
        if a != b:
            break
    return f"{a}, got {b}"


def _short(value) -> str:
    """A value as a message can show it: a dict by its keys, a list of tensors by its shapes."""
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(item, torch.Tensor) for item in value):
        shapes = ", ".join(str(tuple(item.shape)) for item in value)
        return f"a {type(value).__name__} of {len(value)} tensors of shapes {shapes}"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _compare_tensors(got, expected) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__} {got!r}"
    if got.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, got shape {tuple(got.shape)}"
    # Another order of the same float32 sums moves a value by at most about n * epsilon
    # (helpers.tolerance): 1e-5 is 84 epsilons, the worst case of 84 unit-sized terms, and in
    # practice far longer sums, whose rounding errors add up like a random walk (~ sqrt(n)).
    wrong = ~torch.isclose(got.to(expected.dtype), expected, rtol=1e-5, atol=1e-5)
    if not wrong.any():
        return None
    return _differences(got, expected, wrong) + _scale_hint(got, expected)


def _scale_hint(got, expected) -> str:
    """Two mistakes often differ only by a factor (a sum for a mean, a missing 1/m): name it."""
    got, expected = got.double(), expected.double()
    scale = (got * expected).sum() / (expected * expected).sum() if expected.any() else None
    if scale is None or not torch.isfinite(scale) or abs(scale) < 1e-6:
        return ""
    if torch.allclose(got, scale * expected, rtol=1e-4, atol=1e-6):
        return f". Your result is {scale.item():.4g} times the expected one"
    return ""


def _differences(got, expected, wrong) -> str:
    if expected.numel() <= 8:
        return f"expected {expected}, got {got}"
    flat = wrong.flatten().nonzero().flatten().tolist()
    first, last = flat[0], flat[0]  # the first run of consecutive wrong elements
    while last + 1 in flat:
        last += 1
    shown = slice(first, min(last + 1, first + 8))
    where = f"element {first}" if first == last else f"elements {first} to {last}"
    more = "" if len(flat) == last - first + 1 else f" (and {len(flat) - (last - first + 1)} more)"
    return (f"{where} of {expected.numel()} differ{'s' if first == last else ''}{more}: expected "
            f"{expected.flatten()[shown].tolist()}, got {got.flatten()[shown].tolist()}")
