"""How the tiers (Makefile) choose their files, and run the notebooks under nbval.

- Each notebook's cells carry the marker `notebook`, so that a tier can select them with `-m`.
- nbval waits at most 5 s between two messages of a cell's output (its own constant), which a
  loaded 2-core machine can exceed. It is the one way nbval fails a cell that only shows code, as
  lesson 12's cell 25 failed once in three runs under ATEN_CPU_CAPABILITY=default beside three
  other notebooks. The wait is raised to NBVAL_OUTPUT_WAIT_S; a cell that hangs still ends at
  nbval's cell timeout.
- A cell's heartbeat (helpers.notebook: "still running", where a cell runs long) is left out of
  what nbval compares, on both sides: whether it shows depends on the machine's speed.
- No silent wait: a cell that runs longer than SILENT_CELL_S must show something, its own output,
  a progress bar or the heartbeat, within PROGRESS_WITHIN_S of its start, as a learner or a hall
  watching it live would see it. nbval's kernel messages are timed by the kernel's own clock
  (each message's header date: the test process's own load does not count), the cell fails
  where it was silent longer, and each tier that runs notebooks prints what it found. A
  notebook's first code cell, its imports, is left out (`watched_for_silence` says why).
- A kernel that dies before it answers is started again, up to KERNEL_STARTS times in all, with
  a warning that quotes its last words. Once in a CI run, beside pip installing another Python's
  environment, one kernel died so (nbval sends a kernel's stderr to /dev/null; the likeliest
  cause: jupyter_client picks the kernel's TCP ports free, then the kernel binds them, and the
  ranks' gloo connections take ephemeral ports all the while), and every cell of its notebook
  failed without running.
- --tier NAME (test, long, cluster, other-cpu): the notebooks and test files of a tier, as each
  lesson's package declares them (helpers/lessons.py says how); the others are not collected. A
  tier hands its files to the workers slowest first (helpers.lessons.start_key): the slow lessons'
  notebooks, the longest committed run first, then the test files that say `STARTS_FIRST = True`,
  then the rest in the order collected; within each, the tests marked `starts_first` first. Every
  worker collects and sorts alike, as xdist requires. --tests-one-by-one hands the tests out one
  by one and each notebook whole, to one worker (`pytest_xdist_make_scheduler`; the cluster
  tier's).
  At the end the tier prints each lesson's share of its time: the seconds its notebook's cells
  and its test files took, summed over the workers (`lesson_shares`), so that a budget shows
  where it goes.
- Before any worker starts, the course's own modules (helpers, tests) are compiled to bytecode
  where theirs is missing or stale (`_compile_the_course`).
- Without --tier (the soak and slides tiers, test by test over the workers), the tests marked
  `starts_first` go first, in the order collected. They are the ones that wait out a timeout or
  run longest: begun together at the start, the others fill the cores while they wait. Begun
  last, a soak's one-minute wait for run()'s default timeout once left both cores idle for 50 s.
- --cases-share N: of each parametrized test marked `soak` or `takes_turns`, one case in N runs,
  chosen from the commit (the cases whose index is the commit's number modulo N; a test with fewer
  cases runs one of them), so that every test runs in every run and every case within N commits.
  The soak tier uses it: its cases repeat one way of failing with another input, and it was the
  longest tier; the other-CPU tier too, for the soaks it runs again. So does the slides tier, for
  the handouts (one lesson's PDF a case: the same printing, each lesson's pages; all fifteen were
  one test of 191 s, the tier's longest), one in five of them: a test marked `takes_turns(n)`
  runs one case in n where the tier's share is over 1. A case marked `turn(k)` runs in turn k
  instead of its index's: the soak's heaviest cases, of a minute or so, are given turns by their
  measured seconds, so that each run of the soak tier takes about a third of them, not two at
  once. Under the other-CPU tier, its notebooks take turns as well, dealt by their committed
  seconds (helpers.lessons.turns; `notebook_turns`): make test has just run every one natively,
  and each runs on the other CPU's kernels within N commits (the tier took 2:00 in a CI run from
  a fresh clone on 2026-12-01, README). The tier prints which it took.
- --nbval-skip-timings: a cell whose output nbval ignores because it is a timing (tagged
  `nbval-ignore-output`, with `"nbval_ignore_output_because": "timings"` in its metadata) is not
  run when no later cell of its notebook needs a name it assigns. The other-CPU tier uses it:
  such a cell compares nothing there, and `make test` already ran it.
"""

