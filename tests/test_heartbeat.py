"""A cell that runs long says so within 2 s (helpers.notebook.Heartbeat), in a real kernel; and
the committed notebooks and nbval leave its line out, as a run fast enough to show none."""

import pathlib
import sys
import time
import types

import nbformat
from jupyter_client.manager import start_new_kernel

from helpers.notebook import HEARTBEAT, HEARTBEAT_AFTER_S, Heartbeat, without_heartbeats

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
SLOW_S = 3.5  # the long cell's seconds: its heartbeat shows, and is counted up at least twice


def _execute(client, code):
    """Run `code`; every iopub message of it, with its arrival in seconds after the request."""
    start, messages = time.monotonic(), []
    client.execute(code)
    while True:
        message = client.get_iopub_msg(timeout=60)
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            return messages
        messages.append((time.monotonic() - start, message))


def test_a_long_cell_shows_that_it_runs_and_a_quick_one_shows_nothing():
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        _execute(client, "import helpers")
        _execute(client, "helpers.warm_up()")  # the pool's start is not this test's
        slow = _execute(client, f"import time\nprint('before')\ntime.sleep({SLOW_S})\n"
                                "print('after')")
        quick = _execute(client, "print('quick')")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)

    def beats(messages):
        return [(at, message) for at, message in messages
                if message["msg_type"] in ("display_data", "update_display_data")
                and message["content"]["metadata"] == HEARTBEAT]

    shown = beats(slow)
    assert shown, "the long cell showed no heartbeat"
    first_at, first = shown[0]
    assert first["msg_type"] == "display_data"
    assert first["content"]["data"]["text/plain"].startswith("still running: 1 s")
    assert HEARTBEAT_AFTER_S <= first_at < SLOW_S  # (a load may delay it; the cell is longer)
    counted = [message["content"]["data"]["text/plain"] for _, message in shown[1:-1]]
    assert counted[:2] == ["still running: 2 s (Esc, I, I stops it)",
                           "still running: 3 s (Esc, I, I stops it)"]
    assert shown[-1][1]["content"]["data"] == {"text/plain": "", "text/html": ""}  # emptied
    ids = {message["content"]["transient"]["display_id"] for _, message in shown}
    assert len(ids) == 1  # one line, updated in place
    printed = [message["content"]["text"] for _, message in slow
               if message["msg_type"] == "stream"]
    assert printed == ["before\n", "after\n"]
    assert beats(quick) == []


def test_without_heartbeats_gives_the_outputs_of_a_fast_run():
    beat = nbformat.v4.new_output("display_data", data={"text/plain": ""}, metadata=HEARTBEAT)
    figure = nbformat.v4.new_output("display_data", data={"image/png": "iVBO"})
    slow = [nbformat.v4.new_output("stream", name="stdout", text="a\n"), beat,
            nbformat.v4.new_output("stream", name="stdout", text=["b\n", "c\n"]),
            nbformat.v4.new_output("stream", name="stderr", text="warning\n"), figure]
    assert without_heartbeats(slow) == [
        nbformat.v4.new_output("stream", name="stdout", text="a\nb\nc\n"),
        nbformat.v4.new_output("stream", name="stderr", text="warning\n"), figure]
    assert without_heartbeats([beat]) == []
    apart = [nbformat.v4.new_output("stream", name="stdout", text="a\n"),
             nbformat.v4.new_output("stream", name="stdout", text="b\n")]
    assert without_heartbeats(apart) == apart  # as the run left them, where no heartbeat parted


def test_no_committed_notebook_keeps_a_heartbeat():
    found = [f"{notebook.name} cell {index}"
             for notebook in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
             for index, cell in enumerate(nbformat.read(notebook, as_version=4).cells)
             for output in cell.get("outputs", []) if output.get("metadata") == HEARTBEAT]
    assert found == []


def test_the_heartbeat_line_waits_for_nothing_while_the_launcher_is_half_imported(monkeypatch):
    # CI caught it: a cell importing `helpers.run` on a loaded machine beat while the launcher's
    # module was in sys.modules without its `waiting` yet, and the thread's traceback reached the
    # cell's stderr.
    half_made = types.ModuleType("helpers.launcher.launch")
    monkeypatch.setitem(sys.modules, "helpers.launcher.launch", half_made)
    line = Heartbeat._line(3.2)
    assert line["text/plain"] == "still running: 3 s (Esc, I, I stops it)"
    half_made.waiting = lambda: "rank 1 of 2 has not returned"
    assert Heartbeat._line(4)["text/plain"] == (
        "still running: 4 s: rank 1 of 2 has not returned (Esc, I, I stops it)")
