"""`make book`: the course as a static website, built from the committed notebooks (never
executed again), readable offline.

    python book/website.py OUT     stage the pages in OUT/source, build the site in OUT/html

Staged: README.md as the front page (with the table of contents the navigation needs appended,
and the other pages' links to it pointed there), the lessons' notebooks, the docs and the other
READMEs it links to, the figures of its gallery, and book/conf.py with its stylesheet. In each
notebook an explorer's live widget, which needs a running kernel, gives way to the picture it
starts from, which its saved output carries (helpers/explorer.py), and a line saying where its
sliders move. Sphinx runs with warnings as errors, so a link to a page that is not there fails
the build.
Runs in the book's own environment (requirements-book.txt, `make book`): no torch needed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted(ROOT.glob("notebooks/[0-9][0-9]_*.ipynb"))
# The pages besides the lessons: every Markdown file README links to, and what those link to.
PAGES = ["docs/syllabus.md", "docs/teaching.md", "docs/presenting.md", "docs/platforms.md",
         "docs/book.md", "CONTRIBUTING.md", "helpers/launcher/README.md", "benchmarks/README.md"]
WIDGET = "application/vnd.jupyter.widget-view+json"
PNG = "image/png"
LIVE_ONLY = ("An explorer starts from this picture in the notebook: its sliders need a running "
             "kernel, so open the lesson in Jupyter (`make lab`) to move them.")
# The worker pool's start, which the first code cell of every lesson shows as it runs (a printed
# line, helpers.notebook.WarmUpIndicator, and its progress bar): the kernel's business, not the
# lesson's.
WARM_UP_LINE, WARM_UP_BAR = "Warming up: starting the worker pool", "worker pool: ready"


def stage(source: Path) -> None:
    """Write the pages Sphinx builds from into `source`."""
    if source.exists():
        shutil.rmtree(source)
    (source / "notebooks").mkdir(parents=True)
    front = (ROOT / "README.md").read_text()
    (source / "index.md").write_text(front + _table_of_contents())
    for page in PAGES:
        (source / page).parent.mkdir(parents=True, exist_ok=True)
        (source / page).write_text(_front_page_linked_as_index(page, (ROOT / page).read_text()))
    # The gallery's figures are <img> tags in README, which Sphinx does not follow: copied as
    # they are, to the same place beside the front page (conf.py, html_extra_path).
    shutil.copytree(ROOT / "figures", source / "_extra" / "figures")
    shutil.copy(ROOT / "book" / "conf.py", source / "conf.py")
    shutil.copytree(ROOT / "book" / "_static", source / "_static")
    for lesson in LESSONS:
        notebook = json.loads(lesson.read_text())
        (source / "notebooks" / lesson.name).write_text(json.dumps(for_the_book(notebook)))


def for_the_book(notebook: dict) -> dict:
    """The notebook as the book shows it: each live widget's output its first picture and a line
    saying where it runs, no widget state (its scripts would come from a CDN), and not the worker
    pool's start."""
    notebook = json.loads(json.dumps(notebook))
    notebook["metadata"].pop("widgets", None)
    for cell in notebook["cells"]:
        if "outputs" in cell:
            cell["outputs"] = [kept for output in cell["outputs"]
                               for shown in _without_the_widget(output)
                               if (kept := _without_the_warm_up(shown)) is not None]
    return notebook


def _without_the_widget(output: dict) -> list:
    """A live widget's output as its picture (helpers/explorer.py) and the line LIVE_ONLY; any
    other output as it is."""
    data = output.get("data", {})
    if WIDGET not in data:
        return [output]
    line = {"output_type": "display_data", "metadata": {},
            "data": {"text/markdown": LIVE_ONLY, "text/plain": LIVE_ONLY}}
    pictures = [{"output_type": "display_data", "metadata": {},
                 "data": {PNG: data[PNG], "text/plain": "the explorer's first picture"}}
                ] if PNG in data else []
    return pictures + [line]


def _without_the_warm_up(output: dict) -> dict | None:
    """The output without the worker pool's start: None for its progress bar, and a printed text
    without its line (None if nothing else was printed)."""
    if WARM_UP_BAR in "".join(output.get("data", {}).get("text/html", "")):
        return None
    if output["output_type"] != "stream":
        return output
    lines = "".join(output["text"]).splitlines(keepends=True)
    text = "".join(line for line in lines if not line.startswith(WARM_UP_LINE))
    return {**output, "text": text} if text else None


def _front_page_linked_as_index(page: str, text: str) -> str:
    """The page's links to README.md, which the book calls index.md, pointed there."""
    here = (ROOT / page).parent

    def relinked(link):
        target, anchor = link[2].partition("#")[::2]
        if (here / target).resolve() != ROOT / "README.md":
            return link[0]
        index = os.path.relpath(ROOT / "index.md", here)
        return f"{link[1]}{index}{'#' + anchor if anchor else ''})"

    return re.sub(r"(\]\()([^)\s]+)\)", relinked, text)


def _table_of_contents() -> str:
    lessons = "\n".join(f"notebooks/{lesson.stem}" for lesson in LESSONS)
    pages = "\n".join(page.removesuffix(".md") for page in PAGES)
    return (f"\n\n```{{toctree}}\n:hidden:\n:caption: Lessons\n\n{lessons}\n```\n\n"
            f"```{{toctree}}\n:hidden:\n:caption: Teaching and contributing\n\n{pages}\n```\n")


def build(out: Path) -> Path:
    """Stage and build the site; return the folder of its index.html."""
    stage(out / "source")
    html = out / "html"
    subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q",
                    "-d", str(out / "doctrees"),  # Sphinx's cache, not in the site
                    str(out / "source"), str(html)], check=True)
    return html


if __name__ == "__main__":
    site = build(Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "build" / "book").resolve())
    print(f"the book: {site / 'index.html'}")
