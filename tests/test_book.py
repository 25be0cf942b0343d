"""`make book` (book/website.py): the course as a website, read in Chromium with the network off;
and `make handouts` (book/handouts.py): each lesson's slides as a PDF, one sub-slide a page.

Every page loads without a request leaving the disk; every internal link leads to a page, and
every #anchor to an element of it; every figure of each lesson's notebook is on its page, drawn;
each explorer's live widget gives way to its first picture and a line saying where it moves; the
navigation lists every lesson; the search finds a lesson. The book is built from a fresh copy of
the committed notebooks by the Makefile's own target. Screenshots: test-artifacts/book/.
The handouts' pages are counted against the sub-slides the notebooks' slideshow metadata starts,
and `make handouts` fails on a sub-slide that reaches past its page; a speaker note adds a
page after its sub-slide.
"""

import contextlib
import json
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path

import filelock
import nbformat
import pytest
from browser import CHROMIUM_ARGS, chromium, needs_chromium

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "book"))  # book/ is not a package
import handouts  # noqa: E402
import website  # noqa: E402

SCREENSHOTS = REPO / "test-artifacts" / "book"
LESSONS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
pytestmark = [pytest.mark.slides, needs_chromium]

# Everything a page shows, read in the page: its images (drawn: a width once decoded), its links,
# the ids its anchors may name, and the text of its main column.
READ_PAGE = """() => ({
  images: [...document.querySelectorAll('img')].map(img => ({
    src: img.currentSrc || img.src, drawn: img.complete && img.naturalWidth > 0,
    main: !!img.closest('main')})),
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  ids: [...document.querySelectorAll('[id]')].map(element => element.id),
  text: (document.querySelector('main') || document.body).innerText,
})"""


def make(target: str, **variables) -> str:
    """Run `make target` in the repository and return what it printed (its errors go to the
    test's stderr, which a failure shows). `make book` one at a time: the slides tier's workers
    would otherwise create the book's environment (.venv-book) at once, and one run pip in
    another's half-made one. (`make handouts` runs in the course's environment, and locks its
    own download.)"""
    (REPO / "build").mkdir(exist_ok=True)
    lock = filelock.FileLock(REPO / "build" / ".make.lock") if target == "book" else (
        contextlib.nullcontext())
    with lock:
        return subprocess.run(["make", "--no-print-directory", target,
                               *(f"{name}={value}" for name, value in variables.items())],
                              cwd=REPO, check=True, stdout=subprocess.PIPE, text=True).stdout


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    """The site `make book` builds, into a folder of this test's."""
    out = tmp_path_factory.mktemp("book")
    make("book", BOOK=out)
    return out / "html"


@pytest.fixture(scope="module")
def offline_browser():
    """A Chromium context with the network off, that also refuses (and records) every request
    for anything but a file: a page that fetched a script, font or style would not work offline."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        context = browser.new_context(offline=True, viewport={"width": 1280, "height": 720})
        context.fetched_elsewhere = []

        def only_files(route):
            if route.request.url.startswith("file://"):
                route.continue_()
            else:
                context.fetched_elsewhere.append(route.request.url)
                route.abort()

        context.route("**/*", only_files)
        yield context
        browser.close()


def _read(context, path: Path) -> dict:
    page = context.new_page()
    try:
        page.goto(path.as_uri(), wait_until="load")
        return {**page.evaluate(READ_PAGE), "url": page.url}
    finally:
        page.close()


def _image_outputs(notebook: Path) -> int:
    cells = json.loads(notebook.read_text())["cells"]
    return sum(any(mime.startswith("image/") for mime in output.get("data", {}))
               for cell in cells for output in cell.get("outputs", []))


def _widgets(notebook: Path) -> int:
    cells = json.loads(notebook.read_text())["cells"]
    return sum(website.WIDGET in output.get("data", {})
               for cell in cells for output in cell.get("outputs", []))


def _widgets_without_a_picture(notebook: Path) -> list:
    """The cells whose live widget's saved output does not carry a picture of its first state."""
    cells = json.loads(notebook.read_text())["cells"]
    return [index for index, cell in enumerate(cells) for output in cell.get("outputs", [])
            if website.WIDGET in output.get("data", {}) and website.PNG not in output["data"]]