import ast
import functools
import os
import tempfile
import warnings

import pytest

# First, before anything loads torch: the launcher asks OpenMP's threads to sleep, not spin, while
# they wait (helpers/launcher/pool.py), for this process and the kernels and ranks it starts.
import helpers.launcher.pool  # noqa: F401, E402, I001 - imported for that alone

NBVAL_OUTPUT_WAIT_S = 60
KERNEL_STARTS = 3
SILENT_CELL_S, PROGRESS_WITHIN_S = 5.0, 2.0
SHOWN = ("stream", "display_data", "update_display_data", "execute_result", "error")


def started_again_if_it_dies(start_new_kernel, starts: int = KERNEL_STARTS):
    """nbval's start_new_kernel, which starts a kernel again if it dies before it answers (up to
    `starts` times in all), with a warning that quotes the last lines it wrote to stderr."""

    @functools.wraps(start_new_kernel)
    def start(*args, **kwargs):
        for attempt in range(1, starts + 1):
            with tempfile.TemporaryFile(mode="w+") as stderr:  # the kernel keeps its own copy
                try:
                    return start_new_kernel(*args, **{**kwargs, "stderr": stderr})
                except RuntimeError as error:
                    if "died" not in str(error) or attempt == starts:
                        raise
                    stderr.seek(0)
                    last = stderr.read().strip().splitlines()[-3:]
                    warnings.warn(f"a notebook's kernel died before it answered (start {attempt} "
                                  f"of {starts}); it said: {' | '.join(last) or 'nothing'}; "
                                  "starting another", stacklevel=2)
        raise AssertionError("unreachable")

    start.started_again = True
    return start


def compared_without_heartbeats(compare_outputs):
    """nbval's comparison of a cell's outputs, less a cell's heartbeat (helpers.notebook: shown
    where a cell runs long, so on a slower machine than the committed run's)."""
    from helpers.notebook import without_heartbeats

    @functools.wraps(compare_outputs)
    def compare(self, test, ref, *args, **kwargs):
        return compare_outputs(self, without_heartbeats(test), without_heartbeats(ref), *args,
                               **kwargs)

    compare.without_heartbeats = True
    return compare


def cell_timing(messages: list) -> tuple:
    """(seconds the cell ran, seconds from its start to its first output, None if it showed
    nothing) from the iopub messages of its run, by the kernel's clock: from its execute_input
    to its idle status. (None, None) where the run has no start or no end (a cell that hung)."""
    from datetime import datetime

    def when(message):
        date = message["header"]["date"]
        return date if isinstance(date, datetime) else datetime.fromisoformat(date)

    started = next((m for m in messages if m["msg_type"] == "execute_input"), None)
    if started is None:
        return None, None
    run = [m for m in messages
           if m["parent_header"].get("msg_id") == started["parent_header"].get("msg_id")]
    ended = next((m for m in run if m["msg_type"] == "status"
                  and m["content"].get("execution_state") == "idle"), None)
    if ended is None:
        return None, None
    shown = next((m for m in run if m["msg_type"] in SHOWN), None)
    return ((when(ended) - when(started)).total_seconds(),
            None if shown is None else (when(shown) - when(started)).total_seconds())


