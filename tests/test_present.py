"""`make present` (helpers.present): the slideshow shows a fresh copy of the lesson, beside the
slides' style sheet, with the settings that give it an interrupt shortcut."""

import json

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