def test_every_page_loads_offline_with_its_figures_and_links(book, offline_browser):
    pages = sorted(book.rglob("*.html"))
    read = {path: _read(offline_browser, path) for path in pages}
    assert offline_browser.fetched_elsewhere == []

    broken_images = [(path.relative_to(book), image["src"]) for path, page in read.items()
                     for image in page["images"] if not image["drawn"]]
    assert broken_images == []

    broken_links = []
    for path, page in read.items():
        for link in page["links"]:
            target = urllib.parse.urlsplit(link)
            if target.scheme != "file":
                continue  # a link out (the sources the lessons quote) is the reader's to follow
            file = Path(urllib.parse.unquote(target.path))
            if not file.is_file():
                broken_links.append((path.relative_to(book), link))
            elif target.fragment and file.suffix == ".html":
                ids = read[file]["ids"] if file in read else []
                if urllib.parse.unquote(target.fragment) not in ids:
                    broken_links.append((path.relative_to(book), link))
    assert broken_links == []

    # The front page is README, with its gallery, and the navigation reaches every lesson.
    front = read[book / "index.html"]
    assert "A course that teaches torch.distributed by running it" in front["text"]
    gallery = {Path(urllib.parse.urlsplit(image["src"]).path).name for image in front["images"]}
    assert {f"{lesson.stem}.svg" for lesson in LESSONS} <= gallery
    lesson_pages = {(book / "notebooks" / f"{lesson.stem}.html").as_uri() for lesson in LESSONS}
    assert lesson_pages <= set(front["links"])

    # Each lesson: every figure its notebook holds (an explorer's first picture among them), in
    # the page's main column, and each live widget replaced by its picture and the line that says
    # where it runs; not the worker pool's start.
    for lesson in LESSONS:
        page = read[book / "notebooks" / f"{lesson.stem}.html"]
        figures = [image for image in page["images"] if image["main"]]
        assert len(figures) == _image_outputs(lesson), lesson.name
        assert page["text"].count(website.LIVE_ONLY.replace("`", "")) == _widgets(lesson)
        assert "Warming up" not in page["text"] and "worker pool: ready" not in page["text"]
        assert _widgets_without_a_picture(lesson) == [], lesson.name
        assert "interactive(children=" not in page["text"]


def test_the_search_finds_a_lesson_offline(book, offline_browser):
    page = offline_browser.new_page()
    try:
        page.goto((book / "search.html").as_uri() + "?q=reduce_scatter", wait_until="load")
        results = page.locator("#search-results li a")
        results.first.wait_for(timeout=30_000)
        found = {Path(urllib.parse.urlsplit(href).path).name
                 for href in results.evaluate_all("links => links.map(a => a.href)")}
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=SCREENSHOTS / "search.png")
        page.goto((book / "notebooks" / "07_zero_and_fsdp.html").as_uri(), wait_until="load")
        page.screenshot(path=SCREENSHOTS / "07_zero_and_fsdp.png")
    finally:
        page.close()
    assert {"03_collectives.html", "07_zero_and_fsdp.html"} <= found
    assert offline_browser.fetched_elsewhere == []


def _sub_slides(notebook: Path) -> int:
    """Sub-slides, from the cells' slideshow metadata alone: each slide or sub-slide starts one."""
    cells = json.loads(notebook.read_text())["cells"]
    return sum(cell["metadata"].get("slideshow", {}).get("slide_type") in ("slide", "subslide")
               for cell in cells)


# A lesson a case: the slides tier runs a fifth of them, chosen from the commit (takes_turns(5),
# conftest.py), so every lesson's handout is printed within five commits. Printing is the same
# for every lesson, and all fifteen took 191 s, the tier's longest test (on 2026-12-01 a third of
# them, lessons 01, 04, 07, 10 and 13, took 89 s of the workers' time in a tier of 184 s on three
# workers); make handouts prints them all, make slides SHARE=1 tests them all.
@pytest.mark.takes_turns(5)
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda lesson: lesson.name[:2])
def test_the_handouts_print_each_lesson_one_sub_slide_a_page(tmp_path, lesson):
    # pages, and the sub-slides scaled to fit theirs (-rA shows it)
    print(make("handouts", HANDOUTS=tmp_path, LESSON=lesson.name[:2]))
    assert sorted(path.name for path in tmp_path.glob("*.pdf")) == [f"{lesson.stem}.pdf"]
    pdf = (tmp_path / f"{lesson.stem}.pdf").read_bytes()
    assert handouts.pdf_pages(tmp_path / f"{lesson.stem}.pdf") == _sub_slides(lesson)
    # 1280 x 720 CSS pixels, the slides tier's screen, is 960 x 540 points.
    assert set(re.findall(rb"/MediaBox\s*\[([^\]]*)\]", pdf)) == {b"0 0 960 540"}


def test_with_notes_the_handouts_print_each_sub_slides_notes_on_a_page_after_it(
        tmp_path, offline_browser):
    notebook = json.loads(LESSONS[0].read_text())
    # the lesson without the notes it has, and a short note after its title and after its last
    # cell (reveal.js breaks the page after a notes page: the last must not add a blank one)
    notebook["cells"] = [cell for cell in notebook["cells"]
                         if cell["metadata"].get("slideshow", {}).get("slide_type") != "notes"]
    for where, say in ((1, "Say why the ranks are processes."), (None, "Set the exercises.")):
        notes = nbformat.v4.new_markdown_cell(say, metadata={"slideshow": {"slide_type": "notes"}})
        notebook["cells"].insert(len(notebook["cells"]) if where is None else where, notes)
    with_notes = tmp_path / LESSONS[0].name
    with_notes.write_text(json.dumps(notebook))
    handouts.beside_the_slides(tmp_path)
    slides = handouts.slides_html(with_notes, tmp_path)
    for pdf, shown in (("with.pdf", True), ("without.pdf", False)):
        handouts.print_pdf(offline_browser, slides, tmp_path / pdf, notes=shown)
    pages = _sub_slides(LESSONS[0])
    assert handouts.pdf_pages(tmp_path / "with.pdf") == pages + 2
    assert handouts.pdf_pages(tmp_path / "without.pdf") == pages
    assert offline_browser.fetched_elsewhere == []
