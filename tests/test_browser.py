"""The lessons in a real JupyterLab, driven by headless Chromium: what a person would see.

Needs Debian's chromium (`apt-get install chromium`; .ci/run installs it; tests/browser.py).
Without Chromium this test is skipped, and says why.
Screenshots: test-artifacts/browser/ (the path is printed).
"""

import ast
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from browser import CHROMIUM_ARGS, chromium, needs_chromium

from helpers import drawing, present, slides

REPO = Path(__file__).resolve().parent.parent
SCREENSHOTS = REPO / "test-artifacts" / "browser"
LESSONS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
pytestmark = needs_chromium


@dataclass(frozen=True)
class Lab:
    """The worker's JupyterLab, as one test sees it: its address and token, the server's runtime
    folder (the kernels' connection files), and this test's own folder under the server's root,
    holding fresh copies of the lessons, by its path there (`prefix`) and on disk (`folder`)."""

    base: str
    token: str
    runtime_dir: str
    prefix: str
    folder: Path

    def path(self, notebook: str) -> str:
        """A notebook of this test's folder, as the server names it."""
        return f"{self.prefix}/{notebook}"


_SHUTTING_DOWN = []  # the threads shutting down the kernels of the tests that have ended


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory):
    """JupyterLab on loopback with a token and its own settings, one for all the tests a worker
    runs: starting one takes seconds of the worker's CPU. Each test has a folder of its own under
    its root (the `lab` fixture)."""
    root = tmp_path_factory.mktemp("lab")
    port, token = present.free_port(), secrets.token_hex(16)
    private = {name: str(root / f".{name.lower()}") for name in (
        "JUPYTER_RUNTIME_DIR", "JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR")}
    log = open(root / "jupyterlab.log", "w")  # noqa: SIM115 - closed in the finally below
    # The settings `make present` gives the slideshow (an interrupt shortcut; no news toast)
    present.write_settings(Path(private["JUPYTERLAB_SETTINGS_DIR"]))
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", "--LabApp.news_url=None", "--allow-root"],
        cwd=root, env={**os.environ, **private},
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        if not present.wait_until_up(port, token, server):
            tail = (root / "jupyterlab.log").read_text()[-2000:]
            raise RuntimeError(f"JupyterLab did not start within 60 s:\n{tail}")
        yield f"http://127.0.0.1:{port}", token, private["JUPYTER_RUNTIME_DIR"], root
    finally:
        for shutting in _SHUTTING_DOWN:  # the last tests' kernels, before their server goes
            shutting.join(30)
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def _api(lab, method, path):
    request = urllib.request.Request(f"{lab.base}/api/{path}?token={lab.token}", method=method)
    with urllib.request.urlopen(request, timeout=10) as reply:
        body = reply.read()
    return json.loads(body) if body else None


@pytest.fixture
def lab(lab_server, request):
    """This test's view of the worker's JupyterLab (Lab): a folder of its own, with fresh copies
    of the lessons and notebooks/rise.css, so that what an earlier test ran and saved is not
    here. The lab view opens in a workspace named after the folder (`_run_all_cells`): the
    server's default workspace would restore the last test's tabs into the next page, whose
    locators would then find another lesson's cells. The kernels this test started are shut
    down after it."""
    base, token, runtime_dir, root = lab_server
    prefix = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name).strip("-")
    folder = root / prefix
    folder.mkdir()
    for path in LESSONS + [REPO / "notebooks" / "rise.css"]:
        shutil.copy(path, folder / path.name)
    view = Lab(base, token, runtime_dir, prefix, folder)
    yield view
    # (a kernel takes seconds to shut down: the next test need not wait for it)
    for session in _api(view, "GET", "sessions"):
        if session["path"].startswith(f"{prefix}/"):
            shutting = threading.Thread(target=_api, args=(view, "DELETE",
                                                           f"sessions/{session['id']}"))
            shutting.start()
            _SHUTTING_DOWN.append(shutting)


@pytest.fixture
def page(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1000}), lab
        finally:
            browser.close()


