"""Grading a student's notebook (``python -m minillm exercises check``): the notebook runs in a Jupyter
kernel, for what its cells print and raise; each exercise function is then called in a fresh process of its
own (``isolate.py`` starts it, ``runner.py`` runs in it), which receives the function's source, the source
of the notebook's functions, classes and literal constants it uses, and the notebook's import lines: never
the notebook's state.

Nothing the notebook does reaches the grade. The cases and their expected answers are drawn in the grader's
process and stay there; the function's process gets the cases' arguments only, cannot import
``minillm.exercises`` (the cases and the reference solutions), and runs the cases with the package switched
off by allow-list (the config classes and torch stay); its answers come back as plain data
(``torch.load(weights_only=True)``) and are judged here. The report lists the calls a function made into
minillm. ``--grading`` adds cases the student never saw (``Exercise.grading_cases``).

The capstone notebook (it defines ``serve``) is one row, its serving loop (``grade_capstone``): the pieces it
also defines are graded in their own notebooks, and are handed to the loop, which runs with the provided model
on the capstone's prompts in each of its settings (``capstone.grade_serve``).

The kernel's run is ``kernel.py``'s: a cell that runs past nbclient's timeout, kills its kernel or floods the
output (over ``max_output`` characters) is skipped and the notebook run again without it; an exercise function
that was running when the time ran out is not called again, and not graded. SIGINT and SIGTERM kill the kernel
and stop the grading (``GradingStopped``). A notebook that nbformat rejects, or that breaks the run in any other
way, fails its own rows with a line saying why. This is no sandbox (notebooks/exercises/README.md shows how to
grade in a container).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import nbformat

from . import EXERCISES
from .checker import Case, grade
from .isolate import call_in_fresh_process, capstone_source, sources
from .kernel import MAX_OUTPUT, GradingStopped, run_notebook, stopped_by_signals
from .notebooks import exercise_names, is_capstone



class NotANotebookError(ValueError):
    """A path to check that is no notebook: missing, or not notebook JSON (bad input, not a failed grade)."""


@dataclass
class NotebookResult:
    """What ``check_notebook`` found: per exercise function, the report's text and whether it passed
    (None: the function is not defined after running the notebook); the cells that raised, each named
    by its number and first line; when a cell was stopped (and skipped), why, one line each (else "");
    and per function its points, the most it could earn, and a one-word status for the gradebook."""

    path: Path
    reports: dict[str, tuple[str, bool | None]]
    cell_errors: list[str]
    stopped: str = ""
    scores: dict[str, tuple[float, float, str]] = None  # name -> (points, max points, status)

    @property
    def passed(self) -> bool:
        return bool(self.reports) and all(ok for _, ok in self.reports.values())


def cell_name(nb: nbformat.NotebookNode, index: int) -> str:
    """'cell N (`first line`)': N counts every cell from 1 at the top, as a reader of the notebook does."""
    lines = [line.strip() for line in nb.cells[index].source.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return f"cell {index + 1} (`{first[:60]}{'...' if len(first) > 60 else ''}`)"


def error_text(output: dict) -> str:
    """'Name: message' of a cell's error output; a SyntaxError's line is counted within its cell (IPython
    names a temporary file instead)."""
    value = re.sub(r"\((?:\S+\.py|<\S+>), line (\d+)\)", r"(line \1 of the cell)", output.get("evalue", ""))
    return f"{output.get('ename', 'Error')}: {value}"


def _read(path: Path) -> nbformat.NotebookNode:
    """The notebook, checked against nbformat's schema (a cell whose source is no text, say).

    Raises:
        NotANotebookError: no such file, not notebook JSON, or a notebook nbformat rejects.
    """
    try:
        with warnings.catch_warnings():  # a cell without an id: nbformat warns, and adds one
            warnings.simplefilter("ignore")
            nb = nbformat.read(path, as_version=4)
            nbformat.validate(nb)
    except (OSError, UnicodeDecodeError, nbformat.reader.NotJSONError) as e:
        raise NotANotebookError(f"{path}: not a notebook ({e})") from None
    except Exception as e:  # nbformat's schema errors, and what its upgrade of an odd file raises
        raise NotANotebookError(f"{path}: not a valid notebook ({_schema_error(e)}); open it in Jupyter, fix "
                                "or delete that cell, and save it again") from None
    return nb


def _schema_error(e: Exception) -> str:
    """Where nbformat's schema error is ("cell 3's source") and what it says, in one line."""
    where = list(getattr(e, "absolute_path", None) or [])
    message = (getattr(e, "message", None) or str(e) or type(e).__name__).splitlines()[0][:200]
    if len(where) >= 2 and where[0] == "cells" and isinstance(where[1], int):
        field = ".".join(map(str, where[2:])) or "cell"
        return f"cell {where[1] + 1}'s {field}: {message}"
    return f"{'.'.join(map(str, where))}: {message}" if where else f"{type(e).__name__}: {message}"


