"""The notebooks' runner (the root conftest.py): a kernel that dies before it answers is started
again, saying so, and nothing else is retried."""

import importlib.util
import os
from datetime import UTC, datetime, timedelta

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest",
                                                  os.path.join(ROOT, "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel_starts(outcomes):
    """A stand-in for nbval's start_new_kernel: each call takes the next outcome, writing its
    words to the stderr it is given, as a kernel would, and raising nbval's error if it died."""
    calls = []

    def start(startup_timeout=60, kernel_name="python", **kwargs):
        outcome = outcomes[len(calls)]
        calls.append(kwargs)
        kwargs["stderr"].write(f"{outcome}\n")
        kwargs["stderr"].flush()
        if outcome != "ready":
            raise RuntimeError("Kernel died before replying to kernel_info"
                               if outcome.startswith("died") else outcome)
        return "manager", "client"

    return start, calls


def test_a_kernel_that_dies_before_it_answers_is_started_again_saying_what_it_said():
    conftest = _root_conftest()
    start, calls = _kernel_starts(["died: Address already in use", "died: again", "ready"])
    with pytest.warns(UserWarning) as said:
        assert conftest.started_again_if_it_dies(start)(kernel_name="python3", cwd=ROOT) == (
            "manager", "client")
    assert len(calls) == 3 and all(call["cwd"] == ROOT for call in calls)
    assert [str(warning.message) for warning in said] == [
        "a notebook's kernel died before it answered (start 1 of 3); it said: died: Address "
        "already in use; starting another",
        "a notebook's kernel died before it answered (start 2 of 3); it said: died: again; "
        "starting another"]


def test_a_kernel_that_keeps_dying_or_fails_otherwise_fails_the_notebook():
    conftest = _root_conftest()
    start, calls = _kernel_starts(["died"] * 3)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="Kernel died"):
        conftest.started_again_if_it_dies(start)()
    assert len(calls) == conftest.KERNEL_STARTS == 3
    start, calls = _kernel_starts(["No such kernel named python3"])
    with pytest.raises(RuntimeError, match="No such kernel"):
        conftest.started_again_if_it_dies(start)()
    assert len(calls) == 1


def test_nbval_starts_its_kernels_through_it():
    import nbval.kernel

    assert getattr(nbval.kernel.start_new_kernel, "started_again", False)


def test_nbval_runs_each_cell_watched_for_a_silent_wait():
    import nbval.plugin

    assert getattr(nbval.plugin.IPyNbCell.runtest, "watched", False)
    assert getattr(nbval.plugin.IPyNbFile.get_kernel_message, "kept", False)


def _code_cells():
    import nbformat

    for path in sorted(os.scandir(os.path.join(ROOT, "notebooks")), key=lambda entry: entry.name):
        if path.name.endswith(".ipynb"):
            for index, cell in enumerate(nbformat.read(path.path, as_version=4).cells):
                if cell.cell_type == "code":
                    yield f"{path.name} cell {index}", cell


def test_no_cell_shows_an_nbval_marker_and_each_ignored_output_says_why():
    """nbval's markers are cell tags, which a slide or a student never sees; each says why."""
    from nbval.plugin import comment_markers, find_metadata_tags

    conftest = _root_conftest()
    shown = [where for where, cell in _code_cells()
             if any(line.lstrip("# ").strip() in comment_markers
                    for line in cell.source.splitlines() if line.lstrip().startswith("#"))]
    assert shown == []
    ignored = {where: cell for where, cell in _code_cells()
               if "nbval-ignore-output" in cell.metadata.get("tags", [])}
    assert ignored, "the course has cells whose output nbval ignores (timings, live widgets)"
    for where, cell in ignored.items():
        assert dict(find_metadata_tags(cell.metadata)) == {"check": False}, where  # nbval's reading
        assert conftest.ignored_because(cell), f"{where} does not say why its output is ignored"


def test_a_timing_is_known_by_its_reason():
    conftest = _root_conftest()
    import nbformat

    timing = nbformat.v4.new_code_cell("t = 1", metadata={
        "tags": ["nbval-ignore-output"], "nbval_ignore_output_because": "timings"})
    widget = nbformat.v4.new_code_cell("w", metadata={
        "tags": ["nbval-ignore-output"], "nbval_ignore_output_because": "a live widget"})
    assert conftest.ignored_because(timing) == "timings"
    assert conftest.ignored_because(widget) == "a live widget"
    assert conftest.ignored_because(nbformat.v4.new_code_cell("x")) is None


def test_a_timing_is_skipped_where_no_cell_that_runs_needs_its_names():
    """Lesson 09's bubble: measured and printed in one cell, drawn in the next, both timings; the
    next lesson cell needs neither. Both are skipped; a later cell that needs the measurement
    keeps the measuring cell, not the drawing; a cell that is not Python keeps every timing
    before it; a timing after it is judged by what follows it alone."""
    skip = _root_conftest().timings_to_skip
    measure = ("bubbles = measure()\nprint(bubbles)", True)
    draw = ("plots.plot_bubbles(bubbles)\nplt.show()", True)
    assert skip([("import plots", False), measure, draw, ("x = 1", False)]) == {1, 2}
    assert skip([measure, draw, ("print(max(bubbles))", False)]) == {1}
    assert skip([measure, draw, ("%timeit f()", False)]) == set()
    assert skip([("%timeit f()", False), measure, draw]) == {1, 2}
    assert skip([measure, ("", False), draw]) == {0, 2}


