"""The lessons' slides (helpers.slides): the committed metadata is what the tool writes, every
section heading starts a slide, each sub-slide fits the screen by the tool's estimate, and none
shows more than 60 words of prose (the rest of the explanation is in speaker notes)."""

import ast
import base64
import copy
import inspect
import io
import json
import pathlib
import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from helpers import drawing, notebook, slides

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob(
    "[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_the_committed_slides_are_what_the_tool_writes(path):
    cells = json.loads(path.read_text())["cells"]
    again = slides.assign(slides.split(copy.deepcopy(cells)))
    assert [("".join(cell["source"]), cell["metadata"]["slideshow"]) for cell in again] == [
        ("".join(cell["source"]), cell["metadata"].get("slideshow")) for cell in cells], (
        f"run: python -m helpers.slides {path.relative_to(path.parent.parent)}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_every_lesson_has_the_tools_rise_settings(path):
    """RISE's default hides what passes the screen, and centres a sub-slide where its committed
    height puts it: each lesson asks for scrolling, and for sub-slides at the screen's top."""
    assert slides.RISE["scroll"] is True and slides.RISE["center"] is False
    assert json.loads(path.read_text())["metadata"].get("rise") == slides.RISE, (
        f"run: python -m helpers.slides {path.relative_to(path.parent.parent)}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_each_section_is_a_slide_and_each_sub_slide_fits(path):
    cells = json.loads(path.read_text())["cells"]
    for cell in cells:
        if cell["cell_type"] == "markdown" and "".join(cell["source"]).startswith("## "):
            assert cell["metadata"]["slideshow"]["slide_type"] == "slide"
    for slide in slides.slides(cells):
        for sub_slide in slide:
            height = sum(slides.cell_height(cell) for cell in sub_slide)
            # a code cell alone may be taller: its output is long by nature
            assert height <= slides.BUDGET or (
                len(sub_slide) == 1 and sub_slide[0]["cell_type"] == "code"), (
                "".join(sub_slide[0]["source"])[:80])


def test_a_figure_counts_its_own_pixels():
    fig = plt.figure(figsize=(4, 3), dpi=100)  # 400 x 300 pixels
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    output = {"data": {"image/png": base64.b64encode(buffer.getvalue()).decode()}}
    assert slides._png_height(output["data"]["image/png"]) == 300
    assert slides.output_height(output) == 300 + slides.OUTPUT_MARGIN


def test_prose_is_cut_at_headings_and_paragraphs_but_not_inside_code():
    fenced = "```python\n# a comment, not a heading\nx = 1\n```"
    long = "\n\n".join(f"Paragraph {index}, " + "words " * 30 for index in range(30))
    pieces = slides._pieces(f"## Title\n\nText.\n{fenced}\n### Next\n\n{long}")
    assert pieces[0] == f"## Title\n\nText.\n{fenced}"
    assert pieces[1].startswith("### Next")
    assert len(pieces) > 2 and all(slides.markdown_height(piece) <= slides.BUDGET
                                   for piece in pieces)
    assert "".join(piece.replace("\n", "") for piece in pieces[1:]) == (
        f"### Next\n\n{long}".replace("\n", ""))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_every_sub_slide_shows_at_most_60_words_the_rest_in_speaker_notes(path):
    cells = json.loads(path.read_text())["cells"]
    words = [slides.prose_words(sub_slide) for slide in slides.slides(cells)
             for sub_slide in slide]
    over = [(index + 1, count) for index, count in enumerate(words)
            if count > slides.WORDS_ON_A_SUB_SLIDE]
    print(f"{path.stem}: {len(words)} sub-slides, {len(over)} over "
          f"{slides.WORDS_ON_A_SUB_SLIDE} words of prose, the most {max(words)}")
    assert slides.WORDS_ON_A_SUB_SLIDE == 60
    assert over == [], "(sub-slide, words): move the explanation into notes cells"


def test_prose_words_are_the_texts_words_outside_tables_code_and_notes():
    def cell(source, kind="markdown", slide_type="-"):
        return {"cell_type": kind, "source": [source],
                "metadata": {"slideshow": {"slide_type": slide_type}}}

    sub_slide = [
        cell("### A heading\n\n- **bold** point, with `code` = 2\n\n"
             "| not | prose |\n|---|---|\n| a | b |\n\n```python\nx = 1  # not prose\n```"),
        cell("print('not prose either')", kind="code"),
        cell("Said, not shown.", slide_type="notes"),
        cell("Last 3 words."),
    ]
    # A, heading, bold, point, with, code, 2 / Last, 3, words
    assert slides.prose_words(sub_slide) == 7 + 3


def test_speaker_notes_stay_notes_whole_and_take_no_room_on_a_slide():
    def markdown(source, kind=None):
        metadata = {"slideshow": {"slide_type": kind}} if kind else {}
        return {"cell_type": "markdown", "metadata": metadata, "source": [source]}

    long = "\n\n".join(f"Paragraph {index}, " + "words " * 30 for index in range(30))
    notes = markdown(f"### Say first\n\n{long}", "notes")  # taller than a screen, and a heading
    assert slides.markdown_height(notes["source"][0]) > slides.BUDGET
    cells = slides.assign(slides.split([
        markdown("## A slide"),
        {"cell_type": "code", "metadata": {}, "source": ["x = 1"], "outputs": []},
        notes,
        markdown("Two lines\nof prose."),
    ]))
    assert [cell["metadata"]["slideshow"]["slide_type"] for cell in cells] == [
        "slide", "-", "notes", "-"]  # one sub-slide, the notes beside it
    assert cells[2] is notes  # not cut at its heading or between its paragraphs
    assert slides.slides(cells) == [[[cells[0], cells[1], cells[3]]]]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_no_cell_draws_two_figures(path):
    """Two figures in one cell make a sub-slide no screen holds: each gets its own cell."""
    for cell in json.loads(path.read_text())["cells"]:
        figures = sum("image/png" in output.get("data", {}) for output in cell.get("outputs", []))
        assert figures <= 1, "".join(cell["source"])[:80]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_every_figure_says_how_large_its_smallest_text_is_and_a_hall_can_read_it(path):
    """Drawn in a kernel, a figure's PNG carries the size of its smallest text in the PNG's pixels
    (helpers.drawing.figure_bundle): at least the floor, shown at its own size. The slides tier
    measures it as a 1280 x 720 slide scales it."""
    small = []
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        for output in cell.get("outputs", []):
            if "image/png" in output.get("data", {}):
                size = output["metadata"].get("image/png", {}).get(drawing.SMALLEST_TEXT)
                if size is None or size < slides.FIGURE_TEXT_PX:
                    small.append((index, size))
    assert small == [], f"cells whose figure's text is under {slides.FIGURE_TEXT_PX} px: {small}"


def test_a_listing_longer_than_a_slide_is_cut_between_statements_into_even_parts():
    """61 lines, a comment over each statement: cut only above a comment, into the fewest parts
    that hold 26 lines each with their line that says which part continues or follows (two hold
    50 at most: three), as even as those cuts allow (the longest, 23 lines, can be no shorter:
    a part of 22 would leave 20 statements of 3 lines with room for 19)."""
    body = [line for step in range(20) for line in (f"    # step {step}", f"    x{step} = f(",
                                                     f"        {step})")]
    source = "def long():\n" + "\n".join(body) + "\n"
    parts = notebook.listing_parts(source, limit=26)
    assert "".join(parts) == source and len(parts) == 3
    shown = [len(part.splitlines()) + (number > 1) + (number < 3)
             for number, part in enumerate(parts, 1)]
    assert max(shown) == 23, shown
    assert all(part.startswith("    # step ") for part in parts[1:])
    assert notebook.listing_parts("def short():\n    pass\n") == ["def short():\n    pass\n"]


def test_a_statement_longer_than_a_slide_is_never_cut():
    """A dict of 40 lines is one statement, the first of its function: no cut may fall inside
    it, nor between the function's line and it, so the one cut left is below it."""
    source = ("def table():\n    x = {\n" + "".join(f"        {n}: {n},\n" for n in range(40))
              + "    }\n    return x\n")
    parts = notebook.listing_parts(source, limit=26)
    assert parts == [source.removesuffix("    return x\n"), "    return x\n"]


def test_a_cut_falls_between_the_functions_own_statements_and_never_opens_a_block():
    """32 lines: a cut inside the loop would make the evenest parts (16 and 16), but the cut
    before the loop makes two that fit (15 and 19 with their lines of which part), and is
    taken; no part ends on `for ...:`, `if ...:` or `else:`."""
    body = (["    total = 0"] + [f"    a{i} = {i}" for i in range(12)]
            + ["    for step in range(3):"] + [f"        b{i} = {i}" for i in range(12)]
            + ["    if total:", "        c = 1", "    else:", "        c = 2", "    return c"])
    source = "def f():\n" + "\n".join(body) + "\n"
    parts = notebook.listing_parts(source, limit=26)
    assert "".join(parts) == source and len(parts) == 2
    assert parts[1].startswith("    for step in range(3):\n")
    for limit in range(14, 27):  # wherever the cuts fall
        assert not any(part.rstrip().endswith(":")
                       for part in notebook.listing_parts(source, limit=limit)[:-1]), limit


def test_a_first_part_is_more_than_a_signature_and_its_docstring():
    """A class of 33 lines: cut before its first method, the parts would be the evener (15 and 20
    lines, with their lines of which part), but the first would hold only the class's line and
    docstring; the cut before the second (25 and 10) is taken."""
    method = ("    def {}(self):\n" + "        x = 1\n" * 7 + "        return x\n").format
    source = ('class Stage:\n    """One.\n' + "    more.\n" * 10 + '    """\n\n'
              + method("a") + "\n" + method("b"))
    parts = notebook.listing_parts(source, limit=26)
    assert "".join(parts) == source and parts[1].startswith("    def b(self):")


def test_show_code_says_which_part_continues_and_which_follows():
    from helpers.checkpoints_and_failures import resume

    first, second = (notebook.show_code(resume.async_save_worker, part=part).data
                     for part in (1, 2))
    assert first.startswith("def async_save_worker(")
    assert first.endswith("# ... part 2 of 2 follows\n")
    assert second.startswith("# async_save_worker, part 2 of 2\n    ")
    with pytest.raises(ValueError, match="async_save_worker has 2 part"):
        notebook.show_code(resume.async_save_worker, part=3)


def test_a_script_longer_than_a_slide_is_cut_at_blank_lines_into_even_parts():
    paragraph = [f"echo {k}\n" for k in range(10)]  # four paragraphs of 10 lines: 43 in all
    text = "".join(paragraph + ["\n"] + paragraph + ["\n"] + paragraph + ["\n"] + paragraph)
    lines = text.splitlines(keepends=True)
    # two parts: after the second blank line (22 + 1 lines shown, and 21 + 1); a cut after the
    # first or the third would leave a part of 33 or 34
    assert notebook.paragraph_parts(text) == ["".join(lines[:22]), "".join(lines[22:])]
    assert notebook.paragraph_parts(text, limit=43) == [text]
    # no blank line where a cut would make the parts fit: cut at every one
    assert notebook.paragraph_parts(text, limit=5) == [
        "".join(lines[:11]), "".join(lines[11:22]), "".join(lines[22:33]), "".join(lines[33:])]


def test_the_capstones_batch_script_is_shown_whole_in_parts_that_fit():
    from helpers.on_a_cluster import slurm

    with open(slurm.SCRIPT) as file:
        script = file.read()
    pieces = notebook.paragraph_parts(script)
    assert len(pieces) > 1 and "".join(pieces) == script
    shown = [slurm.show_script(slurm.SCRIPT, part=part).data
             for part in range(1, len(pieces) + 1)]
    assert [len(text.splitlines()) for text in shown] == [
        len(piece.splitlines()) + 1 for piece in pieces]  # each with its line of which part
    assert all(len(text.splitlines()) <= notebook.LISTING_LINES for text in shown)
    assert shown[1].startswith(f"# {pathlib.Path(slurm.SCRIPT).name}, part 2 of {len(pieces)}\n")
    # and lesson 15 shows every part, in order, a cell each
    lesson = next(path for path in NOTEBOOKS if path.name.startswith("15_"))
    cells = ["".join(cell["source"]) for cell in json.loads(lesson.read_text())["cells"]]
    assert [cell for cell in cells if "show_script(slurm.SCRIPT" in cell] == [
        f"slurm.show_script(slurm.SCRIPT, part={part})" for part in range(1, len(pieces) + 1)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_a_printout_shown_in_two_halves_is_shown_in_both_one_a_cell_in_order(path):
    """A call with part=1 that is not a listing (a printout helpers.notebook.half_of halves) is
    followed, in the next code cell, by the same call with part=2."""
    cells = ["".join(cell["source"]) for cell in json.loads(path.read_text())["cells"]
             if cell["cell_type"] == "code"]
    for index, cell in enumerate(cells):
        for call, arguments in re.findall(r"([\w.]+)\(([^()]*), part=1\)", cell):
            if call.endswith(("show_code", "show_script")):
                continue  # listings: their own tests count their parts
            assert re.search(rf"{re.escape(call)}\({re.escape(arguments)}, part=2\)",
                             cells[index + 1]), (path.name, call, arguments)


def test_a_printout_in_two_halves_shows_every_item_once():
    assert notebook.half_of([1, 2, 3, 4, 5], None) == [1, 2, 3, 4, 5]
    assert notebook.half_of([1, 2, 3, 4, 5], 1) == [1, 2, 3]
    assert notebook.half_of([1, 2, 3, 4, 5], 2) == [4, 5]
    with pytest.raises(ValueError, match="part is 1 or 2"):
        notebook.half_of([1, 2], 3)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_a_listing_longer_than_a_slide_is_shown_in_its_parts_one_a_cell_in_order(path):
    """No listing a lesson shows passes the screen: one over LISTING_LINES is called with
    part=1, 2, ... in code cells one after the other, every part once."""
    cells = ["".join(cell["source"]) for cell in json.loads(path.read_text())["cells"]
             if cell["cell_type"] == "code"]
    namespace = {}
    for cell in cells:
        for node in ast.parse(cell).body:  # the notebook's own imports
            if isinstance(node, ast.Import | ast.ImportFrom):
                exec(ast.unparse(node), namespace)
    calls = [(index, name, int(part) if part else None) for index, cell in enumerate(cells)
             for name, part in re.findall(r"show_code\(([\w.]+)(?:, part=(\d+))?\)", cell)]
    wrong = []
    for index, name, part in calls:
        count = len(notebook.listing_parts(inspect.getsource(eval(name, namespace))))
        expected = [(index + k - (part or 1), name, k) for k in range(1, count + 1)]
        if count > 1 and not set(expected) <= set(calls) or count == 1 and part is not None:
            wrong.append((index, name, part, f"{count} part(s)"))
    assert wrong == []
