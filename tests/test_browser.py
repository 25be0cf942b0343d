"""The lessons in a real JupyterLab, driven by headless Chromium: what a person would see.

Needs Debian's chromium (`apt-get install chromium`; .ci/run installs it) and the playwright
package (pinned in requirements.txt), driven through `executable_path`: Playwright's own browser
download does not work here. Without Chromium this test is skipped, and says why.
Screenshots: test-artifacts/browser/ (the path is printed).
"""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import slides

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOTS = REPO / "test-artifacts" / "browser"
# Chromium as root in a sandbox, with no background traffic (the network is closed here).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium); "
    "the real-browser test needs it")


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on loopback with a token, serving copies of the lessons, with its own settings.
    One per test: a server shared by the tests restores the last test's tabs into the next page,
    whose locators then find the other lesson's cells."""
    for name in ("01_processes_and_groups.ipynb", "05_how_all_reduce_works.ipynb",
                 "06_data_parallelism.ipynb"):
        shutil.copy(REPO / "notebooks" / name, tmp_path / name)
    port, token = _free_port(), secrets.token_hex(16)
    private = {name: str(tmp_path / f".{name.lower()}") for name in (
        "JUPYTER_RUNTIME_DIR", "JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR")}
    log = open(tmp_path / "jupyterlab.log", "w")  # noqa: SIM115 - closed in the finally below
    # No "Jupyter news?" toast over the page: the user setting, in this server's settings dir.
    notification = Path(private["JUPYTERLAB_SETTINGS_DIR"]) / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false", "checkForUpdates": false}')
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={tmp_path}", "--LabApp.news_url=None", "--allow-root"],
        cwd=tmp_path, env={**os.environ, **private},
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    tail = (tmp_path / "jupyterlab.log").read_text()[-2000:]
                    raise RuntimeError(f"JupyterLab did not start within 60 s:\n{tail}") from None
                time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture
def page(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1000}), lab
        finally:
            browser.close()


def _run_all_cells(page, base, token, notebook, last_output):
    page.goto(f"{base}/lab/tree/{notebook}?token={token}")
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


def test_lesson_01_shows_grouped_output_a_figure_and_the_checker(page):
    page, (base, token) = page
    _run_all_cells(page, base, token, "01_processes_and_groups.ipynb", "[NOT YET] column_sum")
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


