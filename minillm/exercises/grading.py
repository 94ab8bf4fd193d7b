"""Grading a student's notebook (``python -m minillm exercises check``): the notebook runs in a Jupyter
kernel, the kernel calls each exercise function on the grader's cases and saves what came back, and
the grader judges those answers in its own process.

The kernel is trusted with nothing but the function's outputs. The grader draws the cases and their
expected answers before the kernel starts and appends one cell per exercise that calls ``answer_cases``:
each case's return value (made ``checker.portable``) or error goes to a file the grader named, read back
with ``torch.load(weights_only=True)`` (plain data, no code runs) and judged by the exercise's own judge,
so a kernel that replaces ``minillm.exercises.check`` changes nothing the grader reads. While a
function's cases run, the package code it replaces raises (``forbid.py``); ``--grading`` adds cases the
student never saw (``Exercise.grading_cases``). A cell that runs past nbclient's timeout (its kernel's
process group is killed), kills its kernel or floods the output (over ``max_output`` characters) is
skipped and the notebook run again without it. SIGINT and SIGTERM kill the kernel and stop the grading
(``GradingStopped``). This is no sandbox (notebooks/exercises/README.md shows how to grade in a container).
"""

from __future__ import annotations

import asyncio
import copy
import re
import signal
import sys
import tempfile
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import nbformat
import torch

from . import EXERCISES
from .checker import Answer, Case, Exercise, Foreign, answer, grade
from .forbid import forbidden
from .notebooks import exercise_names

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
MAX_OUTPUT = 1_000_000  # characters of output a notebook may print in all (a flood is stopped)
MAX_RERUNS = 3  # runs without a stopped cell, at most


class NotANotebookError(ValueError):
    """A path to check that is no notebook: missing, or not notebook JSON (bad input, not a failed grade)."""


class GradingStopped(Exception):
    """SIGINT or SIGTERM arrived while a notebook ran: its kernel is killed, and grading stops."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}; the student's kernel was killed")
        self.signum = signum


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


# ---------------------------------------------------------------------------------------------
# The kernel's side


_NO_EXIT = """def _minillm_no_exit(*args, **kwargs):
    raise SystemExit("exit() and quit() do not end a graded notebook; the grader goes on with the next cell")
get_ipython().user_ns.update(exit=_minillm_no_exit, quit=_minillm_no_exit)
del _minillm_no_exit"""

_ANSWER_CELL = """from minillm.exercises.grading import answer_cases as _answer_cases
_answer_cases({name!r}, globals().get({name!r}), {cases!r}, {answers!r})"""


def answer_cases(name: str, fn, cases_path: str, answers_path: str) -> None:
    """In the student's kernel: call ``fn`` on each case's arguments in ``cases_path``, with the package
    code exercise ``name`` replaces switched off, and save the ``Answer``s to ``answers_path`` (nothing
    when ``fn`` is not a function: the grader says "not defined")."""
    if not callable(fn):
        return
    cases = torch.load(cases_path, weights_only=False)  # the grader's file: configs are dataclasses
    answers = []
    for args in cases:
        with forbidden(name, EXERCISES[name].forbidden):
            answers.append(answer(fn, args))
    torch.save(answers, answers_path)


# ---------------------------------------------------------------------------------------------
# The grader's side


def _read_answers(path: Path, n_cases: int) -> list[Answer] | str:
    """The kernel's answers, read as plain data only, or why they cannot be used."""
    try:
        with torch.serialization.safe_globals([Answer, Foreign]):
            answers = torch.load(path, weights_only=True)
    except Exception as e:  # the kernel wrote the file: anything may be in it
        return f"its answers could not be read back ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    if not (isinstance(answers, list) and len(answers) == n_cases and all(
            type(a) is Answer and isinstance(a.args, tuple)
            and all(isinstance(t, str) for t in (a.error, a.message, a.where)) for a in answers)):
        return f"its answers file does not hold {n_cases} answers"
    return answers


def _kernel_manager():
    """An asynchronous kernel manager that starts this Python (the one with minillm installed), whatever
    kernel the notebook names (nbval's --nbval-current-env does the same). Asynchronous, because nbclient
    waits on a synchronous one's channels with the event loop blocked, and its timeout never fires."""
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            # log level ERROR: the kernel warns on every start that it listens on localhost without encryption
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                                    "--IPKernelApp.log_level=ERROR"],
                              display_name="minillm exercises", language="python")

    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnv())


