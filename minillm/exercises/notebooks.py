"""The exercise notebooks: student notebooks generated from the solution notebooks, and a student's
notebook executed and checked.

Solution notebooks (``notebooks/exercises/solutions/``) hold each answer between ``### BEGIN SOLUTION``
and ``### END SOLUTION`` (nbgrader's markers). ``build`` writes the student notebooks
(``notebooks/exercises/student/``, same file names): each marked region becomes
``raise NotImplementedError("write this function: <name>")`` at the region's indentation, and every
output and execution count is stripped. ``check_notebook`` runs a notebook in a Jupyter kernel (the
student's code never runs in the grader's process) and checks every exercise function it defines.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

from . import EXERCISES

EXERCISES_DIR = Path(__file__).resolve().parents[2] / "notebooks" / "exercises"
SOLUTIONS_DIR = EXERCISES_DIR / "solutions"
STUDENT_DIR = EXERCISES_DIR / "student"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
_MARK = "@@minillm-exercises@@"


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
    """Write the student notebook of every ``*.ipynb`` in ``solutions`` into ``out``; returns their paths.

    Raises:
        FileNotFoundError: no solution notebook in ``solutions``.
        MarkerError: markers that do not pair up (naming the notebook).
    """
    paths = sorted(Path(solutions).glob("*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no solution notebooks (*.ipynb) in {solutions}")
    Path(out).mkdir(parents=True, exist_ok=True)
    written = []
    for path in paths:
        try:
            text = student_text(path)
        except MarkerError as e:
            raise MarkerError(f"{path.name}: {e}") from None
        target = Path(out) / path.name
        target.write_text(text, encoding="utf-8")
        written.append(target)
    return written


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


@dataclass
class NotebookResult:
    """What ``check_notebook`` found: per exercise function, the report's text and whether it passed
    (None: the function is not defined after running the notebook); errors raised by cells."""

    path: Path
    reports: dict[str, tuple[str, bool | None]]
    cell_errors: list[str]

    @property
    def passed(self) -> bool:
        return bool(self.reports) and all(ok for _, ok in self.reports.values())


_CHECK_CELL = """
import json as _json
from minillm.exercises import check as _check
_results = {}
for _name in %r:
    _fn = globals().get(_name)
    if callable(_fn):
        _report = _check(_name, _fn, verbose=False)
        _results[_name] = (str(_report), _report.passed)
    else:
        _results[_name] = ("check " + _name + ": not defined (did its cell run?)", None)
print(%r + _json.dumps(_results))
"""


def _current_env_kernel():
    """A kernel manager that starts this Python (the one with minillm installed), whatever kernel the
    notebook names or the machine's kernelspecs say (nbval's --nbval-current-env does the same)."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                              display_name="minillm exercises", language="python")

    return KernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnv())


class NotANotebookError(ValueError):
    """A path to check that is no notebook: missing, or not notebook JSON (bad input, not a failed grade)."""


def check_notebook(path: Path, timeout: int = 600) -> NotebookResult:
    """Execute a student's notebook in a fresh kernel (its own folder as working directory, cells that
    raise do not stop the run) and check each exercise function it defines.

    Raises:
        NotANotebookError: no such file, or not a notebook. ValueError: it defines none of the exercise
            functions.
    """
    from nbclient import NotebookClient

    path = Path(path)
    try:
        nb = nbformat.read(path, as_version=4)
    except (OSError, nbformat.reader.NotJSONError, nbformat.ValidationError) as e:
        raise NotANotebookError(f"{path}: not a notebook ({e})") from None
    names = exercise_names(nb)
    if not names:
        raise ValueError(f"{path}: defines none of the exercise functions ({', '.join(EXERCISES)})")
    nb.cells.append(nbformat.v4.new_code_cell(_CHECK_CELL % (names, _MARK)))
    NotebookClient(nb, km=_current_env_kernel(), timeout=timeout, allow_errors=True,
                   resources={"metadata": {"path": str(path.parent.resolve())}}).execute()
    errors = [f"{o.ename}: {o.evalue}" for c in nb.cells[:-1] if c.cell_type == "code"
              for o in c.get("outputs", []) if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    if _MARK not in text:  # the kernel could not even run the checks (minillm missing there?)
        failed = [f"{o.ename}: {o.evalue}" for o in nb.cells[-1].outputs if o.output_type == "error"]
        reports = {n: (f"check {n}: could not run ({'; '.join(failed)})", False) for n in names}
        return NotebookResult(path, reports, errors)
    results = json.loads(text.split(_MARK, 1)[1].strip().splitlines()[0])
    return NotebookResult(path, {n: tuple(v) for n, v in results.items()}, errors)
