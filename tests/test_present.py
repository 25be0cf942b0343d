"""`make present` (helpers.present): the slideshow shows a fresh copy of the lesson, beside the
slides' style sheet, with the settings that give it an interrupt shortcut."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers import present


def test_a_lesson_is_found_by_its_number(tmp_path):
    assert present.lesson_path("06").name == "06_data_parallelism.ipynb"
    assert present.lesson_path("6") == present.lesson_path("06")
    assert present.lesson_path("06_data_parallelism.ipynb") == present.lesson_path("06")
    with pytest.raises(SystemExit, match="no lesson '99'; the lessons are: 01, 02"):
        present.lesson_path("99")


def test_the_copy_is_fresh_and_the_lesson_untouched(tmp_path):
    lesson = present.lesson_path("01")
    committed = lesson.read_bytes()
    copy = present.copy("01", tmp_path)
    assert copy.read_bytes() == committed
    copy.write_text("{}")  # what a slideshow's autosave would do to it
    assert present.copy("01", tmp_path).read_bytes() == committed  # made afresh
    assert lesson.read_bytes() == committed
    assert (tmp_path / "rise.css").read_text() == (present.NOTEBOOKS / "rise.css").read_text()


def test_the_settings_bind_i_i_to_the_kernels_interrupt(tmp_path):
    present.write_settings(tmp_path)
    shortcuts = json.loads((tmp_path / "@jupyterlab" / "shortcuts-extension"
                            / "shortcuts.jupyterlab-settings").read_text())["shortcuts"]
    assert [(s["command"], s["keys"]) for s in shortcuts] == [
        ("notebook:interrupt-kernel", ["I", "I"])]


def test_make_present_serves_the_copy_and_stops_at_ctrl_c(tmp_path):
    """The command itself: the address it prints serves the copy's slides and the style sheet,
    and Ctrl+C (SIGINT, to it and the server, as a terminal sends it) stops both. Started with
    SIGINT ignored, as a script's background job is (CI can run so): Ctrl+C must work anyway."""
    process = subprocess.Popen(
        [sys.executable, "-m", "helpers.present", "01", "--no-browser", "--directory",
         str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        url = None
        for line in process.stdout:
            if line.startswith("Slides: "):
                url = line.split()[1]
                break
        assert url and "/rise/01_processes_and_groups.ipynb?token=" in url, url
        base, token = url.split("/rise/")[0], url.split("token=")[1]
        assert present.wait_until_up(int(base.rsplit(":", 1)[1]), token, process), (
            f"nothing answered at {base} within 60 s")
        with urllib.request.urlopen(url, timeout=5) as page:
            assert page.status == 200
        with urllib.request.urlopen(f"{base}/files/rise.css?token={token}", timeout=5) as css:
            assert css.read().decode() == (present.NOTEBOOKS / "rise.css").read_text()
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_server_that_ignores_ctrl_c_is_stopped_by_sigterm_then_sigkill(capsys):
    """What a Jupyter server busy starting on a loaded machine can do: take the interrupt and go
    on. `present` then sends SIGTERM after its grace period, and SIGKILL after another."""
    stops_at_sigterm = ("import signal, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); print('up', "
                        "flush=True); time.sleep(60)")
    stops_at_nothing = stops_at_sigterm.replace("lambda *_: sys.exit(0)", "signal.SIG_IGN")
    for code, expected, said in ((stops_at_sigterm, 0, "stopping it (SIGTERM)"),
                                 (stops_at_nothing, -signal.SIGKILL, "killing it")):
        server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline() == "up\n"  # its handlers are set
        server.send_signal(signal.SIGINT)
        started = time.monotonic()
        assert present._wait_through_interrupts(server, grace=1) == expected
        assert time.monotonic() - started < 10
        assert said in capsys.readouterr().out
