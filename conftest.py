"""Options for the notebooks' runs under nbval (make test).

--nbval-skip-timings: a cell whose output nbval ignores because it is a timing (a first line
`# NBVAL_IGNORE_OUTPUT` and a `# (timings)` line under it) is not run when no later cell of its
notebook needs a name it assigns. make test's second pass over the notebooks, on other CPU
kernels, uses it: such a cell compares nothing there, and the first pass already ran it.
"""

import ast

import pytest


def pytest_addoption(parser):
    parser.addoption("--nbval-skip-timings", action="store_true",
                     help="do not run notebook cells whose ignored output is a timing and whose "
                          "names no later cell uses")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--nbval-skip-timings"):
        return
    skip = pytest.mark.skip(reason="a timing nbval ignores: compared on no pass, run on the first")
    cells = [(item, getattr(getattr(item, "cell", None), "source", None)) for item in items]
    for index, (item, source) in enumerate(cells):
        if not source or "NBVAL_IGNORE_OUTPUT" not in source or "# (timings)" not in source:
            continue
        later = [other for other_item, other in cells[index + 1:]
                 if other and other_item.parent is item.parent]
        assigned, used = _names(source, ast.Store), [_needs(other) for other in later]
        if assigned is not None and None not in used and not any(assigned & names
                                                                  for names in used):
            item.add_marker(skip)


def _needs(source: str) -> set | None:
    """The names a later cell loads and does not assign itself (a loop variable it rebinds is
    not taken from the skipped cell; were it, the run would fail with a NameError, not pass)."""
    loads, stores = _names(source, ast.Load), _names(source, ast.Store)
    return None if loads is None else loads - stores


def _names(source: str, context) -> set | None:
    """The names a cell's code stores or loads (None if it is not plain Python)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    found = {node.id for node in ast.walk(tree)
             if isinstance(node, ast.Name) and isinstance(node.ctx, context)}
    if context is ast.Store:
        found |= {node.name for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef | ast.ClassDef)}
        found |= {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names}
    return found
