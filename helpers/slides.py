"""Slide metadata for presenting a lesson with RISE (jupyterlab-rise, `Alt+R`): each heading starts
a slide, and the cells under it are packed into sub-slides that fit a 1280 x 720 screen.

    python -m helpers.slides notebooks/NN_name.ipynb ...

rewrites the notebooks in place: the outputs of a cell's heartbeat go (helpers.notebook, which
makes them where a cell runs long), markdown cells are cut at their headings, and prose taller
than a screen is cut between paragraphs (never inside a fenced code block); every cell then gets
its `slideshow.slide_type`. Outputs are kept. tests/test_slides.py checks that running it changes
nothing, so the slides cannot drift from the lessons.

Heights are estimated from the cells' contents (a line of prose, of code, of output; a figure's
pixels), for a 1280 x 720 screen at notebooks/rise.css's text sizes: an estimate, which the
slides tier (`make slides`, tests/test_browser.py) measures in a real browser for every lesson.
A code cell is never cut, so a tall figure with its numbers can still pass the screen (a listing
longer than a slide the notebook shows in parts itself: helpers.notebook.show_code): the
notebook's RISE settings (`RISE`, in its metadata) make such a sub-slide scroll, so that its
bottom is reached with the mouse wheel (RISE's default, `scroll: false`, would hide it).
"""

from __future__ import annotations

import base64
import json
import struct
import sys
import uuid

from helpers.notebook import without_heartbeats

SCREEN_WIDTH, BUDGET = 1280, 600  # pixels of a slide's content, below the slide's margins
# At notebooks/rise.css's sizes: prose 20 px (a line of 99 characters at most), code and outputs
# 16 px in lines of 22.4 px (an output line of 115 characters at most).
PROSE_LINE, HEADING_LINE, BLANK_LINE, PROSE_WIDTH = 29, 53, 12, 99
CODE_LINE, OUTPUT_LINE, OUTPUT_WIDTH = 23, 23, 115
CELL_MARGIN, OUTPUT_MARGIN = 30, 8
WIDGET = 320  # a widget's area
# jupyterlab-rise's settings, in the notebook's metadata["rise"]: a sub-slide taller than the
# screen scrolls; each starts at the screen's top (centred, one whose cells grow as they run live
# would stay where its committed height put it, its end below the screen); and the next one is
# simply there, without sliding in (a code-heavy slide is read, not watched while it moves); and
# each shows its number of the lesson's sub-slides ("12 / 57": notebooks/rise.css sizes it).
# A lesson's first cell, its title slide (helpers.syllabus writes it), carries this tag: it is a
# sub-slide of its own.
TITLE_TAG = "lesson-title"
RISE = {"scroll": True, "center": False, "transition": "none", "slideNumber": "c/t"}