def _run_all_cells(page, lab, notebook, last_output):
    page.goto(f"{lab.base}/lab/workspaces/{lab.prefix}/tree/{lab.path(notebook)}?token={lab.token}")
    page.locator(".jp-Notebook").first.wait_for(timeout=60_000)
    # The kernel is ready when the status bar says so (the toolbar's indicator is idle earlier).
    page.get_by_text("Python 3 (ipykernel) | Idle").first.wait_for(timeout=60_000)
    first_prompt = page.locator(".jp-CodeCell .jp-InputPrompt").first
    for _ in range(3):
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:  # "[*]:" or "[1]:" once the run has really started
            page.wait_for_function("prompt => /\\[[*0-9]+\\]/.test(prompt.textContent)",
                                   arg=first_prompt.element_handle(), timeout=15_000)
            break
        except Exception:
            continue
    try:
        page.get_by_text(last_output).first.wait_for(state="attached", timeout=180_000)
    except Exception:
        _screenshot(page, f"{notebook.split('.')[0]}_did_not_finish")
        raise


def _show(locator):
    """Scroll `locator` into view and wait until it is painted (cells render lazily)."""
    locator.scroll_into_view_if_needed()
    locator.wait_for(state="visible", timeout=10_000)
    locator.page.wait_for_timeout(500)
    return locator


def _screenshot(page, name):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    print(f"screenshot: {path}")


@pytest.mark.slides  # the browser tier: make test leaves real browsers to it
def test_lesson_01_shows_grouped_output_a_figure_and_the_checker(page):
    page, lab = page
    _run_all_cells(page, lab, "01_processes_and_groups.ipynb", "[NOT YET] column_sum")
    # `import helpers` starts the worker pool in the background, with a progress bar
    first_launch = _show(page.locator(".jp-CodeCell",
                                      has_text="from helpers.processes_and_groups import").first)
    indicator = first_launch.locator("progress.helpers-progress")
    assert indicator.count() == 1 and indicator.get_attribute("value") == "1.00"
    assert "worker pool: ready" in first_launch.inner_text()
    assert "Warming up" in first_launch.inner_text()
    _screenshot(page, "01_warm_up")
    grouped = _show(page.locator(".jp-OutputArea-output",
                                 has_text="[rank 0] I am rank 0 of 4").first)
    text = grouped.inner_text()
    positions = [text.index(f"[rank {r}] I am rank {r} of 4") for r in range(4)]
    assert positions == sorted(positions), text  # all four ranks, in one output, in rank order
    _screenshot(page, "01_grouped_output")

    figure = _show(page.locator(".jp-RenderedImage img").first)
    assert figure.evaluate("image => image.complete && image.naturalWidth > 100")
    _screenshot(page, "01_figure")

    checker = _show(page.locator(".jp-OutputArea-output", has_text="[NOT YET] even_odd_sum").first)
    assert "waiting for your code" in checker.inner_text()
    _screenshot(page, "01_checker")


@pytest.mark.slides
def test_lesson_05_stepper_slider_redraws_the_ring(page):
    page, lab = page
    _run_all_cells(page, lab, "05_how_all_reduce_works.ipynb",
                   "[NOT YET] binomial_tree_reduce")
    cell = page.locator(".jp-CodeCell", has_text="widgets.ring_stepper(traces)").first
    drawing = _show(cell.locator(".widget-output img").first)
    before = drawing.get_attribute("src")
    _screenshot(page, "05_stepper_step_0")
    handle = cell.locator(".noUi-handle").first
    handle.focus()
    page.keyboard.press("ArrowRight")
    page.wait_for_function(
        "([cell, before]) => { const image = cell.querySelector('.widget-output img');"
        " return image && image.getAttribute('src') !== before; }",
        arg=[cell.element_handle(), before], timeout=30_000)
    # the slider's label is the step the panel's title shows: from "start" to step 0
    assert cell.locator(".widget-readout").first.inner_text().strip() == "0"
    _show(cell.locator(".widget-output img").first)
    _screenshot(page, "05_stepper_step_1")