# ---------------------------------------------------------------------------------------------
# One notebook


def check_notebook(path: Path, timeout: int = 120, *, grading: bool = False, seed: int | None = None,
                   extra: dict[str, list[Case]] | None = None, max_output: int = MAX_OUTPUT) -> NotebookResult:
    """Execute a student's notebook in a fresh kernel (its own folder as working directory, cells that
    raise do not stop the run, ``timeout`` seconds per cell), then call each exercise function it defines
    in a process of its own (``call_in_fresh_process``, ``timeout`` seconds for all its cases) and judge the
    answers here. ``grading``: the practice cases and the unseen ones (``Exercise.grading_cases(seed,
    extra[name])``). A cell stopped for time, a dead kernel or a flood of output is skipped and the notebook
    run again without it (``kernel.MAX_RERUNS`` times at most); a function that ran out of time there is not called
    again. A run that breaks in any other way is reported, and the functions are graded all the same.

    Raises:
        NotANotebookError: no such file, or not a valid notebook. ValueError: it defines none of the exercise
            functions. GradingStopped: SIGINT or SIGTERM (the kernel is killed).
    """
    path = Path(path)
    nb = _read(path)
    capstone = is_capstone(nb)
    names = [] if capstone else exercise_names(nb)  # the capstone's pieces are graded in their own notebooks
    if not names and not capstone:
        raise ValueError(f"{path}: defines none of the exercise functions ({', '.join(EXERCISES)}) and no "
                         "capstone serving loop (serve)")
    # cases and expected answers are worked out before the student's code runs, in this process only
    plans = {}
    for name in names:
        ex = EXERCISES[name]
        cases = ex.grading_cases(seed, (extra or {}).get(name, ())) if grading else ex.cases()
        plans[name] = (ex, cases, [ex.expected(c) for c in cases])
    broken = ""
    try:
        run, skipped, stop, looped = run_notebook(nb, path.parent.resolve(), names + ["serve"] * capstone, timeout,
                                                   max_output)
    except GradingStopped:
        raise
    except Exception as e:  # nbformat rejecting an output, a folder the notebook swapped: its run, not its grade
        run, skipped, stop, looped = nb, {}, None, {}
        broken = f"the notebook's run broke off ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
    found = sources(nb)
    reports, scores = {}, {}
    with stopped_by_signals():  # a function's process is killed, and grading stops
        for name, (ex, cases, expected) in plans.items():
            most = sum(c.points for c in cases)
            if name in looped:
                reports[name] = (f"check {name}: FAILED: your function ran past the {timeout} s timeout in "
                                 f"{cell_name(nb, looped[name])} (an endless loop?); the grader does not call it "
                                 "again", False)
                scores[name] = (0.0, most, "stopped")
                continue
            if name not in found:
                reports[name], scores[name] = _not_defined(run, name), (0.0, most, "not defined")
                continue
            answers, notes = call_in_fresh_process(name, found[name], cases, timeout)
            if answers is None:
                reports[name] = (f"check {name}: FAILED: {_no_answers(notes, timeout)}", False)
                scores[name] = (0.0, most, "stopped" if notes in ("timeout", "died") else "failed")
                continue
            if not answers:  # its definition raised in the fresh process
                reports[name] = (f"check {name}: FAILED: " + "; ".join(notes), False)
                scores[name] = (0.0, most, "failed")
                continue
            report = grade(ex, cases, expected, answers)
            report.calls = list(dict.fromkeys(c for a in answers for c in a.calls))
            text = str(report) + "".join(f"\n  note: {n}" for n in notes)
            reports[name] = (text, report.passed)
            status = "passed" if report.passed else "forbidden" if report.forbidden else "failed"
            scores[name] = (report.points, report.max_points, status)
        if capstone:
            reports["serve"], scores["serve"] = grade_capstone(nb, timeout, run, looped)
    n_student = len(nb.cells)
    errors = [f"{cell_name(nb, i)} raised {error_text(o)}" for i, c in enumerate(run.cells[:n_student])
              if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    stops = [(i, why, "; graded without it") for i, why in skipped.items()] + ([(*stop, "")] if stop else [])
    lines = [_stop_text("its start" if index < 0 else cell_name(nb, index), why, timeout, max_output) + then
             for index, why, then in stops] + ([broken] if broken else [])
    return NotebookResult(path, reports, errors, "\n".join(lines), scores)


def grade_capstone(nb: nbformat.NotebookNode, timeout: int, run: nbformat.NotebookNode | None = None,
                   looped: dict[str, int] | None = None):
    """The capstone's row: the notebook's ``serve``, in a process of its own with the provided model (the
    engine switched off), called with the pieces the notebook defines on the capstone's prompts in each of its
    settings (``capstone.grade_serve``: a point per prompt and setting whose tokens are ``minillm.LLM``'s).
    ``run``: the notebook as the kernel left it (default ``nb``); ``looped``: the functions that ran out of time
    there. Returns (the report's text and whether it passed, (points, max points, status))."""
    from . import capstone, capstone_kit

    run, looped = nb if run is None else run, looped or {}

    most = float(len(capstone_kit.SETTINGS) * len(capstone_kit.PROMPTS))
    if "serve" in looped:
        return ((f"check serve: FAILED: your serving loop ran past the {timeout} s timeout in "
                 f"{cell_name(nb, looped['serve'])} (an endless loop?); the grader does not call it again", False),
                (0.0, most, "stopped"))
    found = capstone_source(nb, capstone_kit.PIECES)
    if found is None:
        return _not_defined(run, "serve"), (0.0, most, "not defined")
    source, pieces = found
    model, prompts, expected = capstone.grading_setup()
    cases = [Case(setting, (prompts, dict(kwargs))) for setting, kwargs in capstone_kit.SETTINGS.items()]
    provided = {"model": model, "switched_off": [n for n in capstone.__all__ if n not in capstone_kit.__all__]}
    answers, notes = call_in_fresh_process("serve", source, cases, timeout, tools=capstone.TOOLS, capstone=provided)
    if answers is None:
        return (f"check serve: FAILED: {_no_answers(notes, timeout)}", False), (
            0.0, most, "stopped" if notes in ("timeout", "died") else "failed")
    if not answers:  # its definition raised in the fresh process
        return (f"check serve: FAILED: " + "; ".join(notes), False), (0.0, most, "failed")
    report = capstone.grade_serve(answers, expected, list(capstone_kit.SETTINGS))
    if "schedule_step" not in pieces:
        notes.append("no schedule_step in the notebook: your loop was given default_schedule_step")
    text = str(report) + "".join(f"\n  note: {n}" for n in notes)
    status = "passed" if report.passed else "forbidden" if report.forbidden else "failed"
    return (text, report.passed), (report.points, report.max_points, status)


def _no_answers(why: str, timeout: int) -> str:
    if why == "timeout":
        return (f"your function ran past the {timeout} s timeout on its cases (an endless loop?); its process "
                "was killed")
    if why == "died":
        return "its process died while your function ran (os._exit, a crash or out of memory)"
    return why


def _stop_text(where: str, why: str, timeout: int, max_output: int) -> str:
    if why == "timeout":
        return f"{where} ran past the {timeout} s timeout (--timeout); its kernel was killed"
    if why == "flood":
        return f"{where} printed more than {max_output:,} characters (--max-output); its kernel was killed"
    return f"the kernel died in {where} (os._exit, a crash or out of memory)"


def _not_defined(nb: nbformat.NotebookNode, name: str) -> tuple[str, None]:
    """The report of an exercise function that no code cell defines at its top level, and why."""
    defining = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                and re.search(rf"^\s*def {name}\(", c.source, re.MULTILINE)]
    raised = [f"{cell_name(nb, i)}, which defines it, raised {error_text(o)}" for i in defining
              for o in nb.cells[i].get("outputs", []) if o.get("output_type") == "error"]
    if raised:
        return f"check {name}: not defined ({raised[0]})", None
    if defining:
        return (f"check {name}: not defined ({cell_name(nb, defining[-1])} defines it inside other code; the "
                f"grader takes `def {name}(` at the top of a cell)"), None
    return f"check {name}: not defined (did its cell run?)", None
