"""A handed-in notebook, read as data (never run here): which lesson it is, each exercise's answer
cell, and the earlier cells that answer needs.

An answer cell is found by its metadata (`"exercise": name`, which every lesson's notebook carries
and `make release` keeps), or, where a learner rebuilt the cell, by its `check("name", ...)`
call. The cells it needs are those that bind a name it uses and does not bind itself (an import, a
helper function), found by Python's own symbol tables, and theirs in turn: the last such cell
above it in the learner's notebook, as the kernel would have run them top to bottom.
"""

from __future__ import annotations

import ast
import builtins
import re
import symtable
from dataclasses import dataclass

CHECK_CALL = re.compile(r'^\s*check\(\s*["\'](\w+)["\']', re.M)


class Unreadable(ValueError):
    """A file that is not a notebook: its name and what is wrong, in one sentence."""


@dataclass(frozen=True)
class Answer:
    exercise: str
    cells: tuple  # ((index in the notebook, source), ...): the needed cells, then the answer
    started: bool  # False for the notebook's stub, untouched: `raise NotImplementedError` alone


def read(path) -> list:
    """The notebook's code cells as (index, source, metadata); Unreadable if it is no notebook."""
    # imported here: nbformat's schema checker takes a second and more to import, and a lesson's
    # first check() imports every lesson's package, helpers.grading among them
    import nbformat

    try:
        notebook = nbformat.read(str(path), as_version=4)
        return [(index, _runnable(cell.source), dict(cell.get("metadata", {})))
                for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"]
    except Exception as error:  # noqa: BLE001 - a handed-in file may be anything at all
        raise Unreadable(f"{path.name} could not be read as a notebook "
                         f"({type(error).__name__}: {str(error)[:200]})") from None


def exercises_in(cells) -> set:
    """The exercises whose answer cells the notebook holds (to tell one lesson's from another's)."""
    return {name for _, source, metadata in cells
            for name in [metadata.get("exercise"), *CHECK_CALL.findall(source)] if name}


def answer(cells, exercise: str) -> Answer | None:
    """The answer to `exercise` and the cells it needs; None where no cell answers it."""
    marked = [cell for cell in cells if cell[2].get("exercise") == exercise]
    called = [cell for cell in cells if exercise in CHECK_CALL.findall(cell[1])]
    found = (marked or called)
    if not found:
        return None
    index, source, _ = found[-1]
    statements = [(number, statement, text) for number, text, _ in cells if number < index
                  for statement in _statements(text)]
    needed = _needed(statements, len(statements), _free_names(source))
    kept = {}
    for position in sorted(needed):
        number, statement, text = statements[position]
        kept.setdefault(number, [text, set()])[1].update(
            range(statement.lineno, statement.end_lineno + 1))
    needs = tuple((number, "\n".join(line if at in lines else "" for at, line in
                                     enumerate(text.split("\n"), 1)))
                  for number, (text, lines) in sorted(kept.items()))
    return Answer(exercise, needs + ((index, source),), _started(source, exercise))


def _statements(text: str) -> list:
    """A cell's top-level statements (none where it is not valid Python)."""
    try:
        return list(ast.parse(text).body)
    except SyntaxError:
        return []


def _runnable(source: str) -> str:
    """A cell as Python: IPython's line magics and shell escapes (`%time`, `!ls`) left out."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.split("\n"))


def _free_names(source: str) -> set:
    """The global names a cell uses without binding them itself (builtins aside); all of them
    where the cell is not valid Python (running it will say so, at its line)."""
    try:
        table = symtable.symtable(source, "<cell>", "exec")
    except SyntaxError:
        return set()
    bound = {symbol.get_name() for symbol in table.get_symbols()
             if symbol.is_assigned() or symbol.is_imported() or symbol.is_namespace()}
    used = set()
    stack = [table]
    while stack:
        scope = stack.pop()
        stack += scope.get_children()
        for symbol in scope.get_symbols():
            if symbol.is_referenced() and (scope is table or symbol.is_global()):
                used.add(symbol.get_name())
    return used - bound - set(dir(builtins)) - {"check"}  # the grader's own check


def _bound_names(statement) -> set:
    """The names a top-level statement binds: an import's, an assignment's, a def's or class's."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in statement.names}
    return {node.id for node in ast.walk(statement)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}


def _needed(statements, before: int, names: set) -> set:
    """The positions of the statements (of the cells above the answer, in order) that bind
    `names`, and of those their own names need: for each name, the last statement above that
    binds it. A cell is taken statement by statement: an earlier answer's mistakes, or a slow
    demonstration beside an import, are not the later answer's."""
    needed, wanted, seen = set(), [(before, name) for name in names], set()
    while wanted:
        limit, name = wanted.pop()
        if (limit, name) in seen:
            continue
        seen.add((limit, name))
        binders = [position for position in range(limit)
                   if name in _bound_names(statements[position][1])]
        if binders and binders[-1] not in needed:
            position = binders[-1]
            needed.add(position)
            wanted += [(position, other) for other in
                       _free_names(ast.unparse(statements[position][1]))]
    return needed


def _started(source: str, exercise: str) -> bool:
    """False where the function the cell hands to check() is still the notebook's stub: its body
    `raise NotImplementedError` (a docstring, `pass` and comments aside)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True
    handed = {node.args[1].id for node in ast.walk(tree)
              if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Name)
              and isinstance(node.args[0], ast.Constant) and node.args[0].value == exercise}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in handed:
            body = [statement for statement in node.body
                    if not (isinstance(statement, ast.Expr) and isinstance(statement.value,
                                                                           ast.Constant))
                    and not isinstance(statement, ast.Pass)]
            return not (len(body) == 1 and isinstance(body[0], ast.Raise) and
                        "NotImplementedError" in ast.unparse(body[0]))
    return True
