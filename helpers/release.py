"""A student release: the course without its reference solutions (`make release DEST=dir`).

    python -m helpers.release DEST

writes into DEST (new, or empty) every file git tracks here, as it is in this checkout (an
instructor's uncommitted edits included), as a fresh tree with no history, less what would give an
exercise away:

- every lesson's `solutions.py`, so that `helpers.exercises.solution()` says the solutions are
  withheld (SolutionWithheld);
- in the notebooks and the README, the sentence that points to them, said anew;
- in the tests, every test that needs a solution or holds an answer: the reference solutions' own
  tests, the right answers written another way that a checker must accept, the typical mistakes it
  must reject (each is a solution with one thing changed), and whatever only they use. Each such
  test stays, by its name, skipped with the reason, so that none disappears without a word
  (`_strip_answers`).

The instructor's own CI (`.ci/`) stays behind; everything else, `make lab` and `make test`
included, works in the release as here.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
WITHHELD = "needs a reference solution or holds an answer: withheld in the student release"
# What a test file uses that only answers use: the checker's verdicts on an answer
# (tests/checker.py) and the reference solutions.
ANSWER_NAMES = {"expect_rejection", "expect_acceptance", "solution", "solutions"}
POINTER = re.compile(r"\s*A\s+reference\s+solution\s+of\s+each\s+is\s+in\s+"
                     r"`helpers/\w+/solutions\.py`;\s+try\s+first\.")
INSTEAD = " Your instructor holds the reference solutions; `check` is your judge."
README_POINTER = "Reference solutions are in\n`helpers/<lesson>/solutions.py`."


def is_withheld(path: str) -> bool:
    """Whether a tracked file stays out of the release: a lesson's solutions, the course's CI."""
    parts = pathlib.PurePosixPath(path).parts
    return (parts[0] == ".ci" or
            (len(parts) == 3 and parts[0] == "helpers" and parts[2] == "solutions.py"))


def build(destination) -> list:
    """Write the release into `destination`; returns the tests withheld, as "file::name"."""
    destination = pathlib.Path(destination)
    if destination.exists() and any(destination.iterdir()):
        raise SystemExit(f"{destination} is not empty: a release is written into a new folder")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    withheld_tests = []
    for path in filter(None, tracked):
        source = ROOT / path
        if is_withheld(path) or not source.exists():
            continue
        target = destination / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.startswith("notebooks/") and path.endswith(".ipynb"):
            target.write_text(notebook_for_students(source.read_text()))
        elif path == "README.md":
            target.write_text(source.read_text().replace(README_POINTER, INSTEAD.strip()))
        elif path.startswith("tests/") and path.endswith(".py"):
            text, removed = _strip_answers(source.read_text())
            target.write_text(text)
            withheld_tests += [f"{path}::{name}" for name in removed]
        else:
            shutil.copy2(source, target)
    # the syllabus counts the notebooks' words, and the release says one sentence anew
    subprocess.run([sys.executable, "-m", "helpers.syllabus", "--write"], cwd=destination,
                   env={**os.environ, "PYTHONPATH": str(destination)}, check=True)
    return withheld_tests


def notebook_for_students(text: str) -> str:
    """A notebook with its pointer to the solutions said anew (its outputs hold none: the
    exercise cells are the stubs a student starts from)."""
    notebook = nbformat.reads(text, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            cell.source = POINTER.sub(INSTEAD, cell.source)
    return nbformat.writes(notebook) + "\n"


def _strip_answers(text: str) -> tuple[str, list]:
    """A test module without its answers, and the names of the tests that went with them.

    A top-level statement is an answer where it uses ANSWER_NAMES (a verdict on an answer, a
    solution), uses a name that only answers define (so it would fail without them), or
    defines only what answers use (a mistake, a list of mistakes). Import statements are taken
    name by name. Each test function among the answers is put back as a skipped stub."""
    tree = ast.parse(text)
    units, answer = [], []  # (statement, the names it defines, the names it uses); an answer?
    for statement in tree.body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            module = getattr(statement, "module", None) or ""
            for alias in statement.names:
                name = (alias.asname or alias.name).split(".")[0]
                units.append((statement, {name}, set()))
                answer.append(name in ANSWER_NAMES or module.endswith(".solutions")
                              or alias.name.endswith(".solutions"))
            continue
        defines = _defined(statement)
        uses = {node.id for node in ast.walk(statement) if isinstance(node, ast.Name)}
        uses |= {node.attr for node in ast.walk(statement) if isinstance(node, ast.Attribute)}
        units.append((statement, defines, uses - defines))
        answer.append(bool(uses & ANSWER_NAMES))
    changed = True
    while changed:
        changed = False
        removed_names = {name for (_, defines, _), gone in zip(units, answer) if gone
                         for name in defines}
        kept_names = {name for (_, defines, _), gone in zip(units, answer) if not gone
                      for name in defines}
        for index, (statement, defines, uses) in enumerate(units):
            if answer[index]:
                continue
            needs_removed = bool(uses & (removed_names - kept_names))
            users = [other for other, (_, _, other_uses) in enumerate(units)
                     if other != index and other_uses & defines]
            only_answers = bool(users) and all(answer[user] for user in users)
            if needs_removed or (only_answers and not _is_test(statement)):
                answer[index] = changed = True
    lines = text.splitlines(keepends=True)
    drop, imports = set(), {}
    for (statement, _, _), gone in zip(units, answer):
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            imports.setdefault(id(statement), [statement, []])[1].append(gone)
        elif gone:
            drop.update(range(_first_line(statement) - 1, statement.end_lineno))
    replaced = {}
    for statement, gone in imports.values():
        if any(gone):
            _narrow_import(statement, [alias for alias, out in zip(statement.names, gone)
                                       if not out], drop, replaced)
    kept = _kept_lines(lines, drop, replaced)
    removed = [statement.name for (statement, _, _), gone in zip(units, answer)
               if gone and _is_test(statement)]
    if removed:
        kept = _unused_imports_dropped("".join(kept))
        kept += ["\n\n# Each test below needs a reference solution or holds an answer: withheld "
                 "in the student\n# release (make release), and skipped there by its name.\n",
                 f"_WITHHELD = {json.dumps(WITHHELD)}\n",
                 *(f"\n\n@pytest.mark.skip(reason=_WITHHELD)\ndef {name}():\n    pass\n"
                   for name in removed)]
        text = re.sub(r"\n{3,}", "\n\n\n", "".join(kept))
        if not re.search(r"^import pytest$", text, re.M):
            text = _imports_sorted(_after_docstring(text, "import pytest\n"))
        return text, removed
    return "".join(kept), removed


def _defined(statement) -> set:
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        return {node.id for target in targets for node in ast.walk(target)
                if isinstance(node, ast.Name)}
    return set()


def _is_test(statement) -> bool:
    return isinstance(statement, ast.FunctionDef) and statement.name.startswith("test")


def _first_line(statement) -> int:
    """A statement's first line, its decorators' included."""
    decorators = getattr(statement, "decorator_list", [])
    return min([statement.lineno, *(decorator.lineno for decorator in decorators)])


def _unused_imports_dropped(text: str) -> list:
    """The module's lines less the import names nothing uses any more (the linter's F401)."""
    tree = ast.parse(text)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    lines = text.splitlines(keepends=True)
    drop, replaced = set(), {}
    for statement in tree.body:
        if not isinstance(statement, (ast.Import, ast.ImportFrom)):
            continue
        names = [alias for alias in statement.names
                 if (alias.asname or alias.name).split(".")[0] in used or alias.name == "*"]
        if len(names) < len(statement.names):
            _narrow_import(statement, names, drop, replaced)
    return _kept_lines(lines, drop, replaced)


def _narrow_import(statement, kept, drop, replaced):
    """Take an import statement's lines out (into `drop`), and where it keeps any of its names,
    put the import of `kept` alone on its first line (into `replaced`)."""
    drop.update(range(statement.lineno - 1, statement.end_lineno))
    if kept:
        statement.names = kept
        replaced[statement.lineno - 1] = ast.unparse(statement) + "\n"


def _kept_lines(lines, drop, replaced) -> list:
    """The lines not dropped, each replaced line in its new form."""
    return [replaced.get(number, line) for number, line in enumerate(lines)
            if number not in drop or number in replaced]


def _after_docstring(text: str, insert: str) -> str:
    end = ast.parse(text).body[0].end_lineno
    lines = text.splitlines(keepends=True)
    return "".join(lines[:end] + ["\n", insert] + lines[end:])


def _imports_sorted(text: str) -> str:
    """The module with its imports in the linter's order (ruff's isort rules, pyproject.toml)."""
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "--fix-only",
                           "--select", "I", "--stdin-filename", "tests/module.py", "-"],
                          input=text, capture_output=True, text=True, cwd=ROOT,
                          check=True).stdout


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m helpers.release", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("destination", help="a new (or empty) folder")
    destination = pathlib.Path(parser.parse_args(argv).destination)
    withheld = build(destination)
    print(f"A student release in {destination}: no reference solutions; "
          f"{len(withheld)} tests withheld, each skipped there by name.")


if __name__ == "__main__":
    sys.exit(main())
