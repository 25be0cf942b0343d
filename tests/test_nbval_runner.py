"""The notebooks' runner (the root conftest.py): a kernel that dies before it answers is started
again, saying so, and nothing else is retried."""

import importlib.util
import os

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
