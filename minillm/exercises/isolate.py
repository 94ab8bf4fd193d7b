"""The grader's side of a graded function's process (``runner.py`` is the process's side): what it receives
(``sources``: the function's source, the notebook's functions, classes and literal constants it uses and the
notebook's import lines, never the notebook's state), how it is started and stopped, and its answers read back
as plain data (``torch.load(weights_only=True)``). The cases and their expected answers stay in the grader's
process; the function's process gets the cases' arguments only.
"""

from __future__ import annotations

import ast
import io
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import torch

from . import EXERCISES, runner
from .checker import Answer, Case, Foreign


# ---------------------------------------------------------------------------------------------
# What a graded function's process receives: source, never state


@dataclass
class Source:
    """A function's source as its process receives it: the notebook's import lines, the definitions it needs
    (file name, text padded so that line numbers are the cell's) and every code cell's text (for tracebacks)."""

    imports: list[str] = field(default_factory=list)
    definitions: list[tuple[str, str]] = field(default_factory=list)
    cells: dict[str, str] = field(default_factory=dict)


def _is_literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _definitions(nb: nbformat.NotebookNode, keep: tuple[str, ...] = ()):
    """The notebook's import lines (those of ``minillm.exercises`` left out, but for the modules in ``keep``),
    its top-level definitions (name -> (file name, node, text padded so that line numbers are the cell's), in
    the order of their last definition) and every parsed code cell's text."""
    from IPython.core.inputtransformer2 import TransformerManager

    imports, defined, cells = [], {}, {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        filename = f"<cell {index + 1}>"
        try:
            text = TransformerManager().transform_cell(cell.source)  # %magics and !commands become Python
            tree = ast.parse(text, filename)
        except (SyntaxError, ValueError):
            continue
        cells[filename] = text
        lines = text.splitlines(True)
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if not any((m == "minillm.exercises" or m.startswith("minillm.exercises.")) and m not in keep
                           for m in modules) and not (isinstance(node, ast.ImportFrom) and node.level):
                    imports.append(ast.get_source_segment(text, node))
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign) and _is_literal(node.value) and all(
                    isinstance(t, ast.Name) for t in node.targets):
                names = [t.id for t in node.targets]
            else:
                continue
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            padded = "\n" * (first - 1) + "".join(lines[first - 1:node.end_lineno])
            for name in names:
                defined.pop(name, None)  # re-inserted: the order is that of the last definition
                defined[name] = (filename, node, padded)
    return imports, defined, cells


def _source(imports, defined, cells, names) -> Source:
    """The ``Source`` of the functions ``names``: their definitions and the notebook's own that they use."""
    needed, todo = set(), list(names)
    while todo:  # the notebook's own definitions the functions use, and theirs
        current = todo.pop()
        if current in needed:
            continue
        needed.add(current)
        todo += [n.id for n in ast.walk(defined[current][1]) if isinstance(n, ast.Name) and n.id in defined]
    return Source(list(imports), [(f, text) for n, (f, _, text) in defined.items() if n in needed], dict(cells))


def _is_function(defined, name: str) -> bool:
    return name in defined and isinstance(defined[name][1], (ast.FunctionDef, ast.AsyncFunctionDef))


def sources(nb: nbformat.NotebookNode) -> dict[str, Source]:
    """Per exercise function defined at the top level of a code cell (the last definition wins, as when the
    notebook runs top to bottom): its ``Source``. Import lines of ``minillm.exercises`` are left out (the
    checker's, which the process may not import); a cell that does not parse defines nothing."""
    imports, defined, cells = _definitions(nb)
    return {name: _source(imports, defined, cells, [name]) for name in EXERCISES if _is_function(defined, name)}


# the modules of minillm.exercises a capstone notebook imports that its loop's process provides (runner.py: the
# kit, and capstone's names with the lesson's switched off)
CAPSTONE_MODULES = ("minillm.exercises.capstone", "minillm.exercises.capstone_kit")


def capstone_source(nb: nbformat.NotebookNode, pieces: tuple[str, ...]) -> tuple[Source, list[str]] | None:
    """The capstone's loop: the ``Source`` of ``serve`` and of the ``pieces`` the notebook defines and has
    written (a piece left blank is not given), with what they use and its imports of ``CAPSTONE_MODULES`` kept,
    and the names of those pieces; None when no code cell defines ``serve`` at its top level."""
    imports, defined, cells = _definitions(nb, keep=CAPSTONE_MODULES)
    if not _is_function(defined, "serve"):
        return None
    found = [p for p in pieces if _is_function(defined, p) and not _blank(defined[p][1])]
    return _source(imports, defined, cells, ["serve", *found]), found


