"""A folder of submissions graded into one CSV: ``python -m minillm exercises check submissions/ --grading
--seed N --csv grades.csv``.

Submissions are notebooks anywhere under the folder; a notebook's student is the first folder under it
(``submissions/alice/07_speculative_sampling.ipynb`` is alice's) or, for a notebook directly inside it, the
file's name without its exercise number. A teacher's cases file (``--cases``) is a Python file that sets
``CASES = {"function name": [Case(name, args, expected, points=...), ...]}``; it is the teacher's, so it runs.
"""

from __future__ import annotations

import csv
import re
import runpy
from pathlib import Path

from ..files import atomic_write
from . import EXERCISES
from .checker import Case

COLUMNS = ("student", "notebook", "exercise", "points", "max_points", "status")


def notebooks_in(paths: list[Path]) -> list[tuple[Path, str]]:
    """(notebook, student) for each path: a notebook as given, or every ``*.ipynb`` under a folder (sorted;
    Jupyter's checkpoints left out)."""
    found = []
    for path in paths:
        if not path.is_dir():
            found.append((path, path.parent.name or path.stem))
            continue
        for nb in sorted(path.rglob("*.ipynb")):
            rel = nb.relative_to(path)
            if ".ipynb_checkpoints" in rel.parts:
                continue
            student = rel.parts[0] if len(rel.parts) > 1 else re.sub(r"^\d+_", "", nb.stem)
            found.append((nb, student))
    return found


def load_cases(path: Path) -> dict[str, list[Case]]:
    """The teacher's extra cases: ``CASES`` from the Python file at ``path``.

    Raises:
        ValueError: no ``CASES`` dict, a name that is no exercise, or an entry that is no list of ``Case``.
    """
    cases = runpy.run_path(str(path)).get("CASES")
    if not isinstance(cases, dict):
        raise ValueError(f"--cases {path}: set CASES = {{'function name': [Case(...), ...]}} in the file")
    for name, items in cases.items():
        if name not in EXERCISES:
            raise ValueError(f"--cases {path}: {name!r} is not an exercise ({', '.join(EXERCISES)})")
        if not isinstance(items, list) or not all(isinstance(c, Case) for c in items):
            raise ValueError(f"--cases {path}: CASES[{name!r}] must be a list of minillm.exercises.Case")
    return cases


def write_csv(rows: list[tuple], path: Path) -> None:
    """The gradebook: one row per student, notebook and exercise (``COLUMNS``), written to a temporary
    file and renamed (``files.atomic_write``), so an interrupted run never leaves half a gradebook over the
    last one. The path is checked before grading starts (``files.check_output_path``)."""
    with atomic_write(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows(rows)