def markdown_height(source: str) -> int:
    height = CELL_MARGIN
    for line in source.splitlines():
        if not line.strip():
            height += BLANK_LINE
        elif line.startswith("#"):
            height += HEADING_LINE
        else:
            height += PROSE_LINE * (1 + len(line) // PROSE_WIDTH)
    return height


def _png_height(data: str) -> int:
    width, height = struct.unpack(">II", base64.b64decode(data[:64])[16:24])
    return int(height * min(1.0, (SCREEN_WIDTH - 80) / width))


def _text_height(text: str) -> int:
    return OUTPUT_LINE * sum(1 + len(line) // OUTPUT_WIDTH for line in text.splitlines())


def output_height(output: dict) -> int:
    if "text" in output:
        return OUTPUT_MARGIN + _text_height("".join(output["text"]))
    data = output.get("data", {})
    if "application/vnd.jupyter.widget-view+json" in data:  # live, not its saved first picture
        return WIDGET
    if "image/png" in data:
        return OUTPUT_MARGIN + _png_height(data["image/png"])
    if "text/html" in data:  # show_code's source, a checker's message (its lines), a progress bar
        lines = max("".join(data.get("text/plain", "")).count("\n"),
                    "".join(data["text/html"]).count("\n")) + 1
        return OUTPUT_MARGIN + max(OUTPUT_LINE * 2, CODE_LINE * lines)
    text = "".join(data.get("text/plain", ""))
    return OUTPUT_MARGIN + _text_height(text) if text else 0


def cell_height(cell: dict) -> int:
    source = "".join(cell["source"])
    if cell["cell_type"] == "markdown":
        return markdown_height(source)
    return (CELL_MARGIN + CODE_LINE * (source.count("\n") + 1)
            + sum(output_height(output) for output in cell.get("outputs", [])))


def _new_markdown(source: str, like: dict) -> dict:
    return {"cell_type": "markdown", "id": uuid.uuid4().hex[:8],
            "metadata": {key: value for key, value in like["metadata"].items()
                         if key != "slideshow"},
            "source": source.splitlines(keepends=True)}


def _pieces(source: str) -> list:
    """A markdown cell's text cut before every heading but its first line, and between
    paragraphs (or a list's items) where the text is taller than a screen (not inside ```
    fences)."""
    lines = source.splitlines(keepends=True)
    blocks, current, fenced = [], [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith("#") and current and not fenced:
            blocks.append(current)
            current = []
        current.append(line)
    blocks.append(current)
    pieces = []
    for block in blocks:
        pieces += _paragraphs(block)
    return ["".join(piece).strip("\n") for piece in pieces]


def _paragraphs(lines: list) -> list:
    if markdown_height("".join(lines)) <= BUDGET:
        return [lines]
    paragraphs, current, fenced = [], [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith(("- ", "* ")) and current and not fenced:  # a list's items, too
            paragraphs.append(current)
            current = []
        current.append(line)
        if not line.strip() and not fenced:
            paragraphs.append(current)
            current = []
    if current:
        paragraphs.append(current)
    packed, piece = [], []
    for paragraph in paragraphs:
        if piece and markdown_height("".join(piece + paragraph)) > BUDGET:
            packed.append(piece)
            piece = []
        piece += paragraph
    return packed + [piece]


# A sub-slide shows its point, and the speaker notes hold the rest (docs/presenting.md): at most
# this many words of prose on one, in every lesson.
WORDS_ON_A_SUB_SLIDE = 60
# The smallest text a figure may show, in px as a 1280 x 720 slide displays it (helpers.drawing
# sizes the course's text above it; the slides tier measures every figure as displayed).
FIGURE_TEXT_PX = 14


def prose_words(sub_slide: list) -> int:
    """The words of prose a sub-slide shows: its markdown cells' text, headings included, outside
    tables and fenced code; a word is a run of non-blank characters holding a letter or a digit
    (a list's dash and a formula's lone `=` are not words)."""
    count = 0
    for cell in sub_slide:
        if cell["cell_type"] != "markdown" or is_notes(cell):
            continue
        fenced = False
        for line in "".join(cell["source"]).splitlines():
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced and not line.lstrip().startswith("|"):
                count += sum(any(ch.isalnum() for ch in word) for word in line.split())
    return count


def is_notes(cell: dict) -> bool:
    """A speaker-notes cell: its author set its slide type to "notes" (JupyterLab's property
    inspector, Slide Type: Notes). The notebook shows it like any cell; the slides do not, and
    the speaker view (`T` in the slides) shows it beside the sub-slide it follows."""
    return cell.get("metadata", {}).get("slideshow", {}).get("slide_type") == "notes"


def split(cells: list) -> list:
    """The cells, each markdown cell cut into the pieces `_pieces` gives (speaker notes whole)."""
    result = []
    for cell in cells:
        if cell["cell_type"] != "markdown" or is_notes(cell):
            result.append(cell)
            continue
        pieces = _pieces("".join(cell["source"]))
        first = dict(cell, source=pieces[0].splitlines(keepends=True))
        result += [first] + [_new_markdown(piece, cell) for piece in pieces[1:]]
    return result


def assign(cells: list) -> list:
    """Each cell's slide type: "slide" at a #/## heading, "subslide" at a ### heading, after
    the title slide or where the sub-slide so far would outgrow the screen, "-" (the same
    sub-slide) otherwise. Speaker notes stay notes, and take no room on the screen."""
    used, after_title = 0, False
    for cell in cells:
        if is_notes(cell):
            continue
        source = "".join(cell["source"])
        height = cell_height(cell)
        if cell["cell_type"] == "markdown" and source.startswith(("# ", "## ")):
            kind, used = "slide", height
        elif (cell["cell_type"] == "markdown" and source.startswith("### ")
              or after_title or used and used + height > BUDGET):
            kind, used = "subslide", height
        else:
            kind, used = "-", used + height
        cell.setdefault("metadata", {})["slideshow"] = {"slide_type": kind}
        after_title = TITLE_TAG in cell["metadata"].get("tags", [])
    return cells


def slides(cells: list) -> list:
    """Every slide: lists of the sub-slides' cells, as RISE shows them (no speaker notes)."""
    found = []
    for cell in cells:
        if is_notes(cell):
            continue
        kind = cell["metadata"]["slideshow"]["slide_type"]
        if kind == "slide" or not found:
            found.append([[cell]])
        elif kind == "subslide":
            found[-1].append([cell])
        else:
            found[-1][-1].append(cell)
    return found


def rewrite(path: str) -> None:
    with open(path) as file:
        notebook = json.load(file)
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":  # a slow machine's "still running" lines
            cell["outputs"] = without_heartbeats(cell["outputs"])
    notebook["cells"] = assign(split(notebook["cells"]))
    notebook["metadata"]["rise"] = {**notebook["metadata"].get("rise", {}), **RISE}
    with open(path, "w") as file:
        json.dump(notebook, file, indent=1, ensure_ascii=False)
        file.write("\n")


if __name__ == "__main__":
    for name in sys.argv[1:]:
        rewrite(name)