def watched_for_silence(runtest):
    """nbval's run of a cell, which also records the iopub messages that nbval reads for it
    (`kept_messages`), and fails a cell that ran over SILENT_CELL_S and showed nothing for its
    first PROGRESS_WITHIN_S. What it measured goes into the test's report (user_properties).
    A notebook's first code cell, its imports, is left out: torch loads there before helpers can
    show anything (on a loaded machine, once 2.6 s), and docs/presenting.md has a presenter run
    it before the audience arrives."""

    @functools.wraps(runtest)
    def run(self):
        messages = self.parent.kept_messages = []
        try:
            runtest(self)
        finally:
            self.parent.kept_messages = None
            seconds, first = cell_timing(messages)
            if seconds is not None and self.cell_num > 0:
                self.user_properties.append(("live", (seconds, first)))
        if self.cell_num > 0 and seconds is not None and seconds > SILENT_CELL_S and (
                first is None or first > PROGRESS_WITHIN_S):
            shown = "nothing" if first is None else f"nothing for its first {first:.1f} s"
            self.raise_cell_error(
                f"this cell ran {seconds:.1f} s and showed {shown}: live, on a slide, that is "
                f"a silent wait (the rule: something within {PROGRESS_WITHIN_S:g} s of any cell "
                f"over {SILENT_CELL_S:g} s). Import helpers first (its heartbeat), print as it "
                "goes, or show a progress bar (helpers.notebook.progress_bar, waiting).")

    run.watched = True
    return run


def messages_kept(get_kernel_message):
    """nbval's read of a kernel message, keeping each in the notebook's `kept_messages` while a
    cell runs."""

    @functools.wraps(get_kernel_message)
    def get(self, *args, **kwargs):
        message = get_kernel_message(self, *args, **kwargs)
        if getattr(self, "kept_messages", None) is not None:
            self.kept_messages.append(message)
        return message

    get.kept = True
    return get


try:
    import nbval.kernel
    import nbval.plugin
except ImportError:  # pytest without nbval: no notebooks to run
    pass
else:
    if not getattr(nbval.kernel.start_new_kernel, "started_again", False):
        nbval.kernel.start_new_kernel = started_again_if_it_dies(nbval.kernel.start_new_kernel)
    if not getattr(nbval.plugin.IPyNbCell.compare_outputs, "without_heartbeats", False):
        nbval.plugin.IPyNbCell.compare_outputs = compared_without_heartbeats(
            nbval.plugin.IPyNbCell.compare_outputs)
    if not getattr(nbval.plugin.IPyNbCell.runtest, "watched", False):
        nbval.plugin.IPyNbCell.runtest = watched_for_silence(nbval.plugin.IPyNbCell.runtest)
    if not getattr(nbval.plugin.IPyNbFile.get_kernel_message, "kept", False):
        nbval.plugin.IPyNbFile.get_kernel_message = messages_kept(
            nbval.plugin.IPyNbFile.get_kernel_message)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # xdist's controller, or a run without workers
        _compile_the_course()


def _compile_the_course():
    """Write the bytecode of helpers and tests where it is missing or stale. Python writes it as it
    imports a module, but not where PYTHONDONTWRITEBYTECODE is set, as it is on CI's machine:
    there every process compiled what it imported, each rank its lesson's modules after every fork
    from the pool (make test from a fresh clone took 446 s, 400 s where the bytecode was there)."""
    import compileall

    root = os.path.dirname(os.path.abspath(__file__))
    for folder in ("helpers", "tests"):
        compileall.compile_dir(os.path.join(root, folder), quiet=1)


def pytest_addoption(parser):
    parser.addoption("--tier", choices=("test", "long", "cluster", "other-cpu"),
                     help="collect only the notebooks and test files of this tier, slowest first "
                          "(helpers/lessons.py)")
    parser.addoption("--cases-share", type=int, default=1, metavar="N",
                     help="run one case in N of each parametrized test, chosen from the commit")
    parser.addoption("--nbval-skip-timings", action="store_true",
                     help="do not run notebook cells whose ignored output is a timing and whose "
                          "names no later cell uses")
    parser.addoption("--tests-one-by-one", action="store_true",
                     help="with -n: hand the workers each test on its own, and each notebook "
                          "whole")


