"""Install requirements into the environment of the Python that runs this, with uv where it can
stand in for pip, else with pip:

    .venv/bin/python tools/install.py -r requirements.txt -e .

uv installs what the requirements pin, from the same indexes as pip (here the same versions as
pip's, compared), in parallel, and compiles their bytecode on every core: `make setup` in a fresh
clone took 61 s with pip and 25 s with uv on a 2-core machine (2026-11-30, no cache for either).
It does not read pip's configuration, so the settings pip would use (`pip config list`: its files
and PIP_ variables) are passed to it as flags, and uv's own (uv.toml, UV_ variables) are left
out. A setting this script cannot pass on, a uv that cannot be installed, or a uv that fails, and
pip installs instead, as it did before: the same pins, only slower. Standard library only: it
runs before anything is installed.
"""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys

UV = "uv==0.13.9"
QUIET = ["--quiet", "--disable-pip-version-check"]
# pip's settings and the uv flag each becomes (every value of a list, one flag each).
AS_FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
            "find-links": "--find-links", "constraint": "--constraint",
            "trusted-host": "--allow-insecure-host"}
# Settings that change nothing uv does here (output, pip's own version check), or that go to it
# otherwise (below).
NOTHING_TO_PASS = {"disable-pip-version-check", "quiet", "progress-bar", "no-color",
                   "root-user-action", "cert", "timeout", "default-timeout", "no-index"}
TRUE = {"1", "y", "yes", "t", "true", "on"}  # as pip reads a flag's value (strtobool)


def pip(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *arguments], capture_output=True,
                          text=True)


def pip_settings() -> dict:
    """pip's effective settings for `pip install`, name -> value: `pip config list` prints each
    as `section.name='value'`, the PIP_ variables in section ":env:". As in pip, the section
    "install" overrides "global", and a variable both."""
    listed = pip("config", "list")
    if listed.returncode != 0:
        raise RuntimeError(f"pip config list failed: {listed.stderr.strip()}")
    by_section = {"global": {}, "install": {}, ":env:": {}}
    for line in listed.stdout.splitlines():
        match = re.fullmatch(r"(.*?)\.([\w-]+)=(.*)", line.strip())
        if match is None:
            raise RuntimeError(f"pip config list printed {line!r}")
        section, name, value = match.groups()
        value = ast.literal_eval(value)
        if section not in by_section or not value:  # pip ignores an empty value too
            continue
        if name in by_section[section]:  # newer pips list each file: which wins is pip's to say
            raise RuntimeError(f"pip's files set {section}.{name} more than once")
        by_section[section][name] = value
    return {**by_section["global"], **by_section["install"], **by_section[":env:"]}


def uv_command(settings: dict) -> tuple[list, dict]:
    """The flags and environment that make uv do what pip would with `settings`."""
    unknown = sorted(set(settings) - set(AS_FLAGS) - NOTHING_TO_PASS)
    if unknown:
        raise RuntimeError(f"pip is set up with {', '.join(unknown)}, which this script does "
                           "not pass on to uv")
    # pip takes the best version from all its indexes; uv, by default, only the first index's.
    # uv's own configuration (uv.toml, [tool.uv], UV_ variables) is not pip's: left out.
    flags = ["--index-strategy", "unsafe-best-match", "--compile-bytecode", "--no-config"]
    for name, flag in AS_FLAGS.items():
        for value in settings.get(name, "").split():
            flags += [flag, value]
    if settings.get("no-index", "").lower() in TRUE:
        flags.append("--no-index")
    # pip's certificate bundle, or else the system's store, which pip (truststore) also trusts
    flags += ["--cert", settings["cert"]] if "cert" in settings else ["--system-certs"]
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith("UV_") or name.startswith(("UV_CACHE", "UV_NO_CACHE"))}
    timeout = settings.get("timeout", settings.get("default-timeout"))
    if timeout is not None:  # pip's seconds may have a fraction; uv's are whole
        environment["UV_HTTP_TIMEOUT"] = str(math.ceil(float(timeout)))
    return flags, environment


def with_uv(arguments: list) -> str | None:
    """Install with uv; None where it did, else why not."""
    try:
        flags, environment = uv_command(pip_settings())
    except (RuntimeError, ValueError, SyntaxError) as reason:
        return str(reason)
    installed = pip("install", *QUIET, UV)
    if installed.returncode != 0:
        return f"uv could not be installed: {installed.stderr.strip()[-500:]}"
    done = subprocess.run([sys.executable, "-m", "uv", "pip", "install", "--quiet", "--python",
                           sys.executable, *flags, *arguments], env=environment)
    return None if done.returncode == 0 else f"uv exited with {done.returncode}"


def main(arguments: list) -> int:
    reason = with_uv(arguments)
    if reason is None:
        return 0
    print(f"install.py: {reason}; pip installs instead", file=sys.stderr)
    return subprocess.run([sys.executable, "-m", "pip", "install", *QUIET, *arguments]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
