"""Present a lesson as slides, from a copy: `make present LESSON=06`.

The slideshow saves the outputs of the cells run in it into the notebook it shows. So it shows a
copy, made afresh from the committed lesson each time in `presenting/` (which git ignores), with
`notebooks/rise.css` beside it, and the course is left as it was. The copy opens in
jupyterlab-rise's own page, `/rise/<notebook>`: the slides alone, at the browser's full width.

    python -m helpers.present 06 [--port 8890] [--directory presenting] [--no-browser]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import webbrowser
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
# JupyterLab settings for the slideshow (JUPYTERLAB_SETTINGS_DIR): jupyterlab-rise's page has no
# shortcut to interrupt the kernel, so it gets JupyterLab's own (I, I in command mode); and no
# "Jupyter news?" notice over the slides.
SETTINGS = {
    "@jupyterlab/shortcuts-extension/shortcuts.jupyterlab-settings": {"shortcuts": [
        {"command": "notebook:interrupt-kernel", "keys": ["I", "I"],
         "selector": ".jp-Notebook.jp-mod-commandMode :focus"}]},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}


def write_settings(directory: Path) -> Path:
    """SETTINGS, as files in `directory` (to be the server's JUPYTERLAB_SETTINGS_DIR)."""
    for name, value in SETTINGS.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(json.dumps(value, indent=1))
    return directory


def lesson_path(lesson: str) -> Path:
    """The committed notebook of lesson `lesson` ("06", "6" or its file name)."""
    names = sorted(path.name for path in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    number = lesson.split("_")[0].removesuffix(".ipynb")
    found = [name for name in names if number.isdigit() and name[:2] == f"{int(number):02d}"]
    if len(found) != 1:
        raise SystemExit(f"no lesson {lesson!r}; the lessons are: "
                         + ", ".join(name[:2] for name in names))
    return NOTEBOOKS / found[0]


def copy(lesson: str, into: Path) -> Path:
    """A fresh copy of the lesson and the slides' style sheet in `into`; the copy's path."""
    source = lesson_path(lesson)
    into.mkdir(parents=True, exist_ok=True)
    shutil.copy(NOTEBOOKS / "rise.css", into / "rise.css")
    shutil.copy(source, into / source.name)
    return into / source.name


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lesson", help='the lesson\'s number, "06"')
    parser.add_argument("--port", type=int, default=0, help="the server's (default: a free one)")
    parser.add_argument("--directory", type=Path, default=REPO / "presenting",
                        help="where the copy goes (default: presenting/)")
    parser.add_argument("--no-browser", action="store_true", help="print the address only")
    options = parser.parse_args(argv)
    # Ctrl+C stops presenting, and the server, even where this was started with SIGINT ignored
    # (a script's background job: a Python started so leaves it ignored, and so would the server)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    notebook = copy(options.lesson, options.directory)
    port, token = options.port or free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}/rise/{notebook.name}?token={token}"
    print(f"Presenting a copy: {notebook} (the lesson itself is untouched).\n"
          f"Slides: {url}\n"
          "Full screen: F11 (macOS: Ctrl+Cmd+F). Next: Space; back: Shift+Space.\n"
          "Run a cell: click into it, then Shift+Enter. Stop a running cell: Esc, then I twice.\n"
          "Stop presenting: Ctrl+C here.", flush=True)
    command = [sys.executable, "-m", "jupyterlab_rise", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={notebook.parent}",
               "--ServerApp.answer_yes=True"]  # Ctrl+C stops it and its kernels, no question
    if os.name == "posix" and os.geteuid() == 0:  # containers, cloud VMs
        command.append("--allow-root")
    settings = write_settings(notebook.parent / ".settings")
    server = subprocess.Popen(command, cwd=notebook.parent,
                              env={**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings)})
    try:
        if wait_until_up(port, token, server):
            if not options.no_browser:
                webbrowser.open(url)
        elif server.poll() is None:
            print("The slides' server has not answered within 60 s.", flush=True)
        code = server.wait()
    except KeyboardInterrupt:  # the terminal's Ctrl+C reaches the server too, which stops
        code = _wait_through_interrupts(server)
    if code:
        print(f"The slides' server stopped with exit code {code} (its messages are above).",
              file=sys.stderr, flush=True)
    return code


def _wait_through_interrupts(server: subprocess.Popen, grace: float = 10) -> int:
    """The server's exit code, once Ctrl+C has stopped it. A Jupyter server interrupted while it
    is still busy starting (a loaded machine) can take the KeyboardInterrupt inside a callback,
    log it, and go on serving: after `grace` seconds it is sent SIGTERM, which it handles by
    stopping cleanly, and `grace` seconds later SIGKILL. (Another Ctrl+C meanwhile starts that
    wait again.)"""
    for send in (None, server.terminate, server.kill):
        if send is not None:
            print(f"The slides' server is still running {grace:.0f} s after Ctrl+C: "
                  f"{'stopping it (SIGTERM)' if send == server.terminate else 'killing it'}.",
                  flush=True)
            send()
        while True:
            try:
                return server.wait(timeout=grace)
            except KeyboardInterrupt:
                continue
            except subprocess.TimeoutExpired:
                break
    return server.wait()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_up(port: int, token: str, server: subprocess.Popen, tries: int = 120) -> bool:
    """Has the Jupyter server on `port` answered within `tries` half-seconds, while `server` (its
    process, or the one that started it) has not exited?"""
    for _ in range(tries):
        if server.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}",
                                        timeout=2):
                return True
        except OSError:
            time.sleep(0.5)
    return False


if __name__ == "__main__":
    sys.exit(main())