def pytest_itemcollected(item):
    """Marked as each is collected: before any hook reads the marks (-m)."""
    if _source(item) is not None:
        item.add_marker(pytest.mark.notebook)
        item.output_timeout = NBVAL_OUTPUT_WAIT_S


def pytest_ignore_collect(collection_path, config):
    """Under --tier, a notebook or test file of another tier is not collected: not imported, not
    listed. A file named on the command line is collected whatever its tier: pytest does not ask
    this hook about it."""
    tier = config.getoption("--tier")
    if tier:
        from helpers import lessons

        tiers = lessons.tiers_of(collection_path)
        if tiers is not None and tier not in tiers:
            return True
        turn = notebook_turns(config).get(collection_path)
        if turn is not None and turn != _commit_number() % config.getoption("--cases-share"):
            return True
    return None  # False would overrule pytest's own ignores (--ignore, __pycache__)


def notebook_turns(config) -> dict:
    """Under the other-CPU tier with --cases-share N: {notebook path: its turn} (helpers.lessons.
    turns), of which a run collects the turn its commit names; elsewhere {}."""
    share = config.getoption("--cases-share")
    if config.getoption("--tier") != "other-cpu" or share <= 1:
        return {}
    return _dealt(share)


@functools.cache
def _dealt(share: int) -> dict:
    import pathlib

    from helpers import lessons

    folder = pathlib.Path(__file__).resolve().parent / "notebooks"
    return lessons.turns([path for path in sorted(folder.glob("[0-9][0-9]_*.ipynb"))
                          if "other-cpu" in lessons.tiers_of(path)], share)


SECONDS_BY_FILE: dict = {}  # under --tier: a file's seconds, setup, call and teardown summed
LIVE: dict = {}  # a notebook cell's node id: (seconds it ran, seconds to its first output)


def pytest_runtest_logreport(report):
    """Every phase of every test, as the workers report it to the controller."""
    path = report.nodeid.split("::")[0]
    SECONDS_BY_FILE[path] = SECONDS_BY_FILE.get(path, 0.0) + report.duration
    for key, value in report.user_properties:
        if key == "live":
            LIVE[report.nodeid] = value


def pytest_terminal_summary(terminalreporter, config):
    if config.getoption("--tier") and SECONDS_BY_FILE:
        terminalreporter.write_sep("-", f"each lesson's share of tier {config.getoption('--tier')}")
        for line in lesson_shares(SECONDS_BY_FILE):
            terminalreporter.write_line(line)
    turns = notebook_turns(config)
    if turns:
        share, turn = config.getoption("--cases-share"), _commit_number() % config.getoption(
            "--cases-share")
        terminalreporter.write_sep("-", "the notebooks' turns")
        terminalreporter.write_line(turns_summary(turns, share, turn))
    if LIVE:
        terminalreporter.write_sep("-", "no silent wait")
        terminalreporter.write_line(silence_summary(LIVE))


def silence_summary(live: dict) -> str:
    """What the cells showed while they ran, by the kernel's clock, in one line."""
    slow = {nodeid: first for nodeid, (seconds, first) in live.items() if seconds > SILENT_CELL_S}
    longest = max(live.values())[0]
    said = (f"{len(live)} cells run (each notebook's imports aside), the longest "
            f"{longest:.0f} s; {len(slow)} over {SILENT_CELL_S:g} s")
    if not slow:
        return said
    silent = [nodeid for nodeid, first in slow.items()
              if first is None or first > PROGRESS_WITHIN_S]
    latest = max(slow.values(), key=lambda first: float("inf") if first is None else first)
    return (f"{said}, each of which showed something within {PROGRESS_WITHIN_S:g} s: "
            f"{not silent} (the latest first output "
            f"{'never came' if latest is None else f'after {latest:.1f} s'}"
            f"{'; silent: ' + ', '.join(silent) if silent else ''})")