SCREEN = {"width": 1280, "height": 720}
# notebooks/rise.css's sizes: no text on a slide is smaller (the cells' prompts aside)
PROSE_PX, CODE_PX = 20, 16
# A figure on screen is known by the length of its data: URL and its last this many characters
# (a PNG's ends with its last compressed bytes, its checksums and its IEND chunk)
FIGURE_KEY, PNG = 120, "image/png"
# The sub-slides that may be taller than the screen, each with why: by lesson, the first line of
# the sub-slide's first cell. The tier fails on any other, and on one listed that fits.
TALLER_THAN_THE_SCREEN = {}
# A word narrower than this share of its cell's width fits a line of it (the rest: the cell's
# padding and prompt), so a wrap must not cut it; a wider one may be cut.
WORD_FITS = 0.8
# The sub-slide on screen (RISE nests a slide's sub-slides: the innermost present one)
PRESENT = ("(() => { const present = document.querySelectorAll('.reveal .slides section.present');"
           " return present[present.length - 1]; })()")
# On the sub-slide on screen: its height, whether it scrolls (taller than the screen: rise.css
# caps it at 95 % of the screen) and where it ends, the outputs, inputs and prose whose words pass
# their box's or the screen's right edge, the words a wrapped line cuts in two, and the smallest
# text and prose (font size in px, where), and the words of prose on screen.
MEASURE = f"""() => {{
  const WORD_FITS = {WORD_FITS};
  const present = {PRESENT};
  const texts = (root) => {{
    const found = [], walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {{
      const parent = node.parentElement;
      if (node.textContent.trim() && parent.getClientRects().length
          && !parent.closest('.jp-InputPrompt, .jp-OutputPrompt, mjx-container, sub, sup')) {{
        found.push(node);
      }}
    }}
    return found;
  }};
  const right = (node) => {{  // of its words: a space that ends a wrapped line may hang past
    const range = document.createRange();
    let most = 0;
    for (const word of node.textContent.matchAll(/\\S+/g)) {{
      range.setStart(node, word.index);
      range.setEnd(node, word.index + word[0].length);
      most = Math.max(most, range.getBoundingClientRect().right);
    }}
    return most;
  }};
  const wide = Array.from(present.querySelectorAll(
      '.jp-OutputArea-output, .jp-InputArea-editor, .jp-RenderedMarkdown')).map(box => [
      Math.round(Math.max(0, ...texts(box).map(right))),
      Math.round(Math.min(box.getBoundingClientRect().right, {SCREEN["width"]})),
      box.innerText.slice(0, 40)]).filter(([text, edge]) => text > edge + 1);
  const range = document.createRange();  // words a wrapped line cuts in two, though they fit one
  const broken = [];
  for (const box of present.querySelectorAll(
      '.jp-OutputArea-output, .jp-InputArea-editor, .jp-RenderedMarkdown')) {{
    for (const node of texts(box)) {{
      for (const word of node.textContent.matchAll(/[!-,.-~]+/g)) {{  // ASCII: a hyphen or a CJK
        // character (in lesson 14's sampled bytes) may end a line
        range.setStart(node, word.index);
        range.setEnd(node, word.index + word[0].length);
        const rects = Array.from(range.getClientRects()).filter(r => r.width > 0);
        const tops = new Set(rects.map(r => Math.round(r.top)));
        const width = rects.reduce((sum, r) => sum + r.width, 0);  // its width on one line
        if (tops.size > 1 && width < WORD_FITS * box.getBoundingClientRect().width) {{
          broken.push(word[0]);
        }}
      }}
    }}
  }}
  if (present.scrollWidth > present.clientWidth + 1) {{
    wide.push([present.scrollWidth, present.clientWidth, 'the sub-slide scrolls sideways']);
  }}
  let smallest = [1000, ''];
  for (const node of texts(present)) {{
    const size = parseFloat(getComputedStyle(node.parentElement).fontSize);
    if (size < smallest[0]) smallest = [size, node.textContent.trim().slice(0, 40) + ' in <'
        + node.parentElement.tagName.toLowerCase() + ' class="' + node.parentElement.className
        + '"> of ' + (node.parentElement.closest('.jp-Cell') || present).className];
  }}
  let prose = [1000, ''];  // the markdown's text, its code and tables aside
  for (const node of texts(present)) {{
    if (!node.parentElement.closest('.jp-RenderedMarkdown')
        || node.parentElement.closest('pre, code, table')) continue;
    const size = parseFloat(getComputedStyle(node.parentElement).fontSize);
    if (size < prose[0]) prose = [size, node.textContent.trim().slice(0, 40)];
  }}
  // words of prose on screen: the rendered markdown's, its code blocks and tables aside (and the
  // speaker notes, which are not on screen)
  const words = Array.from(present.querySelectorAll('.jp-RenderedMarkdown'))
    .filter(box => box.getClientRects().length && !box.closest('aside'))
    .reduce((sum, box) => {{
      const copy = box.cloneNode(true);
      copy.querySelectorAll('pre, table').forEach(element => element.remove());
      return sum + copy.innerText.split(/\\s+/).filter(word => /[\\p{{L}}\\p{{N}}]/u.test(word))
        .length;
    }}, 0);
  // the figures on screen (data: PNGs, as JupyterLab shows an output's), each by its length and
  // its end, with its width as displayed and its own
  const figures = Array.from(present.querySelectorAll('img'))
    .filter(img => img.getClientRects().length && img.src.startsWith('data:image/png;base64,'))
    .map(img => {{ const src = img.src.replace(/\\s/g, '');
                   return [src.length, src.slice(-{FIGURE_KEY}), img.getBoundingClientRect().width,
                           img.naturalWidth]; }});
  const number = document.querySelector('.reveal .slide-number');
  return {{number: number && getComputedStyle(number).display !== 'none' ? [number.innerText.trim(),
          parseFloat(getComputedStyle(number.querySelector('span') || number).fontSize)] : null,
          height: present.scrollHeight, scrolls: present.scrollHeight > present.clientHeight + 1,
          bottom: present.getBoundingClientRect().bottom, hash: window.location.hash,
          wide: wide, broken: broken, smallest: smallest, prose: prose, words: words,
          figures: figures}};
}}"""


