"""The exercise notebooks: student notebooks generated from the solution notebooks.

Solution notebooks (``notebooks/exercises/solutions/``) hold each answer between ``### BEGIN SOLUTION``
and ``### END SOLUTION`` (nbgrader's markers). ``build`` writes the student notebooks
(``notebooks/exercises/student/``, same file names): each marked region becomes
``raise NotImplementedError("write this function: <name>")`` at the region's indentation, and every
output and execution count is stripped. Grading a student's notebook is ``grading.py``'s.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat

from . import EXERCISES

EXERCISES_DIR = Path(__file__).resolve().parents[2] / "notebooks" / "exercises"
SOLUTIONS_DIR = EXERCISES_DIR / "solutions"
STUDENT_DIR = EXERCISES_DIR / "student"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


class MarkerError(ValueError):
    """A solution notebook's markers do not pair up."""


def strip_solution(source: str) -> str:
    """The student's version of one code cell: each BEGIN/END SOLUTION region (markers included)
    becomes one ``raise NotImplementedError`` naming the function the region sits in.

    Raises:
        MarkerError: an END without a BEGIN, or a BEGIN never closed.
    """
    out, inside, name = [], False, None
    for line in source.splitlines():
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise MarkerError(f"{BEGIN} inside another solution region; close the first with {END}")
            inside = True
            what = f"write this function: {name}" if name else "write this code"
            out.append(f'{line[:len(line) - len(line.lstrip())]}raise NotImplementedError("{what}")')
        elif marker == END:
            if not inside:
                raise MarkerError(f"{END} without a {BEGIN} before it")
            inside = False
        elif not inside:
            out.append(line)
            m = re.match(r"\s*def (\w+)\(", line)
            if m:
                name = m.group(1)
    if inside:
        raise MarkerError(f"{BEGIN} never closed; add {END} after the solution")
    return "\n".join(out)


def student_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of a solution notebook with the solutions replaced and every output stripped."""
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))  # a deep copy
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.source = strip_solution(cell.source)
        cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
    return nb


def student_text(solution: Path) -> str:
    """The student notebook of ``solution``, as the text ``build`` writes."""
    nb = student_notebook(nbformat.read(solution, as_version=4))
    return nbformat.writes(nb) + "\n"


def build(solutions: Path = SOLUTIONS_DIR, out: Path = STUDENT_DIR) -> list[Path]:
    """Write the student notebook of every ``*.ipynb`` in ``solutions`` into the folder ``out`` (created
    if missing); returns their paths. Every notebook is converted before the first is written, so that
    an error writes nothing.

    Raises:
        FileNotFoundError: no solution notebook in ``solutions``.
        MarkerError: markers that do not pair up (naming the notebook).
        NotADirectoryError: ``out``, or a folder above it, is a file.
    """
    paths = sorted(Path(solutions).glob("*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no solution notebooks (*.ipynb) in {solutions}")
    texts = {}
    for path in paths:
        try:
            texts[Path(out) / path.name] = student_text(path)
        except MarkerError as e:
            raise MarkerError(f"{path.name}: {e}") from None
    file_above = next((p for p in (Path(out), *Path(out).parents) if p.exists() and not p.is_dir()), None)
    if file_above is not None:
        raise NotADirectoryError(f"{file_above} is a file, and the student notebooks go into a folder")
    Path(out).mkdir(parents=True, exist_ok=True)
    for target, text in texts.items():
        target.write_text(text, encoding="utf-8")
    return list(texts)


def out_of_date(solutions: Path = SOLUTIONS_DIR, out: Path = STUDENT_DIR) -> list[str]:
    """Names of the student notebooks that ``build`` would write differently (or that are missing)."""
    stale = []
    for path in sorted(Path(solutions).glob("*.ipynb")):
        target = Path(out) / path.name
        if not target.exists() or target.read_text(encoding="utf-8") != student_text(path):
            stale.append(path.name)
    return stale


def exercise_names(nb: nbformat.NotebookNode) -> list[str]:
    """The exercise functions a notebook defines (``def <name>(`` in a code cell), in EXERCISES' order."""
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    return [n for n in EXERCISES if re.search(rf"^\s*def {n}\(", code, re.MULTILINE)]


def is_capstone(nb: nbformat.NotebookNode) -> bool:
    """Whether the notebook is the capstone: a code cell defines ``serve``, its serving loop (graded as one row;
    the pieces it also defines are graded in their own notebooks)."""
    return any(re.search(r"^\s*def serve\(", c.source, re.MULTILINE) for c in nb.cells if c.cell_type == "code")
