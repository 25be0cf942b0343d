"""tools/install.py: pip's settings reach uv as the flags that make it do what pip would, and any
setting it cannot pass on, or a failing uv, leaves the install to pip."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

PATH = pathlib.Path(__file__).resolve().parent.parent / "tools" / "install.py"
spec = importlib.util.spec_from_file_location("install", PATH)
install = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install)


def listed(monkeypatch, text, returncode=0):
    """`pip config list` prints `text`."""
    def pip(*arguments):
        assert arguments == ("config", "list")
        return subprocess.CompletedProcess(arguments, returncode, text, "no pip")
    monkeypatch.setattr(install, "pip", pip)


def test_a_variable_overrides_the_install_section_which_overrides_global(monkeypatch):
    listed(monkeypatch, ":env:.find-links='/from/the/variable'\n"
                        "global.find-links='/from/the/file'\n"
                        "global.index-url='https://global.example/simple'\n"
                        "install.index-url='https://install.example/simple'\n"
                        ":env:.index-url=''\n"  # set empty: pip ignores it
                        "download.index-url='https://not.for.install/simple'\n")
    assert install.pip_settings() == {"find-links": "/from/the/variable",
                                      "index-url": "https://install.example/simple"}


def test_a_setting_listed_by_two_files_is_not_guessed(monkeypatch):
    """pip 25.2 and later list each file: which wins is pip's order of files, not the list's."""
    listed(monkeypatch, "global.index-url='https://site.example/simple'\n"
                        "global.index-url='https://user.example/simple'\n")
    with pytest.raises(RuntimeError, match="pip's files set global.index-url more than once"):
        install.pip_settings()


def test_each_setting_becomes_its_uv_flag_and_uvs_own_settings_are_left_out(monkeypatch):
    monkeypatch.setenv("UV_INDEX", "https://uv.only.example/simple")
    monkeypatch.setenv("UV_CACHE_DIR", "/cache")
    flags, environment = install.uv_command({
        "index-url": "https://mirror.example/simple",
        "extra-index-url": "file:///opt/a/simple file:///opt/b/simple",
        "find-links": "/opt/wheels", "constraint": "/etc/constraints.txt",
        "trusted-host": "mirror.example", "no-index": "t", "cert": "/etc/bundle.crt",
        "default-timeout": "17.5", "disable-pip-version-check": "1"})
    assert flags == ["--index-strategy", "unsafe-best-match", "--compile-bytecode", "--no-config",
                     "--index-url", "https://mirror.example/simple",
                     "--extra-index-url", "file:///opt/a/simple",
                     "--extra-index-url", "file:///opt/b/simple",
                     "--find-links", "/opt/wheels", "--constraint", "/etc/constraints.txt",
                     "--allow-insecure-host", "mirror.example", "--no-index",
                     "--cert", "/etc/bundle.crt"]
    assert environment["UV_HTTP_TIMEOUT"] == "18"  # whole seconds, none less than pip's
    assert "UV_INDEX" not in environment and environment["UV_CACHE_DIR"] == "/cache"


def test_without_settings_uv_takes_pips_index_strategy_and_the_systems_certificates():
    assert install.uv_command({})[0] == ["--index-strategy", "unsafe-best-match",
                                         "--compile-bytecode", "--no-config", "--system-certs"]


@pytest.mark.parametrize("config, reason", [
    ("global.prefer-binary='1'\n", "pip is set up with prefer-binary, which this script does "
                                   "not pass on to uv"),
    ("", "pip config list failed: no pip"),
])
def test_a_setting_it_cannot_pass_on_leaves_the_install_to_pip(monkeypatch, config, reason):
    listed(monkeypatch, config, returncode=0 if config else 1)
    commands = []
    monkeypatch.setattr(install.subprocess, "run", lambda command, **_: commands.append(command)
                        or subprocess.CompletedProcess(command, 0))
    assert install.with_uv(["-r", "requirements.txt"]) == reason
    assert commands == []  # neither uv installed nor run
    assert install.main(["-r", "requirements.txt"]) == 0
    assert commands == [[sys.executable, "-m", "pip", "install", "--quiet",
                         "--disable-pip-version-check", "-r", "requirements.txt"]]


def test_a_failing_uv_leaves_the_install_to_pip(monkeypatch, capsys):
    commands = []

    def pip(*arguments):  # pip config list, then pip install uv
        commands.append(arguments)
        said = "global.find-links='/opt/wheels'\n" if arguments[0] == "config" else ""
        return subprocess.CompletedProcess(arguments, 0, said, "")

    def run(command, **_):
        commands.append(command)
        return subprocess.CompletedProcess(command, 2 if command[2] == "uv" else 0)
    monkeypatch.setattr(install, "pip", pip)
    monkeypatch.setattr(install.subprocess, "run", run)
    assert install.main(["-e", "."]) == 0
    config, install_uv, uv, pip = commands
    assert config == ("config", "list")
    assert install_uv == ("install", "--quiet", "--disable-pip-version-check", "uv==0.13.9")
    assert uv == [sys.executable, "-m", "uv", "pip", "install", "--quiet", "--python",
                  sys.executable, "--index-strategy", "unsafe-best-match", "--compile-bytecode",
                  "--no-config", "--find-links", "/opt/wheels", "--system-certs", "-e", "."]
    assert pip == [sys.executable, "-m", "pip", "install", "--quiet",
                   "--disable-pip-version-check", "-e", "."]
    assert "uv exited with 2; pip installs instead" in capsys.readouterr().err
