"""Which lessons exist: one notebook `notebooks/NN_name.ipynb` and one package `helpers.name` each,
and which tier of tests runs each lesson's notebook and test files.

A package is a lesson when it defines `NOTEBOOK`, the file name of its notebook. The exercise
engine (`helpers.exercises`) and `make figures` (`helpers.drawing`) find the lessons here, so a new
lesson needs no edit outside its own folder.

The tiers (Makefile; conftest.py's `--tier`) follow three more constants, which a lesson's
`__init__.py` sets only where it differs from the default:

- `TIER`: "test" (the default: `make test` runs its notebook), "long" (a notebook too long for
  `make test`, run by `make long`: the capstone's) or "cluster" (a notebook and tests that need a
  real Slurm cluster: `make cluster-tests` runs its notebook and its test files,
  `tests/test_name.py` and `tests/test_name_*.py`).
- `SLOW = True`: its notebook is one of a tier's longest files. A tier hands the slow notebooks to
  its workers first, the longest committed run first, so that short files fill in behind them.
  A test file among the longest says `STARTS_FIRST = True` itself (tests/test_exercises.py has a
  `SLOW` of its own) and starts after the slow notebooks, before the rest.
- `ROUNDING_FREE = True`: no rounding can change its notebook's outputs (whole numbers, timings
  nbval ignores, counts, messages, bit-for-bit and float64 comparisons), so the other-CPU tier
  leaves it out.

What a lesson needs first, for its title slide and the syllabus: `NEEDS`, the numbers of the
earlier lessons a student must have done (every lesson it takes code from among them,
tests/test_structure.py); () for the first.

What each tier runs, before its markers (`-m`) choose among the tests:

    --tier      notebooks                             test files
    test        TIER "test"                           all ("not cluster" leaves out the cluster's)
    long        TIER "long"                           none
    cluster     TIER "cluster"                        the cluster lessons'
    other-cpu   TIER "test", not ROUNDING_FREE        all but the cluster lessons'

Where the other-CPU tier runs a share of its cases (`--cases-share N`), its notebooks take turns
too (`turns`): make test has run each of them natively in the same run, and the other CPU's
rounding is checked for every one within N commits.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import pkgutil
from dataclasses import dataclass
from datetime import datetime

import helpers

TIERS = ("test", "long", "cluster")  # a lesson's TIER


@dataclass(frozen=True)
class Lesson:
    number: int  # 3
    stem: str  # "03_collectives": the notebook's file name without .ipynb
    package: str  # "helpers.collectives"
    tier: str = "test"  # TIER: one of TIERS
    slow: bool = False  # SLOW
    rounding_free: bool = False  # ROUNDING_FREE
    needs: tuple = ()  # NEEDS: the earlier lessons' numbers


def lessons() -> list:
    """Every lesson, in course order."""
    found = []
    for info in pkgutil.iter_modules(helpers.__path__):
        if not info.ispkg:
            continue
        package = importlib.import_module(f"helpers.{info.name}")
        if getattr(package, "NOTEBOOK", None):
            found.append(_lesson(package))
    return sorted(found, key=lambda lesson: lesson.number)


def _lesson(package) -> Lesson:
    """A lesson package's constants, checked: a mistyped tier would take its notebook out of every
    tier without a word."""
    stem = package.NOTEBOOK.removesuffix(".ipynb")
    tier = getattr(package, "TIER", "test")
    if tier not in TIERS:
        raise ValueError(f"{package.__name__}: TIER is {tier!r}; a lesson's tier is one of "
                         f"{', '.join(map(repr, TIERS))}")
    flags = {name: getattr(package, name, False)
             for name in ("SLOW", "ROUNDING_FREE")}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{package.__name__}: {name} is {value!r}; it is True or False")
    number, needs = int(stem[:2]), getattr(package, "NEEDS", ())
    if not (isinstance(needs, tuple) and all(isinstance(n, int) and 0 < n < number
                                             for n in needs)):
        raise ValueError(f"{package.__name__}: NEEDS is {needs!r}; it is a tuple of earlier "
                         "lessons' numbers")
    return Lesson(number, stem, package.__name__, tier, flags["SLOW"],
                  flags["ROUNDING_FREE"], tuple(sorted(needs)))


def lesson_of(path) -> Lesson | None:
    """The lesson a notebook or test file belongs to: `NN_name.ipynb` is the lesson's whose
    NOTEBOOK names it, `test_name.py` and `test_name_topic.py` are lesson `name`'s. None for a
    shared test file (test_launcher.py) or any other file."""
    path = pathlib.Path(path)
    if path.suffix == ".ipynb":
        return next((lesson for lesson in lessons() if lesson.stem == path.stem), None)
    if not _is_test_file(path):
        return None
    topic = path.stem.removeprefix("test_")
    owners = [lesson for lesson in lessons()
              if topic == _name(lesson) or topic.startswith(_name(lesson) + "_")]
    return max(owners, key=lambda lesson: len(_name(lesson)), default=None)


def _name(lesson: Lesson) -> str:
    return lesson.package.rpartition(".")[2]


def _is_test_file(path: pathlib.Path) -> bool:
    return path.suffix == ".py" and path.name.startswith("test_")


def tiers_of(path) -> set | None:
    """The tiers (`pytest --tier`) that run a notebook or a test file, by the table above; None
    for any other file. A notebook that no lesson names (a learner's own, from `make lab`) is in
    none."""
    path = pathlib.Path(path)
    if path.suffix != ".ipynb" and not _is_test_file(path):
        return None
    lesson = lesson_of(path)
    if path.suffix == ".ipynb":
        if lesson is None:
            return set()
        again = lesson.tier == "test" and not lesson.rounding_free
        return {lesson.tier} | ({"other-cpu"} if again else set())
    if lesson is not None and lesson.tier == "cluster":
        return {"test", "cluster"}
    return {"test", "other-cpu"}


def start_key(path, starts_first: bool = False) -> tuple:
    """Where a file goes in its tier's order (conftest.py sorts the items by it, stably): the slow
    notebooks first, the longest committed run first; then the test files that say
    `STARTS_FIRST = True` (`starts_first`); then the rest, in the order pytest collected them.
    Under `--dist loadfile --no-loadscope-reorder` each worker takes whole files in this order, so
    the longest start at once and short ones fill in behind them."""
    path = pathlib.Path(path)
    lesson = lesson_of(path) if path.suffix == ".ipynb" else None
    if lesson is not None and lesson.slow:
        return (0, -notebook_seconds(path))
    return (1, 0) if starts_first else (2, 0)


def notebook_seconds(path) -> float:
    """How long the notebook's committed run took: the sum over its code cells of the time from
    the kernel's taking the cell (`iopub.execute_input`) to its reply (`shell.execute_reply`),
    which nbconvert writes in each cell's metadata. A cell without them counts 0."""
    cells = json.loads(pathlib.Path(path).read_text())["cells"]
    return sum(cell_seconds(cell) for cell in cells if cell["cell_type"] == "code")


def cell_seconds(cell) -> float:
    """How long a code cell took in its notebook's committed run (notebook_seconds); 0 without
    the times."""
    times = cell.get("metadata", {}).get("execution", {})
    if not {"iopub.execute_input", "shell.execute_reply"} <= times.keys():
        return 0.0
    return (datetime.fromisoformat(times["shell.execute_reply"])
            - datetime.fromisoformat(times["iopub.execute_input"])).total_seconds()


def turns(paths, share: int) -> dict:
    """{notebook: its turn, 0 to share - 1}: the notebooks dealt out so that each turn's committed
    seconds are near a share of the whole (the longest first, each to the turn with the fewest
    seconds so far; ties to the lower turn, and equal seconds by path, so that every worker deals
    alike). A run of the tier takes the turn its commit's number modulo `share` names."""
    seconds = {path: notebook_seconds(path) for path in paths}
    load, dealt = [0.0] * share, {}
    for path in sorted(seconds, key=lambda path: (-seconds[path], str(path))):
        turn = load.index(min(load))
        dealt[path] = turn
        load[turn] += seconds[path]
    return dealt