def _client(nb: nbformat.NotebookNode, cwd: Path, timeout: int, max_output: int):
    """nbclient's ``NotebookClient`` that records the cell it runs and, on SIGINT or SIGTERM or when the
    notebook's output passes ``max_output`` characters, kills the kernel and ends the run (nbclient's
    own handlers kill the kernel but let the run go on)."""
    from nbclient import NotebookClient

    class Client(NotebookClient):
        running = -1  # index of the cell being executed (-1: the kernel is starting)
        stopped_by: int | None = None  # the signal that stopped the run
        printed = 0  # characters of output so far
        flooded = False
        main_task = None

        @asynccontextmanager
        async def async_setup_kernel(self, **kwargs):
            loop, task, previous = asyncio.get_running_loop(), asyncio.current_task(), {}
            self.main_task = task
            for signum in STOP_SIGNALS:
                try:
                    previous[signum] = signal.getsignal(signum)
                    loop.add_signal_handler(signum, self._stop, signum, task)
                except (RuntimeError, ValueError):  # not the main thread: the caller handles its signals
                    previous.pop(signum, None)
            try:
                await self.async_start_new_kernel(**kwargs)
                await self.async_start_new_kernel_client()
                # exit() and quit() would shut the kernel down after their cell, and the next cell would take
                # the blame: they raise in their own cell instead
                await self.kc.execute_interactive(_NO_EXIT, silent=True, store_history=False, timeout=60)
                yield
            finally:
                await self._async_cleanup_kernel()  # shutdown_kernel="immediate": SIGKILL to its process group
                for signum, handler in previous.items():
                    loop.remove_signal_handler(signum)
                    if handler is not None:  # None: a handler installed outside Python, which cannot be restored
                        signal.signal(signum, handler)

        def _stop(self, signum, task):
            if self.stopped_by is None:  # a second signal must not cancel the cleanup that kills the kernel
                self.stopped_by = signum
                task.cancel()  # the cell being awaited ends at once, then the cleanup above kills the kernel

        def output(self, outs, msg, display_id, cell_index):
            if self.flooded:
                return None
            self.printed += len(str(msg.get("content", "")))
            if self.printed > max_output:  # kept from the grader's memory; the kernel is killed
                self.flooded = True
                self.main_task.cancel()
                return None
            return super().output(outs, msg, display_id, cell_index)

        async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
            self.running = cell_index
            return await super().async_execute_cell(cell, cell_index, *args, **kwargs)

    return Client(nb, km=_kernel_manager(), timeout=timeout, allow_errors=True, shutdown_kernel="immediate",
                  resources={"metadata": {"path": str(cwd)}})


def _execute(nb: nbformat.NotebookNode, cwd: Path, timeout: int,
             max_output: int = MAX_OUTPUT) -> tuple[int, str] | None:
    """Run every cell; None, or (index of the cell the kernel stopped in, -1 when it stopped as it started;
    "timeout", "died" or "flood").

    Raises:
        GradingStopped: SIGINT or SIGTERM arrived (the kernel is killed first).
    """
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    client = _client(nb, cwd, timeout, max_output)
    try:
        client.execute()
    except BaseException as e:  # the signal's cancellation reaches here as whatever nbclient makes of it
        if client.stopped_by is not None:
            raise GradingStopped(client.stopped_by) from None
        if client.flooded:
            return client.running, "flood"
        if isinstance(e, (CellTimeoutError, DeadKernelError)):
            return client.running, "timeout" if isinstance(e, CellTimeoutError) else "died"
        raise
    if client.stopped_by is not None:  # the signal came between two cells
        raise GradingStopped(client.stopped_by)
    return None


def _read(path: Path) -> nbformat.NotebookNode:
    try:
        return nbformat.read(path, as_version=4)
    except (OSError, nbformat.reader.NotJSONError, nbformat.ValidationError) as e:
        raise NotANotebookError(f"{path}: not a notebook ({e})") from None


