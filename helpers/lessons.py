"""Which lessons exist: one notebook `notebooks/NN_name.ipynb` and one package `helpers.name` each.

A package is a lesson when it defines `NOTEBOOK`, the file name of its notebook. The exercise
engine (`helpers.exercises`) and `make figures` (`helpers.drawing`) find the lessons here, so a new
lesson needs no edit outside its own folder.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

import helpers


@dataclass(frozen=True)
class Lesson:
    number: int  # 3
    stem: str  # "03_collectives": the notebook's file name without .ipynb
    package: str  # "helpers.collectives"


def lessons() -> list:
    """Every lesson, in course order."""
    found = []
    for info in pkgutil.iter_modules(helpers.__path__):
        if not info.ispkg:
            continue
        package = importlib.import_module(f"helpers.{info.name}")
        notebook = getattr(package, "NOTEBOOK", None)
        if notebook:
            stem = notebook.removesuffix(".ipynb")
            found.append(Lesson(int(stem[:2]), stem, package.__name__))
    return sorted(found, key=lambda lesson: lesson.number)
