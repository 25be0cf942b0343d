"""Debian's Chromium for the real-browser tests (test_browser.py, test_book.py), driven by the
playwright package (pinned in requirements.txt) through `executable_path`: Playwright's own
browser download does not work here.

.ci/run sets REQUIRE_BROWSER=1: there a missing Chromium fails every test that needs it as it
starts the browser (`chromium()`; a tier that skips all it has would pass having checked nothing);
elsewhere they are skipped, saying why (`needs_chromium`). Not at import: make ci installs
Chromium beside the soak tier, after make test has collected these files."""

import os
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Chromium as root in a sandbox, with no background traffic (the network is closed here).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

REQUIRED = os.environ.get("REQUIRE_BROWSER") == "1"
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and not REQUIRED, reason="Chromium is not installed (apt-get install "
    "chromium); the real-browser test needs it")


def chromium() -> str:
    """Chromium's path; where there is none (REQUIRE_BROWSER=1: a test that needs it ran), the
    error that fails the test."""
    if CHROMIUM is None:
        raise RuntimeError("REQUIRE_BROWSER=1 but Chromium is not installed (apt-get install "
                           "chromium): the real-browser tests cannot run")
    return CHROMIUM
