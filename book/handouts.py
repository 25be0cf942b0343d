"""`make handouts`: each lesson's slides as a PDF, one sub-slide a page, printed offline.

    python book/handouts.py OUT [--notes] [NN ...]      (NN: lessons, e.g. 06; default all)

Each lesson's committed notebook, its explorers' widgets replaced as in the book (book/website.py),
becomes reveal.js slides through nbconvert's reveal template (book/handouts/: every script local,
no MathJax), with the sub-slides helpers.slides packed; Chromium opens them in reveal.js's print
view (`?print-pdf`) and prints them to OUT/NN_lesson.pdf at 1280 x 720. A sub-slide taller than
the page (a talk scrolls it), or with a line wider, is zoomed out to fit it, and the run says which
and by how much; it fails if one still reaches past its page, or if a page asked the network for
anything.
With --notes, each sub-slide's speaker notes follow it on a page of their own.

reveal.js, require.js and jQuery come from npm's registry, pinned by version and checked by the
sha512 that npm publishes for them (VENDORED), once, into build/vendor/; after that nothing is
downloaded. Needs Chromium (`apt-get install chromium`) and the course's environment.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

import filelock
from nbconvert import SlidesExporter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from website import LESSONS, ROOT, for_the_book  # noqa: E402 - book/ is not a package

VENDOR = ROOT / "build" / "vendor"
# name: (tarball, npm's integrity, the files of it the slides load)
VENDORED = {
    "reveal.js": ("https://registry.npmjs.org/reveal.js/-/reveal.js-4.0.2.tgz",
                  "sha512-LWZSUenufF1gpD7npxJ7KfoQQFKgc1D6XrLTFgKlwWNP1BQ74hT48KONFWMAw+8R/QUeaScCLCLrBVHDfFIEiw==",
                  ("dist/", "plugin/notes/")),
    "requirejs": ("https://registry.npmjs.org/requirejs/-/requirejs-2.3.6.tgz",
                  "sha512-ipEzlWQe6RK3jkzikgCupiTbTvm4S0/CAU5GlgptkN5SO6F3u0UD0K18wy6ErDqiCyP4J4YYe1HuAShvsxePLg==",
                  ("require.js",)),
    "jquery": ("https://registry.npmjs.org/jquery/-/jquery-3.5.1.tgz",
               "sha512-XwIBPqcMn57FxfT+Go5pzySnm4KWkT1Tv7gjrpT1srtf8Weynl6R273VJ5GjkRb51IzMp5nbaPjJXMWeju2MKg==",
               ("dist/jquery.min.js",)),
}
# The page: RISE's screen in the slides tier, and a 16:9 page.
WIDTH, HEIGHT = 1280, 720


def vendor() -> Path:
    """The pinned scripts in build/vendor/NAME/, downloaded and checked the first time (by one
    process at a time: two at once would each see the other's half-written folder)."""
    VENDOR.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(VENDOR / ".lock"):
        _download_the_vendored()
    return VENDOR


def _download_the_vendored() -> None:
    for name, (url, integrity, wanted) in VENDORED.items():
        folder = VENDOR / name
        if (folder / ".checked").exists():
            continue
        with urllib.request.urlopen(url, timeout=60) as response:
            tarball = response.read()
        digest = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
        if digest != integrity:
            raise RuntimeError(f"{url}: sha512 {digest}, npm publishes {integrity}")
        shutil.rmtree(folder, ignore_errors=True)
        with tarfile.open(fileobj=io.BytesIO(tarball)) as archive:
            for member in archive.getmembers():
                inside = member.name.removeprefix("package/")
                if member.isfile() and inside.startswith(wanted):
                    (folder / inside).parent.mkdir(parents=True, exist_ok=True)
                    (folder / inside).write_bytes(archive.extractfile(member).read())
        (folder / ".checked").touch()


def slides_html(lesson: Path, out: Path) -> Path:
    """The lesson as reveal.js slides, out/NN_lesson.html, loading only files under out/."""
    exporter = SlidesExporter(
        extra_template_basedirs=[str(ROOT / "book")], template_name="handouts",
        reveal_url_prefix="vendor/reveal.js", require_js_url="vendor/requirejs/require.js",
        reveal_theme="white",  # its fonts are files of reveal.js (the default's come from Google)
        jquery_url="vendor/jquery/dist/jquery.min.js", reveal_width=str(WIDTH),
        reveal_height=str(HEIGHT), exclude_input_prompt=True, exclude_output_prompt=True)
    notebook = for_the_book(json.loads(lesson.read_text()))
    title = "".join(notebook["cells"][0]["source"]).splitlines()[0].lstrip("# ")  # "03 — ..."
    html, _ = exporter.from_file(io.StringIO(json.dumps(notebook)),
                                 resources={"metadata": {"name": title}})
    style = (ROOT / "notebooks" / "rise.css").read_text() + HANDOUT_CSS
    html = html.replace("</head>", f"<style>{style}</style>\n</head>", 1)
    page = out / f"{lesson.stem}.html"
    page.write_text(html)
    return page


# The slides' own sizes (notebooks/rise.css) set where JupyterLab's RISE sets them.
HANDOUT_CSS = """
body { --jp-content-font-size1: 20px; --jp-code-font-size: 16px; }
.reveal .slides { text-align: left; }
.reveal h1, .reveal h2, .reveal h3, .reveal h4 { text-transform: none; }  /* as in the notebook */
/* A margin on the paper, for a printer's edge and a student's notes. */
html.print-pdf .reveal .slides .pdf-page > section { padding: 24px 36px !important; }
.reveal .jp-OutputArea-output img { max-height: none; }
/* Chromium would add an empty page after the last one, a sub-slide's or its notes' (reveal.js
   breaks the page after every notes page). */
html.print-pdf .reveal .slides .pdf-page:last-child,
html.print-pdf .reveal .slides > section:last-child > .speaker-notes-pdf:last-child {
  page-break-after: avoid; break-after: avoid; }
"""

# In the print view, each sub-slide's page holds its section: one taller or wider than the page is
# zoomed out until it fits. Returns each scale under 1, by page. What a closed <details> folds
# away (a long listing's rest: helpers.notebook) is not printed, though Chromium still gives it a
# box, as tall as it would be open: it is not measured.
SHOWN = "const shown = (element) => element.checkVisibility();"
FIT_TO_PAGE = """() => {
  """ + SHOWN + """
  const scales = {};
  document.querySelectorAll('.reveal .pdf-page').forEach((page, index) => {
    const section = page.querySelector('section');
    if (!section || section.classList.contains('stack')) return;
    // The page's own size (reveal.js makes it a pixel less tall than the paper), and a little
    // room: a line that overhangs the page by one pixel would be printed on the next. A line
    // of code or output wider than the page (it does not wrap) counts too.
    const height = page.clientHeight - 4, tall = section.scrollHeight;
    const left = section.getBoundingClientRect().left, width = page.clientWidth;
    const wide = Math.max(0, ...[...section.querySelectorAll('*')].filter(shown).map(
      (element) => element.getBoundingClientRect().right - left));
    if (tall > height || wide > width) {
      const scale = Math.min(height / tall, width / wide, 1);
      // CSS zoom, not a transform: it shrinks the layout itself, so that printing, which
      // carries what overflows a page onto the next, finds nothing to carry.
      section.style.setProperty('zoom', String(scale), 'important');
      // (in px, which the zoom scales: a percentage would stay the page's width unzoomed)
      section.style.setProperty('width', `${page.clientWidth / scale}px`, 'important');
      scales[index + 1] = scale;
    }
  });
  return scales;
}"""


# As printed: the pages whose sub-slide still reaches below them (printing would draw the rest
# over the next page) or past their right edge (cut off).
OVERHANGING = """() => [...document.querySelectorAll('.reveal .pdf-page')].flatMap((page, i) => {
  """ + SHOWN + """
  const section = page.querySelector('section');
  if (!section) return [];
  const box = (element) => element.getBoundingClientRect();
  const past = (edge) => Math.max(...[section, ...section.querySelectorAll('*')].filter(shown).map(
    element => box(element)[edge])) - box(page)[edge];
  return past('bottom') > 0.5 || past('right') > 1 ? [i + 1] : [];
})"""


def print_pdf(context, page_html: Path, pdf: Path, notes: bool = False) -> dict:
    """Print the slides to `pdf` from a browser context. Returns the pages scaled to fit,
    {page: scale}, those that overhang their page even so, and the addresses the page asked for
    that are not files (both none, unless this is broken)."""
    page = context.new_page()
    elsewhere = []  # what the page asked for that is not a file (offline, it gets nothing)
    page.on("request", lambda request: request.url.startswith("file:")
            or elsewhere.append(request.url))
    try:
        page.goto(page_html.as_uri() + "?print-pdf" + ("&notes" if notes else ""))
        page.wait_for_selector("body[data-handout-ready=yes]", timeout=60_000)
        page.emulate_media(media="print")  # measured as printed: the print rules apply
        scales = page.evaluate(FIT_TO_PAGE)
        overhanging = page.evaluate(OVERHANGING)
        page.pdf(path=str(pdf), prefer_css_page_size=True, print_background=True)
        return {"scaled": scales, "overhanging": overhanging, "fetched_elsewhere": elsewhere}
    finally:
        page.close()


def handouts(out: Path, lessons: list, notes: bool = False) -> dict:
    """Write each lesson's PDF into `out`; return {pdf: what print_pdf returned}."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("make handouts prints with Chromium: apt-get install chromium")
    beside_the_slides(out)
    printed = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        context = browser.new_context(offline=True, viewport={"width": WIDTH, "height": HEIGHT})
        for lesson in lessons:
            pdf = out / f"{lesson.stem}.pdf"
            printed[pdf] = print_pdf(context, slides_html(lesson, out), pdf, notes)
        browser.close()
    return printed


def beside_the_slides(out: Path) -> None:
    """The folder `out`, with the scripts the slides load (vendor())."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(vendor(), out / "vendor", dirs_exist_ok=True)


def pdf_pages(pdf: Path) -> int:
    """The pages of a PDF Chromium wrote: its page objects (`/Type /Page`, not `/Pages`)."""
    return len(re.findall(rb"/Type\s*/Page\b(?!s)", pdf.read_bytes()))


def main(argv: list) -> None:
    notes = "--notes" in argv
    chosen = [name for name in argv if name != "--notes"]
    out = Path(chosen.pop(0) if chosen else ROOT / "build" / "handouts").resolve()
    lessons = [lesson for lesson in LESSONS if not chosen or lesson.name[:2] in chosen]
    broken = []
    for pdf, printed in handouts(out, lessons, notes).items():
        scales = printed["scaled"]
        fitted = (f"; {len(scales)} taller than the page, scaled to fit it (smallest "
                  f"{min(scales.values()):.2f})" if scales else "")
        print(f"{pdf}: {pdf_pages(pdf)} pages{fitted}")
        broken += [f"{pdf.name}: page {page} reaches past its edge"
                   for page in printed["overhanging"]]
        broken += [f"{pdf.name}: asked the network for {url}"
                   for url in printed["fetched_elsewhere"]]
    if broken:
        raise SystemExit("error: " + "; ".join(broken))


if __name__ == "__main__":
    main(sys.argv[1:])