def turns_summary(turns: dict, share: int, turn: int) -> str:
    """Which notebooks this run took, and which wait for the next commits' runs, in one line."""
    def lessons(in_turn):
        return ", ".join(sorted(path.name[:2] for path, dealt in turns.items()
                                if (dealt == turn) == in_turn)) or "none"

    return (f"turn {turn} of {share}, by the commit: lessons {lessons(True)} (make test ran "
            f"every one natively); the other turns, in the next commits' runs: {lessons(False)}")


def lesson_shares(seconds_by_file: dict) -> list:
    """Lines "lesson 13  412 s  31%": the seconds of each lesson's notebook and test files (a
    shared test file's under "shared"), summed over the workers, largest first."""
    from helpers import lessons

    shares = {}
    for path, seconds in seconds_by_file.items():
        lesson = lessons.lesson_of(path)
        key = f"lesson {lesson.number:02d}" if lesson else "shared"
        shares[key] = shares.get(key, 0.0) + seconds
    total = sum(shares.values()) or 1.0
    return [f"{key:10s} {seconds:6.0f} s  {100 * seconds / total:3.0f}%"
            for key, seconds in sorted(shares.items(), key=lambda item: -item[1])]


def _source(item) -> str | None:
    """A notebook cell's code (nbval's item), or None for any other test."""
    return getattr(getattr(item, "cell", None), "source", None)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--tier"):
        _slowest_first(items)
    else:
        _marked_first(items)
    _skip_the_cluster_lesson_where_no_cluster_starts(items)
    share = config.getoption("--cases-share")
    if share > 1:
        taking_turns = [item for item in items if item.get_closest_marker("soak")
                        or item.get_closest_marker("takes_turns")]
        turns = {item.nodeid: item.get_closest_marker("turn").args[0] for item in taking_turns
                 if item.get_closest_marker("turn")}
        shares = {}  # a test marked takes_turns(n) runs one case in n, whatever the tier's share
        for item in taking_turns:
            marker = item.get_closest_marker("takes_turns")
            shares.setdefault(marker.args[0] if marker and marker.args else share, []).append(item)
        kept = set().union(*(cases_kept([item.nodeid for item in group], n, _commit_number(), turns)
                             for n, group in shares.items()))
        left_out = {item.nodeid for item in taking_turns} - kept
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in left_out])
        items[:] = [item for item in items if item.nodeid not in left_out]
    if not config.getoption("--nbval-skip-timings"):
        return
    skip = pytest.mark.skip(reason="a timing nbval ignores: compared on no pass, run on the first")
    notebooks = {}
    for item in items:
        if _source(item) is not None:
            notebooks.setdefault(item.parent, []).append(item)
    for cells in notebooks.values():
        for index in timings_to_skip([(_source(item), ignored_because(item.cell) == "timings")
                                      for item in cells]):
            cells[index].add_marker(skip)


def timings_to_skip(cells: list) -> set:
    """Of a notebook's code cells, (source, whether its output is a timing nbval ignores), the
    indices of the timings --nbval-skip-timings leaves out: from the last cell back, each whose
    names no later cell that runs needs. A timing that only a skipped timing needs (the numbers
    measured, then a cell of their own that draws them) is skipped too; after a cell that is not
    plain Python, no earlier one is."""
    skipped, needed, unknown = set(), set(), False
    for index in reversed(range(len(cells))):
        source, timing = cells[index]
        if not source:
            continue
        assigned = _names(source, ast.Store)
        if timing and not unknown and assigned is not None and not assigned & needed:
            skipped.add(index)
            continue
        needs = _needs(source)
        if needs is None:
            unknown = True
        else:
            needed |= needs
    return skipped


def ignored_because(cell) -> str | None:
    """Why nbval ignores a notebook cell's output (its metadata says), or None where it compares
    it. The notebooks mark such a cell with nbval's tag, never a comment a learner would see."""
    if "nbval-ignore-output" not in cell.metadata.get("tags", []):
        return None
    return cell.metadata.get("nbval_ignore_output_because", "")