def check_notebook(path: Path, timeout: int = 600, *, grading: bool = False, seed: int | None = None,
                   extra: dict[str, list[Case]] | None = None, max_output: int = MAX_OUTPUT) -> NotebookResult:
    """Execute a student's notebook in a fresh kernel (its own folder as working directory, cells that
    raise do not stop the run, ``timeout`` seconds per cell) and judge each exercise function it defines
    on the answers its kernel saved. ``grading``: the practice cases and the unseen ones
    (``Exercise.grading_cases(seed, extra[name])``). A cell stopped for time, a dead kernel or a flood of
    output is skipped and the notebook run again without it (``MAX_RERUNS`` times at most).

    Raises:
        NotANotebookError: no such file, or not a notebook. ValueError: it defines none of the exercise
            functions. GradingStopped: SIGINT or SIGTERM (the kernel is killed).
    """
    path = Path(path)
    nb = _read(path)
    names = exercise_names(nb)
    if not names:
        raise ValueError(f"{path}: defines none of the exercise functions ({', '.join(EXERCISES)})")
    # cases and expected answers are worked out before the student's code runs
    plans = {}
    for name in names:
        ex = EXERCISES[name]
        cases = ex.grading_cases(seed, (extra or {}).get(name, ())) if grading else ex.cases()
        plans[name] = (ex, cases, [ex.expected(c) for c in cases])
    n_student = len(nb.cells)
    skipped: dict[int, str] = {}  # cell index -> why it was stopped
    with tempfile.TemporaryDirectory(prefix="minillm-grading-") as tmp:
        folder = Path(tmp)
        for name, (_, cases, _) in plans.items():
            torch.save([c.args for c in cases], folder / f"{name}.cases.pt")
            nb.cells.append(nbformat.v4.new_code_cell(_ANSWER_CELL.format(
                name=name, cases=str(folder / f"{name}.cases.pt"), answers=str(folder / f"{name}.answers.pt"))))
        for attempt in range(MAX_RERUNS + 1):
            run = nbformat.from_dict(copy.deepcopy(nb))
            for i in skipped:
                run.cells[i] = nbformat.v4.new_code_cell("# skipped by the grader (see the stopped: lines)")
            for stale in folder.glob("*.answers.pt"):  # answers of an earlier run do not count
                stale.unlink()
            stop = _execute(run, path.parent.resolve(), timeout, max_output)
            if stop is None or stop[0] < 0 or attempt == MAX_RERUNS:
                break
            skipped[stop[0]] = stop[1]
        reports, scores = {}, {}
        for k, (name, (ex, cases, expected)) in enumerate(plans.items()):
            answers = folder / f"{name}.answers.pt"
            read = _read_answers(answers, len(cases)) if answers.exists() else None
            if isinstance(read, list):
                report = grade(ex, cases, expected, read)
                reports[name] = (str(report), report.passed)
                status = "passed" if report.passed else "forbidden" if report.forbidden else "failed"
                scores[name] = (report.points, report.max_points, status)
            else:
                reports[name], status = _unanswered(run, ex, n_student + k, stop, skipped, timeout, max_output, read)
                scores[name] = (0.0, sum(c.points for c in cases), status)
    errors = [f"{cell_name(nb, i)} raised {error_text(o)}" for i, c in enumerate(run.cells[:n_student])
              if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    stops = [(i, why, "; graded without it") for i, why in skipped.items()] + ([(*stop, "")] if stop else [])
    lines = []
    for index, why, then in stops:
        where = ("its start" if index < 0 else cell_name(nb, index) if index < n_student
                 else f"the checks of {names[index - n_student]}")
        lines.append(_stop_text(where, why, timeout, max_output) + then)
    return NotebookResult(path, reports, errors, "\n".join(lines), scores)


def _stop_text(where: str, why: str, timeout: int, max_output: int) -> str:
    if why == "timeout":
        return f"{where} ran past the {timeout} s timeout (--timeout); its kernel was killed"
    if why == "flood":
        return f"{where} printed more than {max_output:,} characters (--max-output); its kernel was killed"
    return f"the kernel died in {where} (os._exit, a crash or out of memory)"


def _unanswered(nb: nbformat.NotebookNode, ex: Exercise, index: int, stop: tuple[int, str] | None,
                skipped: dict[int, str], timeout: int, max_output: int, unreadable: str | None) -> tuple[tuple, str]:
    """The report of an exercise whose answers did not come back, why in one line, and its status."""
    name = ex.name
    if unreadable:
        return (f"check {name}: FAILED: {unreadable}", False), "failed"
    why = skipped.get(index) or (stop[1] if stop is not None and stop[0] == index else None)
    if why == "timeout":
        return (f"check {name}: FAILED: your function ran past the {timeout} s timeout on its cases (an endless "
                "loop?); its kernel was killed", False), "stopped"
    if why == "flood":
        return (f"check {name}: FAILED: your function printed more than {max_output:,} characters on its cases; "
                "its kernel was killed", False), "stopped"
    if why:
        return (f"check {name}: FAILED: the kernel died while your function ran (os._exit, a crash or out of "
                "memory)", False), "stopped"
    if stop is not None and stop[0] < index:
        return (f"check {name}: FAILED: not checked: the kernel stopped before its checks (see below)", False), \
            "not checked"
    errors = [error_text(o) for o in nb.cells[index].get("outputs", []) if o.output_type == "error"]
    if errors:  # the checks could not run in the kernel (minillm missing there?)
        return (f"check {name}: FAILED: could not run ({'; '.join(errors)})", False), "failed"
    defining = [i for i, c in enumerate(nb.cells[:index]) if c.cell_type == "code"
                and re.search(rf"^\s*def {name}\(", c.source, re.MULTILINE)]
    raised = [f"{cell_name(nb, i)}, which defines it, raised {error_text(o)}" for i in defining
              for o in nb.cells[i].get("outputs", []) if o.output_type == "error"]
    return (f"check {name}: not defined ({raised[0] if raised else 'did its cell run?'})", None), "not defined"