def _figure_texts(cells) -> dict:
    """The smallest text of each figure the lesson's outputs hold, in its PNG's pixels (drawn in a
    kernel, its metadata says: helpers.drawing.figure_bundle), by the figure's key as MEASURE
    reads an image on screen: the length of its data: URL and the URL's end."""
    found = {}
    for cell in cells:
        for output in cell.get("outputs", []):
            if PNG in output.get("data", {}):
                url = "data:image/png;base64," + "".join(output["data"][PNG].split())
                found[len(url), url[-FIGURE_KEY:]] = output.get("metadata", {}).get(
                    PNG, {}).get(drawing.SMALLEST_TEXT)
    return found


# Resolves once the sub-slide on screen has stood still for two frames in a row (or after 1.5 s).
SETTLED = f"""() => new Promise((resolve) => {{
  const box = () => {{ const r = {PRESENT}.getBoundingClientRect();
                       return [r.left, r.top, r.width, r.height].map(Math.round).join(); }};
  setTimeout(resolve, 1500);  // (a page the browser does not draw gets no frames)
  let last = box(), still = 0, frames = 0;
  const next = () => requestAnimationFrame(() => {{
    const now = box();
    still = now === last ? still + 1 : 0;
    last = now;
    if (still >= 2 || ++frames > 90) resolve(); else next();
  }});
  next();
}})"""


def _settle(page):
    """Wait until the sub-slide on screen stops moving (with a transition, Reveal slides it in),
    so that what is measured is where it rests: two frames alike, in the page itself (the
    lessons' slides have no transition: a few hundredths of a second)."""
    page.evaluate(SETTLED)


def _bottom_reached(page, height):
    """Turn the mouse wheel over the sub-slide: is its end then on the screen?"""
    page.mouse.move(SCREEN["width"] / 2, SCREEN["height"] / 2)
    page.mouse.wheel(0, height)
    page.wait_for_timeout(500)
    return page.evaluate(
        f"() => {{ const s = {PRESENT}; return s.getBoundingClientRect().bottom"
        f" <= {SCREEN['height']} && s.scrollTop + s.clientHeight >= s.scrollHeight - 1; }}")


def _open_slides(page, lab, notebook):
    page.goto(f"{lab.base}/rise/{lab.path(notebook)}?token={lab.token}")
    page.locator(".reveal .slides > section").first.wait_for(timeout=60_000)
    page.wait_for_timeout(1500)