def cases_kept(nodeids: list, share: int, number: int, turns: dict | None = None) -> set:
    """The node ids --cases-share keeps: every test that is not parametrized; of each one that
    is, its cases whose turn is number % share, or, where it has none in that turn, the one at
    number % (its count). A case's turn is its index i % share, or the k of its `turn(k)`
    marker (`turns`: node id -> k)."""
    turns = turns or {}
    cases = {}
    for nodeid in nodeids:
        cases.setdefault(nodeid.split("[")[0], []).append(nodeid)
    kept = set()
    for ids in cases.values():
        if len(ids) == 1 and "[" not in ids[0]:
            kept.add(ids[0])
            continue
        chosen = [nodeid for index, nodeid in enumerate(ids)
                  if turns.get(nodeid, index) % share == number % share]
        kept.update(chosen or [ids[number % len(ids)]])
    return kept


@functools.cache
def _commit_number() -> int:
    """The checked-out commit as a number (0 outside a git checkout): every xdist worker, and
    every run of the same commit, chooses the same cases."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True)
        return int(head.stdout.strip(), 16)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return 0


def _slowest_first(items):
    """The items sorted by their file's place in the tier's order (helpers.lessons.start_key); the
    sort is stable, so each file's items stay together and in their order. Within a place, the
    tests marked `starts_first` go first: under --tests-one-by-one (the cluster tier), where each
    test is a unit of its own but a notebook's cells are one, the longest tests start at once
    beside the notebooks; under --dist loadfile their file does."""
    from helpers import lessons

    keys = {}
    for item in items:
        if item.path not in keys:
            module = getattr(item, "module", None)  # a notebook's cells have none
            keys[item.path] = lessons.start_key(item.path, getattr(module, "STARTS_FIRST", False))
    items.sort(key=lambda item: (keys[item.path], item.get_closest_marker("starts_first") is None))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist, never called
def pytest_xdist_make_scheduler(config, log):
    """With --tests-one-by-one (the cluster tier's): each notebook whole on one worker, in order,
    in one kernel, and every other test handed out on its own (xdist's loadgroup would, but it
    marks a group in the node id, which pytest 9 no longer lets a plugin change)."""
    if not config.getoption("--tests-one-by-one"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class NotebooksWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return notebook_or_test(nodeid)

    return NotebooksWhole(config, log)


def notebook_or_test(nodeid: str) -> str:
    """The unit a worker takes under --tests-one-by-one: a notebook's cell's is its notebook, a
    test's is itself."""
    path = nodeid.split("::", 1)[0]
    return path if path.endswith(".ipynb") else nodeid


def _marked_first(items):
    """The items marked `starts_first` first, each group in its order (the sort is stable)."""
    items.sort(key=lambda item: item.get_closest_marker("starts_first") is None)


def _skip_the_cluster_lesson_where_no_cluster_starts(items):
    """Lesson 15's notebook starts a Slurm cluster (helpers.on_a_cluster): where none can start
    (not Linux, not root, no Slurm) its cells are skipped, saying why, as its tests are; under
    REQUIRE_CLUSTER=1 (CI) they run, and fail."""
    cells = [item for item in items if item.nodeid.startswith("notebooks/15_on_a_cluster")]
    if not cells or os.environ.get("REQUIRE_CLUSTER"):
        return
    from helpers.on_a_cluster.cluster import unavailable

    problem = unavailable()
    if problem:
        for item in cells:
            item.add_marker(pytest.mark.skip(reason=f"no cluster here: {problem}"))


def _needs(source: str) -> set | None:
    """The names a later cell loads and does not assign itself (a loop variable it rebinds is
    not taken from the skipped cell; were it, the run would fail with a NameError, not pass)."""
    loads, stores = _names(source, ast.Load), _names(source, ast.Store)
    return None if loads is None else loads - stores


def _names(source: str, context) -> set | None:
    """The names a cell's code stores or loads (None if it is not plain Python)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    found = {node.id for node in ast.walk(tree)
             if isinstance(node, ast.Name) and isinstance(node.ctx, context)}
    if context is ast.Store:
        found |= {node.name for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef | ast.ClassDef)}
        found |= {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names}
    return found