def _blank(node: ast.AST) -> bool:
    """Whether a function's body is only the student notebook's blank (a docstring, then ``raise
    NotImplementedError(...)``): a piece left blank counts as not defined (a course that skipped it)."""
    body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return (len(body) == 1 and isinstance(body[0], ast.Raise) and isinstance(body[0].exc, ast.Call)
            and isinstance(body[0].exc.func, ast.Name) and body[0].exc.func.id == "NotImplementedError")


# ---------------------------------------------------------------------------------------------
# The graded function's process


START_TIMEOUT = 120  # seconds for a process to import torch and minillm and switch the package off
_SAFE = [Answer, Foreign, (Answer, "__main__.Answer"), (Foreign, "__main__.Foreign")]


def _read_answers(data: bytes, n_cases: int) -> tuple[list[Answer], list[str]] | str:
    """The process's answers and notes, read as plain data only, or why they cannot be used."""
    try:
        with torch.serialization.safe_globals(_SAFE):
            got = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # the student's process wrote it: anything may be in it
        return f"its answers could not be read back ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
    answers, notes = (got.get("answers"), got.get("notes")) if isinstance(got, dict) else (None, None)
    if not (isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
        return "its answers file holds no notes list"
    if not (isinstance(answers, list) and len(answers) in (0, n_cases) and all(
            type(a) is Answer and isinstance(a.args, tuple) and isinstance(a.calls, tuple)
            and all(isinstance(t, str) for t in (a.error, a.message, a.where, *a.calls)) for a in answers)):
        return f"its answers file does not hold {n_cases} answers"
    return answers, notes


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: whatever it started goes too
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def call_in_fresh_process(name: str, source: Source, cases: list[Case], timeout: float,
                          start_timeout: float = START_TIMEOUT, *, tools: tuple[str, ...] | None = None,
                          capstone: dict | None = None) -> tuple[list[Answer], list[str]] | tuple[None, str]:
    """Call exercise function ``name`` on each case in a process of its own (``runner.py``): (answers, notes),
    or (None, why there are none: "timeout", "died" or a sentence). ``timeout`` counts from the end of the
    process's start (imports and the package's switch-off, ``start_timeout`` at most). ``tools``: the package
    code left on (default: the exercise's ``tools``). ``capstone``: for the capstone's loop, what its process
    provides (``runner.py``'s ``provide_capstone``: the model, the kit, the names switched off)."""
    job = io.BytesIO()
    torch.save({"name": name, "imports": source.imports, "definitions": source.definitions,
                "cells": source.cells, "cases": [c.args for c in cases],
                "tools": EXERCISES[name].tools if tools is None else tools, "capstone": capstone}, job)
    # -I: no user site, no PYTHONPATH, and neither the working folder nor a script's folder on sys.path;
    # the source is passed with -c, so that the checker's folder is never on sys.path either
    proc = subprocess.Popen([sys.executable, "-I", "-c", Path(runner.__file__).read_text(encoding="utf-8"),
                             str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            cwd=tempfile.gettempdir(), start_new_session=True)
    got = {}

    def read():
        got["first"] = proc.stdout.readline()
        got["rest"] = proc.stdout.read()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        try:
            proc.stdin.write(job.getvalue())
            proc.stdin.close()
        except BrokenPipeError:  # it died at once; the reader says so below
            pass
        deadline = start_timeout
        while "first" not in got and deadline > 0 and reader.is_alive():
            reader.join(0.1)
            deadline -= 0.1
        if "first" not in got:
            _kill(proc)
            return None, f"its process did not start within {start_timeout:g} s (a machine too busy?)"
        if got["first"] != runner.READY:
            _kill(proc)
            return None, "died"
        reader.join(timeout)
        if reader.is_alive():
            _kill(proc)
            return None, "timeout"
        proc.wait()
    finally:  # SIGINT, SIGTERM or an error here: the student's process does not outlive the grader
        if proc.poll() is None:
            _kill(proc)
    if proc.returncode != 0 and not got.get("rest"):
        return None, "died"
    read_back = _read_answers(got["rest"], len(cases))
    return (None, read_back) if isinstance(read_back, str) else read_back