def _needs(cells, index):
    """The code cells before cell `index` that define, directly or through each other, the
    names it uses: what must run before it (by the names each cell assigns, imports or defines;
    a name a cell both sets and reads counts as its own)."""
    from IPython.core.inputtransformer2 import TransformerManager

    def names(source):
        used, defined = set(), set()
        for node in ast.walk(ast.parse(TransformerManager().transform_cell(source))):
            if isinstance(node, ast.Name):
                (defined if isinstance(node.ctx, ast.Store) else used).add(node.id)
            elif isinstance(node, ast.alias):
                defined.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
        return used - defined, defined  # a loop's or a comprehension's names are its own

    wanted, chosen = names("".join(cells[index]["source"]))[0], []
    for earlier in range(index - 1, -1, -1):
        if cells[earlier]["cell_type"] != "code":
            continue
        used, defined = names("".join(cells[earlier]["source"]))
        if defined & wanted:
            chosen.append(earlier)
            wanted = (wanted - defined) | used
    return sorted(chosen)


def _run_in_kernel(lab, lesson, sources):
    """Run `sources` in the kernel the slideshow started for `lesson`, as another client of it:
    the cells a widget needs, without stepping the slides through them."""
    from jupyter_client import BlockingKernelClient

    deadline = time.monotonic() + 60
    while True:
        kernels = [session["kernel"]["id"] for session in _api(lab, "GET", "sessions")
                   if session["path"] == lab.path(lesson)]
        if kernels or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert kernels, f"the slideshow started no kernel for {lesson}"
    client = BlockingKernelClient()
    client.load_connection_file(str(Path(lab.runtime_dir) / f"kernel-{kernels[0]}.json"))
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        for source in sources:
            reply = client.execute_interactive(source, timeout=120, output_hook=lambda _: None)
            content = reply["content"]
            assert content["status"] == "ok", (
                f"{source[:80]!r}: {content.get('ename')}: {content.get('evalue')}")
    finally:
        client.stop_channels()


def _picture_settles(page, cell, still_for=3, every_ms=300, tries=100):
    """Wait until the widget's picture has not changed for `still_for` looks in a row."""
    source, same = None, 0
    for _ in range(tries):
        now = cell.query_selector(".widget-output img").get_attribute("src")
        same = same + 1 if now == source else 0
        if same == still_for:
            return
        source = now
        page.wait_for_timeout(every_ms)
    raise AssertionError(f"the widget's picture kept changing for {tries * every_ms / 1000} s")


def _move_a_widget(page, lab, lesson, cells, plan):
    """Run the lesson's first widget live in the slides, drag its first slider: do its value and
    its picture change? Returns, for the record, the widget's sub-slide (its index in `plan`),
    that sub-slide's height, whether its bottom is on the screen or reached by the wheel, and the
    slider's value before and after."""
    widget = next(index for index, cell in enumerate(cells) if any(
        "application/vnd.jupyter.widget-view+json" in output.get("data", {})
        for output in cell.get("outputs", [])))
    _run_in_kernel(lab, lesson,
                   ["".join(cells[index]["source"]) for index in _needs(cells, widget)])
    places = [(h, v) for h, slide in enumerate(slides.slides(cells)) for v in range(len(slide))]
    place = next(index for index, sub_slide in enumerate(plan)
                 if any(cell is cells[widget] for cell in sub_slide))
    # the slideshow the test walked is still open, on its kernel: go to the widget's sub-slide
    page.evaluate(f"() => {{ window.location.hash = '#/slide-{places[place][0]}-"
                  f"{places[place][1]}'; }}")
    _settle(page)
    page.wait_for_timeout(500)
    codes = [cell for cell in plan[place] if cell["cell_type"] == "code"]
    position = next(k for k, code in enumerate(codes) if code is cells[widget])
    cell = page.evaluate_handle(f"() => {PRESENT}.querySelectorAll('.jp-CodeCell')[{position}]")
    assert "".join(cells[widget]["source"]).splitlines()[-1] in cell.inner_text()
    committed = cell.query_selector(".jp-OutputArea-output")
    cell.query_selector(".cm-content").click()
    page.keyboard.press("Control+Enter")
    # the committed output is gone (a run clears it first): what follows is the live widget, not
    # one the notebook's saved widget state may have drawn
    page.wait_for_function("output => !output.isConnected", arg=committed, timeout=60_000)
    handle = cell.wait_for_selector(".noUi-handle", timeout=60_000)
    before = cell.wait_for_selector(".widget-output img", timeout=60_000).get_attribute("src")
    step = cell.query_selector(".widget-readout").inner_text()
    _screenshot(page, f"{lesson[:2]}_slides_widget_before")
    box = handle.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + 60, y, steps=6)
    page.mouse.up()
    page.wait_for_function(
        "([cell, before]) => { const image = cell.querySelector('.widget-output img');"
        " return image && image.getAttribute('src') !== before; }", arg=[cell, before],
        timeout=60_000)
    # That is the first redraw the drag asked for, perhaps of a value it passed through. The
    # kernel takes messages in order: once it has run one more, every redraw is drawn, and the
    # last picture to arrive is the slider's final value's.
    _run_in_kernel(lab, lesson, ["pass"])
    _picture_settles(page, cell)
    moved = cell.query_selector(".widget-readout").inner_text()
    assert moved != step, (step, moved)  # the slider moved, and the picture with it
    _screenshot(page, f"{lesson[:2]}_slides_widget_after")
    height = page.evaluate(f"() => {PRESENT}.scrollHeight")
    scrolls = page.evaluate(f"() => {PRESENT}.scrollHeight > {PRESENT}.clientHeight + 1")
    return place, height, not scrolls or _bottom_reached(page, height), f"{step} -> {moved}"