def test_lesson_05_stepper_slider_redraws_the_ring(page):
    page, (base, token) = page
    _run_all_cells(page, base, token, "05_how_all_reduce_works.ipynb",
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


SLIDES_LESSON = "06_data_parallelism.ipynb"
SCREEN = {"width": 1280, "height": 720}
# The sub-slide on screen (RISE nests a slide's sub-slides: the innermost present one)
PRESENT = ("(() => { const present = document.querySelectorAll('.reveal .slides section.present');"
           " return present[present.length - 1]; })()")


def _settle(page, tries=15):
    """Wait until the sub-slide on screen stops moving (Reveal's transition between slides
    slides it in from the side), so that what is measured is where it rests."""
    where = None
    for _ in range(tries):
        page.wait_for_timeout(100)
        now = page.evaluate(f"() => {{ const r = {PRESENT}.getBoundingClientRect();"
                            " return [r.left, r.top, r.width, r.height].map(Math.round); }")
        if now == where:
            return
        where = now


def test_lesson_06_as_slides_fits_the_screen_and_runs_a_cell(lab):
    """The lesson as RISE shows it (jupyterlab-rise's page, as Alt+R opens it) on a 1280 x 720
    screen: the slides helpers.slides wrote, each no taller than the screen but a code cell
    alone, whose bottom the mouse wheel brings into view; and a code cell run inside them."""
    from playwright.sync_api import sync_playwright

    base, token = lab
    cells = json.loads((REPO / "notebooks" / SLIDES_LESSON).read_text())["cells"]
    planned = [sub_slide for slide in slides.slides(cells) for sub_slide in slide]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=SCREEN)
            page.goto(f"{base}/rise/{SLIDES_LESSON}?token={token}")
            page.locator(".reveal .slides > section").first.wait_for(timeout=60_000)
            count = page.evaluate("() => [document.querySelectorAll('.reveal .slides > section')"
                                  ".length, document.querySelectorAll("
                                  "'.reveal .slides section section').length]")
            assert count == [len(slides.slides(cells)), len(planned)]
            too_tall, scrolled, too_wide = [], [], []
            firsts, count = set(), 0  # a new slide slides in from the side: wait till it rests
            for slide in slides.slides(cells):
                firsts.add(count)
                count += len(slide)
            for index, sub_slide in enumerate(planned):
                if index in firsts:
                    _settle(page)
                else:  # a sub-slide moves up, not across
                    page.wait_for_timeout(300)
                height = page.evaluate(f"() => {PRESENT}.scrollHeight")
                # no output's text runs past the right edge of its box or of the screen
                wide = page.evaluate(
                    f"() => Array.from({PRESENT}.querySelectorAll('.jp-OutputArea-output'))"
                    ".map(o => { const walker = document.createTreeWalker(o, NodeFilter.SHOW_TEXT);"
                    " let right = 0; for (let n = walker.nextNode(); n; n = walker.nextNode()) {"
                    " const range = document.createRange(); range.selectNodeContents(n);"
                    " for (const r of range.getClientRects()) right = Math.max(right, r.right); }"
                    f" return [Math.round(right), Math.round(Math.min(o.getBoundingClientRect()"
                    f".right, {SCREEN['width']})), o.innerText.slice(0, 40)]; }})"
                    ".filter(([text, edge]) => text > edge + 1)")
                too_wide += [(index, *output) for output in wide]
                alone = len(sub_slide) == 1 and sub_slide[0]["cell_type"] == "code"
                if height > SCREEN["height"]:
                    # the wheel must bring its bottom into view (the notebook's RISE settings)
                    page.mouse.move(SCREEN["width"] / 2, SCREEN["height"] / 2)
                    page.mouse.wheel(0, height)
                    page.wait_for_timeout(500)
                    # its box inside the screen, and scrolled to its end
                    bottom = page.evaluate(
                        f"() => {{ const s = {PRESENT}; return s.getBoundingClientRect().bottom"
                        f" <= {SCREEN['height']} && s.scrollTop + s.clientHeight >= "
                        "s.scrollHeight - 1; }")
                    scrolled.append((index, height, bottom))
                    if not (alone and bottom):
                        too_tall.append((index, height, "".join(sub_slide[0]["source"])[:60]))
                page.keyboard.press("Space")
            print(f"{len(planned)} sub-slides at {SCREEN['width']} x {SCREEN['height']}; taller "
                  f"than the screen (index, px, bottom reached by the wheel): {scrolled}; "
                  f"outputs whose text passes their box's or the screen's right edge (text, edge, "
                  f"start): {too_wide}")
            assert too_tall == []
            assert too_wide == []

            page.goto(f"{base}/rise/{SLIDES_LESSON}?token={token}")  # back to the start
            page.locator(".reveal .slides > section").first.wait_for(timeout=60_000)
            page.wait_for_timeout(2000)
            page.keyboard.press("Space")  # the imports, a code cell
            cell = page.locator(".reveal section.present .jp-CodeCell").last.element_handle()
            prompt = cell.query_selector(".jp-InputPrompt")
            assert "from helpers.data_parallelism import" in cell.inner_text()
            # Run it twice in the slides (Ctrl+Enter stays on the cell): a fresh kernel counts
            # 1 and then 2, where the committed notebook says 1
            for _ in range(2):
                cell.query_selector(".cm-content").click()
                page.keyboard.press("Control+Enter")
                page.wait_for_function("prompt => /\\[[0-9]+\\]/.test(prompt.textContent)",
                                       arg=prompt, timeout=120_000)
            page.wait_for_function("prompt => prompt.textContent.includes('[2]')", arg=prompt,
                                   timeout=120_000)
            _screenshot(page, "06_slide_cell_run")
        finally:
            browser.close()

