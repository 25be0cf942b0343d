"""The student release (helpers/release.py, `make release`): a copy of the course with no reference
solution in it, anywhere, in which no test disappears without a word, and the checkers still
judge. The release is built once, from this checkout's tracked files, into a temporary folder."""

import ast
import os
import pathlib
import subprocess
import sys

import nbformat
import pytest

from helpers import release
from helpers.exercises import exercises, solutions_withheld

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(solutions_withheld(), reason="a student release has no "
                                "solutions to look for, nor the git checkout it is made from")
SHORTEST = 16  # characters: a line shorter than this ("return total") gives nothing away


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    destination = tmp_path_factory.mktemp("release") / "course"
    withheld = release.build(destination)
    return destination, withheld


def _tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return out.split()


def _text(path: pathlib.Path) -> str:
    """A file as a reader sees it: a notebook by its cells' sources and text outputs (not JSON,
    whose escapes would hide a line), anything else as it is."""
    if path.suffix != ".ipynb":
        return path.read_text(errors="replace")
    notebook = nbformat.read(path, as_version=4)
    parts = []
    for cell in notebook.cells:
        parts.append(cell.source)
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts += [str(value) for value in output.get("data", {}).values()]
    return "\n".join(parts)


def _solution_lines() -> dict:
    """Each reference solution's lines that no other file of this checkout holds, tests included
    (the lesson code a solution calls is shared with it, and a typical mistake in a test is a
    solution with one thing changed; its own logic is its own): name -> lines."""
    elsewhere = "\n".join(_text(ROOT / path) for path in _tracked()
                          if not path.endswith("solutions.py"))
    lines = {}
    for path in sorted(ROOT.glob("helpers/*/solutions.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                body = ast.get_source_segment(source, node).splitlines()[1:]
                lines[f"{path.parent.name}.{node.name}"] = {
                    line.strip() for line in body if len(line.strip()) >= SHORTEST
                    and not line.strip().startswith(("#", '"', "'")) and
                    line.strip() not in elsewhere}
    return lines


def _normalized(text: str) -> str:
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


def _solution_bodies() -> dict:
    """Each reference solution's body, its lines stripped: name -> text."""
    bodies = {}
    for path in sorted(ROOT.glob("helpers/*/solutions.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                body = ast.get_source_segment(source, node).split("\n", 1)[1]
                bodies[f"{path.parent.name}.{node.name}"] = _normalized(body)
    return bodies


def test_the_search_has_every_solution_to_look_for():
    """The search below cannot pass for want of something to find: every exercise's reference
    solution has a body, and all together have more lines of their own than there are
    exercises (a few short ones have none: their lines are the lesson's)."""
    bodies, lines = _solution_bodies(), _solution_lines()
    for name, exercise in exercises().items():
        assert bodies[f"{exercise.lesson.rpartition('.')[2]}.{name}"]
    assert sum(map(len, lines.values())) > 2 * len(exercises())


def test_the_release_holds_no_solution_and_no_line_of_one(built):
    destination, _ = built
    assert not list(destination.glob("helpers/*/solutions.py"))
    assert not (destination / ".ci").exists()
    shipped = {path: _text(path) for path in destination.rglob("*") if path.is_file()}
    found = [(name, line, path.relative_to(destination))
             for name, lines in _solution_lines().items() for line in lines
             for path, text in shipped.items() if line in text]
    assert not found, found[:5]
    everything = _normalized("\n".join(shipped.values()))
    assert not [name for name, body in _solution_bodies().items() if body in everything]
    notebooks = [text for path, text in shipped.items() if path.suffix == ".ipynb"]
    assert len(notebooks) == len(list(ROOT.glob("notebooks/*.ipynb")))
    assert not any("solutions.py" in text for text in notebooks)
    assert "solutions.py" not in (destination / "README.md").read_text()


def _tests_by_file(folder, paths):
    found = {}
    for path in (pathlib.Path(folder) / path for path in paths):
        tree = ast.parse(path.read_text())
        found[path.name] = {node.name: node for node in tree.body
                            if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}
    return found


def test_no_test_disappears_each_withheld_one_is_skipped_by_name(built):
    destination, withheld = built
    tests = [path for path in _tracked() if path.startswith("tests/test_")]
    here, there = _tests_by_file(ROOT, tests), _tests_by_file(destination, tests)
    assert {file: set(tests) for file, tests in here.items()} == {
        file: set(tests) for file, tests in there.items()}
    skipped = {f"tests/{file}::{name}" for file, tests in there.items()
               for name, node in tests.items()
               if any("skip" in ast.unparse(decorator) and "_WITHHELD" in ast.unparse(decorator)
                      for decorator in node.decorator_list)}
    assert skipped == set(withheld)
    # the reference solutions' own test, and every lesson's rejections of typical mistakes
    assert "tests/test_exercises.py::test_checker_passes_the_reference_solution" in skipped
    assert "tests/test_collectives.py::test_checker_rejects_a_typical_mistake" in skipped
    assert "tests/test_launcher.py::test_timeout_in_plain_python_code_reports_the_line" not in \
        skipped


def test_the_releases_tests_pass_the_linter_and_collect(built):
    destination, withheld = built
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "."],
                          cwd=destination, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    collect = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/test_collectives.py", "tests/test_exercises.py", "tests/test_at_scale.py"],
        cwd=destination, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(destination)})
    assert collect.returncode == 0, collect.stdout[-3000:]
    assert "tests/test_exercises.py::test_checker_passes_the_reference_solution" in collect.stdout


def test_in_the_release_the_checkers_judge_and_solutions_are_withheld(built):
    destination, _ = built
    script = """
import helpers
from helpers.exercises import SolutionWithheld, check, solution, solutions_withheld
assert helpers.__file__.startswith(HERE), helpers.__file__
assert solutions_withheld()
try:
    solution("even_odd_sum")
except SolutionWithheld as error:
    print(error)
def only_mine(rank, world_size):
    return rank
print(repr(check("even_odd_sum", only_mine)))
"""
    out = subprocess.run([sys.executable, "-c", f"HERE = {str(destination)!r}\n{script}"],
                         cwd=destination, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(destination)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("the reference solution of 'even_odd_sum' is withheld in this copy of the course"
            in out.stdout)
    assert "[NOT YET] even_odd_sum" in out.stdout


def test_here_the_solutions_are_not_withheld():
    from helpers.exercises import solution, solutions_withheld

    assert not solutions_withheld()
    assert callable(solution("even_odd_sum"))