@pytest.mark.slides
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.name[:2])
def test_the_lesson_as_slides(lab, lesson):
    """The lesson as RISE shows it (jupyterlab-rise's page, as Alt+R or `make present` opens it)
    on a 1280 x 720 screen, with notebooks/rise.css: the slides helpers.slides wrote; none taller
    than the screen (but those TALLER_THAN_THE_SCREEN lists, whose bottom the mouse wheel must
    bring into view); no output's text past the right edge; no text smaller than rise.css's
    sizes, no figure's text smaller than helpers.slides.FIGURE_TEXT_PX as it is displayed; and,
    where the lesson has an ipywidget, the first one run live in the slides, its slider moved,
    redraws."""
    from playwright.sync_api import sync_playwright

    cells = json.loads(lesson.read_text())["cells"]
    plan = [sub_slide for slide in slides.slides(cells) for sub_slide in slide]
    places = [(h, v) for h, slide in enumerate(slides.slides(cells)) for v in range(len(slide))]
    too_tall, scrolled, too_wide, broken, numbers, words, widget = [], [], [], [], [], [], None
    smallest = prose = (1000, "")
    texts, figure_text, unknown = _figure_texts(cells), (1000.0, None), []
    allowed = TALLER_THAN_THE_SCREEN.get(lesson.stem, {})
    excepted = set()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=SCREEN)
            _open_slides(page, lab, lesson.name)
            count = page.evaluate("() => [document.querySelectorAll('.reveal .slides > section')"
                                  ".length, document.querySelectorAll("
                                  "'.reveal .slides section section').length]")
            assert count == [len(slides.slides(cells)), len(plan)]
            for index, sub_slide in enumerate(plan):
                _settle(page)
                measured = page.evaluate(MEASURE)
                # the sub-slide the plan says (RISE names each #/slide-<slide>-<sub-slide>)
                expected = f"#/slide-{places[index][0]}-{places[index][1]}"
                assert measured["hash"] == expected or index == 0 and measured["hash"] in (
                    "", "#/"), (index, expected, measured["hash"])
                numbers.append(measured["number"])
                words.append(measured["words"])
                too_wide += [(index, *output) for output in measured["wide"]]
                broken += [(index, word) for word in measured["broken"]]
                smallest = min(smallest, tuple(measured["smallest"]))
                prose = min(prose, tuple(measured["prose"]))
                for length, end, shown, natural in measured["figures"]:
                    text = texts.get((length, end))
                    if text is None:
                        unknown.append(index)
                    else:  # its smallest text, in px as the slide scales the figure
                        figure_text = min(figure_text, (round(text * shown / natural, 1), index))
                height = measured["height"]
                first = "".join(sub_slide[0]["source"]).split("\n")[0]
                if measured["scrolls"]:
                    bottom = _bottom_reached(page, height)
                    scrolled.append((index, height, bottom))
                    if first in allowed and bottom:
                        excepted.add(first)
                    else:
                        too_tall.append((index, height, first[:60]))
                elif measured["bottom"] > SCREEN["height"] + 1:
                    too_tall.append((index, height, "ends below the screen"))
                page.keyboard.press("Space")
            if any("application/vnd.jupyter.widget-view+json" in output.get("data", {})
                   for cell in cells for output in cell.get("outputs", [])):
                widget = _move_a_widget(page, lab, lesson.name, cells, plan)
        finally:
            browser.close()
            print(f"{lesson.name}: {len(plan)} sub-slides at {SCREEN['width']} x "
                  f"{SCREEN['height']}; scrolling (index, px, bottom reached by the wheel): "
                  f"{scrolled}; words past the right edge (index, right, edge, start): "
                  f"{too_wide}; words cut by a wrap (index, word): {broken}; "
                  f"smallest text: {smallest[0]:g} px ({smallest[1]!r}), prose: "
                  f"{prose[0]:g} px ({prose[1]!r}); smallest text in a figure, as displayed: "
                  f"{figure_text[0]:g} px (sub-slide {figure_text[1]}); words of prose on "
                  f"screen: at most "
                  f"{max(words, default=0)}, over {slides.WORDS_ON_A_SUB_SLIDE} on "
                  f"{sum(count > slides.WORDS_ON_A_SUB_SLIDE for count in words)}; the first "
                  f"widget run live and moved (sub-slide, px, bottom reached, step before -> "
                  f"after): {widget}")
    assert too_tall == []
    assert set(allowed) == excepted, f"listed as too tall, but they fit: {set(allowed) - excepted}"
    assert unknown == [], f"figures whose text size no output's metadata says, on {unknown}"
    assert figure_text[0] >= slides.FIGURE_TEXT_PX, figure_text
    assert too_wide == []
    assert broken == []
    # each sub-slide shows its number of the lesson's, at the code's size or larger
    assert [number[0] if number else None for number in numbers] == [
        f"{index + 1} / {len(plan)}" for index in range(len(plan))], numbers
    assert min(number[1] for number in numbers) >= CODE_PX, numbers
    assert smallest[0] >= CODE_PX, smallest
    assert prose[0] >= PROSE_PX, prose
    assert widget is None or widget[2], widget
    assert max(words) <= slides.WORDS_ON_A_SUB_SLIDE, [  # the rest is in speaker notes
        (index + 1, count) for index, count in enumerate(words)
        if count > slides.WORDS_ON_A_SUB_SLIDE]