START = datetime(2026, 12, 1, tzinfo=UTC)


def _message(kind, at, parent="this cell", **content):
    """An iopub message as jupyter_client gives it, `at` seconds after START by the kernel's
    clock (its header's date)."""
    return {"msg_type": kind, "header": {"date": START + timedelta(seconds=at)},
            "parent_header": {"msg_id": parent}, "content": content}


def _cell_run(shown, ends, parent="this cell"):
    """The messages of one cell's run: busy, its input, what it showed (kind, at), idle."""
    return [_message("status", 0, parent, execution_state="busy"),
            _message("execute_input", 0, parent),
            *[_message(kind, at, parent) for kind, at in shown],
            _message("status", ends, parent, execution_state="idle")]


def test_a_cells_seconds_and_its_first_output_are_read_off_the_kernels_clock():
    conftest = _root_conftest()
    other = _message("stream", 0.2, parent="another cell")  # not this cell's: left out
    assert conftest.cell_timing([other] + _cell_run([("stream", 2.5), ("display_data", 3)],
                                                    ends=7.25)) == (7.25, 2.5)
    assert conftest.cell_timing(_cell_run([], ends=6)) == (6.0, None)
    assert conftest.cell_timing(_cell_run([], ends=6)[:-1]) == (None, None)  # it never ended
    as_text = [{**message, "header": {"date": message["header"]["date"].isoformat()}}
               for message in _cell_run([("update_display_data", 1)], ends=5.5)]
    assert conftest.cell_timing(as_text) == (5.5, 1.0)


def _watched(conftest, messages, cell_num=1):
    """Run a stand-in for nbval's cell (it reads messages until the cell's idle status) under
    the course's watch: what it recorded, or the error it raised."""

    class Notebook:
        def __init__(self):
            self.queue = list(messages)

        @conftest.messages_kept
        def get_kernel_message(self, timeout=None, stream="iopub"):
            return self.queue.pop(0)

    class Cell:
        def __init__(self):
            self.parent, self.user_properties, self.cell_num = Notebook(), [], cell_num

        def raise_cell_error(self, message):
            raise AssertionError(message)

        @conftest.watched_for_silence
        def runtest(self):
            while True:
                message = self.parent.get_kernel_message()
                if message["content"].get("execution_state") == "idle":
                    return

    cell = Cell()
    try:
        cell.runtest()
    except AssertionError as error:
        return str(error)
    return cell.user_properties


def test_a_cell_over_5_s_must_show_something_within_2_s():
    conftest = _root_conftest()
    assert (conftest.SILENT_CELL_S, conftest.PROGRESS_WITHIN_S) == (5.0, 2.0)
    heartbeat = [("display_data", 1.0), ("update_display_data", 2.0)]  # helpers.notebook's
    assert _watched(conftest, _cell_run(heartbeat, ends=30)) == [("live", (30.0, 1.0))]
    assert _watched(conftest, _cell_run([], ends=4.5)) == [("live", (4.5, None))]  # quick
    assert _watched(conftest, _cell_run([], ends=5.5)) == (
        "this cell ran 5.5 s and showed nothing: live, on a slide, that is a silent wait (the "
        "rule: something within 2 s of any cell over 5 s). Import helpers first (its "
        "heartbeat), print as it goes, or show a progress bar (helpers.notebook.progress_bar, "
        "waiting).")
    assert _watched(conftest, _cell_run([("stream", 2.25)], ends=9)).startswith(
        "this cell ran 9.0 s and showed nothing for its first 2.2 s")
    # a notebook's first code cell, its imports, is neither checked nor counted
    assert _watched(conftest, _cell_run([("stream", 2.6)], ends=5.1), cell_num=0) == []


def test_each_tier_says_what_its_cells_showed():
    conftest = _root_conftest()
    assert conftest.silence_summary({"a::Cell 0": (1.0, None), "a::Cell 1": (3.0, 0.1)}) == (
        "2 cells run (each notebook's imports aside), the longest 3 s; 0 over 5 s")
    assert conftest.silence_summary({"a::Cell 0": (12.0, 1.5), "a::Cell 1": (6.0, 1.0),
                                     "a::Cell 2": (2.0, None)}) == (
        "3 cells run (each notebook's imports aside), the longest 12 s; 2 over 5 s, each of which "
        "showed something within 2 s: True (the latest first output after 1.5 s)")
    assert conftest.silence_summary({"a::Cell 0": (12.0, None), "a::Cell 1": (6.0, 1.0)}) == (
        "2 cells run (each notebook's imports aside), the longest 12 s; 2 over 5 s, each of which "
        "showed something within 2 s: False (the latest first output never came; silent: "
        "a::Cell 0)")