@pytest.mark.slides
def test_a_hung_cell_in_the_slides_stops_at_esc_i_i(lab):
    """docs/presenting.md's advice, in the slideshow: a launch whose ranks never return is
    interrupted by Esc, I, I (the shortcut helpers.present adds), long before the launcher's
    timeout; while it waits, its heartbeat says for which ranks; interrupted, it says where each
    rank was; the next launch then runs."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    source = ("import time\n\nfrom helpers.launcher import run\n\n\n"
              "def stuck(rank, world_size):\n    time.sleep(600)\n\n\n"
              "def rank_of(rank, world_size):\n    return rank\n\n\nrun(stuck, 2)")
    cells = [{"cell_type": "markdown", "source": "# A hang", "metadata": {}},
             {"cell_type": "code", "source": source, "metadata": {}, "outputs": [],
              "execution_count": None},
             {"cell_type": "code", "source": "print('next:', [run(rank_of, 2)[r] for r in (0, 1)])",
              "metadata": {}, "outputs": [], "execution_count": None}]
    for cell in slides.assign(cells):
        cell["id"] = secrets.token_hex(4)
    (lab.folder / "hang.ipynb").write_text(json.dumps({
        "cells": cells, "nbformat": 4, "nbformat_minor": 5, "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)",
                           "language": "python"}, "rise": slides.RISE}}))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=SCREEN)
            _open_slides(page, lab, "hang.ipynb")
            page.keyboard.press("Space")
            page.wait_for_timeout(1000)
            code = page.evaluate_handle(f"() => {PRESENT}.querySelectorAll('.jp-CodeCell')")
            hung, after = code.evaluate_handle("cells => cells[0]"), code.evaluate_handle(
                "cells => cells[1]")
            hung.query_selector(".cm-content").click()
            page.keyboard.press("Control+Enter")
            # the workers have started and wait: the launch is under way, its prompt says [*]
            page.wait_for_timeout(8000)
            assert "[*]" in hung.query_selector(".jp-InputPrompt").inner_text()
            # and its heartbeat says so, and, once the pool has started, for what it waits
            # (helpers.notebook.Heartbeat)
            try:
                page.wait_for_function("cell => cell.innerText.includes('still running: ') && "
                                       "cell.innerText.includes('ranks 0 and 1 of 2 have not "
                                       "returned; the timeout stops them in')", arg=hung,
                                       timeout=45_000)  # within run()'s 60 s
            except PlaywrightTimeout:
                pytest.fail(f"no heartbeat that names the ranks: {hung.inner_text()!r}")
            started = time.monotonic()
            page.keyboard.press("Escape")
            page.keyboard.press("i")
            page.keyboard.press("i")
            page.wait_for_function("cell => /\\[[0-9]+\\]/.test(cell.querySelector("
                                   "'.jp-InputPrompt').textContent)", arg=hung, timeout=20_000)
            stopped = time.monotonic() - started
            said = hung.inner_text()  # where each rank was, and the heartbeat gone
            assert "WorkerInterrupted: run() was interrupted after" in said, said
            assert all(f"rank {rank}: in stuck at" in said for rank in (0, 1)), said
            assert "time.sleep(600)" in said and "still running" not in said, said
            after.query_selector(".cm-content").click()
            page.keyboard.press("Control+Enter")
            try:
                page.wait_for_function("cell => cell.innerText.includes('next: [0, 1]')",
                                       arg=after, timeout=60_000)
            except PlaywrightTimeout:
                pytest.fail(f"the next launch did not print within 60 s; its cell shows "
                            f"{after.inner_text()!r}, the hung one {hung.inner_text()!r}")
            print(f"Esc, I, I stopped a hung launch in {stopped:.1f} s (the launcher's own "
                  "timeout: 60 s); the next launch ran")
        finally:
            browser.close()


@pytest.mark.slides
def test_the_speaker_view_shows_the_notes_of_the_sub_slide_on_screen(lab):
    """docs/presenting.md's speaker view: in the slideshow `make present` opens, `T` opens
    reveal.js's speaker window, which shows the notes cells of the sub-slide on screen, and
    follows the slides as they move. The audience's screen shows no notes."""
    from playwright.sync_api import sync_playwright

    def markdown(source, kind=None):
        return {"cell_type": "markdown", "source": source, "id": secrets.token_hex(4),
                "metadata": {"slideshow": {"slide_type": kind}} if kind else {}}

    cells = slides.assign([markdown("# Speaker notes"), markdown("The first point."),
                           markdown("Say why the first point matters.", "notes"),
                           markdown("### The second"), markdown("The second point."),
                           markdown("Say where the second leads.", "notes")])
    (lab.folder / "notes.ipynb").write_text(json.dumps({
        "cells": cells, "nbformat": 4, "nbformat_minor": 5, "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)",
                           "language": "python"}, "rise": slides.RISE}}))
    notes = ".speaker-controls-notes"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=SCREEN)
            _open_slides(page, lab, "notes.ipynb")
            on_screen = page.evaluate(f"() => {PRESENT}.innerText")
            assert "The first point." in on_screen and "Say why" not in on_screen, on_screen
            # (RISE takes `T` in command mode, on a cell of the slides)
            page.evaluate_handle(f"() => {PRESENT}.querySelector('.jp-Cell')").click()
            page.keyboard.press("Escape")
            with page.expect_popup(timeout=30_000) as opened:
                page.keyboard.press("t")
            speaker = opened.value
            speaker.wait_for_function(
                f"() => document.querySelector('{notes}')?.innerText.includes("
                "'Say why the first point matters.')", timeout=30_000)
            _screenshot(speaker, "speaker_view")
            page.bring_to_front()
            page.keyboard.press("Space")
            speaker.wait_for_function(
                f"() => document.querySelector('{notes}')?.innerText.includes("
                "'Say where the second leads.')", timeout=30_000)
            shown = speaker.evaluate(f"() => document.querySelector('{notes}').innerText")
            assert "Say why" not in shown, shown
            print(f"speaker view: opened by T, followed the slides; notes shown: {shown!r}")
        finally:
            browser.close()
