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

A cell that runs past nbclient's timeout (its kernel's process group is killed), kills its kernel or floods
the output (over ``max_output`` characters) is skipped and the notebook run again without it; an exercise
function that was running when the time ran out is not called again (later cells get an error in its place,
and it is not graded). SIGINT and SIGTERM kill the kernel and stop the grading (``GradingStopped``). A
notebook that nbformat rejects, or that breaks the run in any other way, fails its own rows with a line
saying why. This is no sandbox (notebooks/exercises/README.md shows how to grade in a container).
"""

from __future__ import annotations

import asyncio
import copy
import os
import re
import signal
import sys
import tempfile
import threading
import warnings
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import nbformat

from . import EXERCISES, runner
from .checker import Case, grade
from .isolate import call_in_fresh_process, capstone_source, sources
from .notebooks import exercise_names, is_capstone

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
# The notebook's kernel: run for what the cells print and raise


# exit() and quit() would shut the kernel down after their cell, and the next cell would take the blame: they
# raise in their own cell instead. On SIGUSR1 the kernel writes its threads' stacks (which function was running
# when a cell ran out of time) to the file the grader names.
_SETUP = """def _minillm_no_exit(*args, **kwargs):
    raise SystemExit("exit() and quit() do not end a graded notebook; the grader goes on with the next cell")
get_ipython().user_ns.update(exit=_minillm_no_exit, quit=_minillm_no_exit)
del _minillm_no_exit
import faulthandler as _minillm_fh, signal as _minillm_signal
_minillm_fh.register(_minillm_signal.SIGUSR1, file=open({stacks!r}, "w"), all_threads=True)
del _minillm_fh, _minillm_signal"""

# in a run after a function ran out of time: after every cell, that function's name holds one that raises at once
_NOT_AGAIN = """def _minillm_not_again(*args, names={names!r}):
    ns = get_ipython().user_ns
    for name in names:
        if callable(ns.get(name)) and not getattr(ns[name], "_minillm_stopped", False):
            def stopped(*args, _name=name, **kwargs):
                raise TimeoutError(f"{{_name}} ran past the grader's timeout in an earlier cell; the grader does "
                                   "not call it again")
            stopped._minillm_stopped = True
            ns[name] = stopped
get_ipython().events.register("post_run_cell", _minillm_not_again)
del _minillm_not_again"""


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


def _client(nb: nbformat.NotebookNode, cwd: Path, timeout: int, max_output: int, setup: str):
    """nbclient's ``NotebookClient`` that runs ``setup`` silently first, records the cell it runs, asks the
    kernel for its stacks before a timeout kills it, and, on SIGINT or SIGTERM or when the notebook's output
    passes ``max_output`` characters, kills the kernel and ends the run (nbclient's own handlers kill the
    kernel but let the run go on)."""
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
                await self.kc.execute_interactive(setup, silent=True, store_history=False, timeout=60)
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

        async def _async_handle_timeout(self, timeout, cell=None):
            process = getattr(getattr(self.km, "provisioner", None), "process", None)
            if process is not None:
                try:
                    process.send_signal(signal.SIGUSR1)  # faulthandler writes the stacks (see _SETUP)
                    await asyncio.sleep(1)
                except (ProcessLookupError, OSError):
                    pass
            return await super()._async_handle_timeout(timeout, cell)

        async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
            self.running = cell_index
            return await super().async_execute_cell(cell, cell_index, *args, **kwargs)

    return Client(nb, km=_kernel_manager(), timeout=timeout, allow_errors=True, shutdown_kernel="immediate",
                  resources={"metadata": {"path": str(cwd)}})


def _execute(nb: nbformat.NotebookNode, cwd: Path, timeout: int, max_output: int = MAX_OUTPUT,
             setup: str = "") -> tuple[int, str] | None:
    """Run ``setup`` (silently), then every cell; None, or (index of the cell the kernel stopped in, -1 when
    it stopped as it started; "timeout", "died" or "flood").

    Raises:
        GradingStopped: SIGINT or SIGTERM arrived (the kernel is killed first).
    """
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    client = _client(nb, cwd, timeout, max_output, setup or "pass")
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


def _functions_running(stacks: str, names: list[str]) -> list[str]:
    """The exercise functions in a kernel's stack dump (faulthandler's), innermost frames first, in the
    student's cells only (the package has methods of the same names)."""
    found = re.findall(r'File "([^"]+)", line \d+ in (\w+)', stacks)
    return list(dict.fromkeys(fn for filename, fn in found if fn in names
                              and not filename.startswith(str(Path(runner.__file__).parents[1]))
                              and "site-packages" not in filename))


def _run_notebook(nb: nbformat.NotebookNode, cwd: Path, names: list[str], timeout: int, max_output: int):
    """Run the notebook, skipping each cell that is stopped (``MAX_RERUNS`` times at most): (the last run,
    {cell index: why it was stopped}, the final stop or None, {function: cell index where it ran out of time})."""
    skipped: dict[int, str] = {}
    looped: dict[str, int] = {}
    fd, stacks = tempfile.mkstemp(prefix="minillm-grading-", suffix=".stacks")
    os.close(fd)
    try:
        for attempt in range(MAX_RERUNS + 1):
            run = nbformat.from_dict(copy.deepcopy(nb))
            for i in skipped:
                run.cells[i] = nbformat.v4.new_code_cell("# skipped by the grader (see the stopped: lines)")
            setup = _SETUP.format(stacks=stacks) + ("\n" + _NOT_AGAIN.format(names=sorted(looped)) if looped else "")
            stop = _execute(run, cwd, timeout, max_output, setup=setup)
            if stop is not None and stop[1] == "timeout" and stop[0] >= 0:
                try:
                    dump = Path(stacks).read_text(encoding="utf-8", errors="replace")
                except OSError:
                    dump = ""
                candidates = [n for n in names if n not in looped]
                running = _functions_running(dump, candidates)
                if "File " not in dump:  # no stacks came (the notebook took SIGUSR1): the functions the cell calls
                    running = [n for n in candidates if re.search(rf"\b{n}\s*\(", run.cells[stop[0]].source)]
                for fn in running[:1]:
                    looped[fn] = stop[0]
            if stop is None or stop[0] < 0 or attempt == MAX_RERUNS:
                break
            skipped[stop[0]] = stop[1]
    finally:
        try:
            os.remove(stacks)
        except OSError:
            pass
    return run, skipped, stop, looped


def check_notebook(path: Path, timeout: int = 120, *, grading: bool = False, seed: int | None = None,
                   extra: dict[str, list[Case]] | None = None, max_output: int = MAX_OUTPUT) -> NotebookResult:
    """Execute a student's notebook in a fresh kernel (its own folder as working directory, cells that
    raise do not stop the run, ``timeout`` seconds per cell), then call each exercise function it defines
    in a process of its own (``call_in_fresh_process``, ``timeout`` seconds for all its cases) and judge the
    answers here. ``grading``: the practice cases and the unseen ones (``Exercise.grading_cases(seed,
    extra[name])``). A cell stopped for time, a dead kernel or a flood of output is skipped and the notebook
    run again without it (``MAX_RERUNS`` times at most); a function that ran out of time there is not called
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
        run, skipped, stop, looped = _run_notebook(nb, path.parent.resolve(), names + ["serve"] * capstone, timeout,
                                                   max_output)
    except GradingStopped:
        raise
    except Exception as e:  # nbformat rejecting an output, a folder the notebook swapped: its run, not its grade
        run, skipped, stop, looped = nb, {}, None, {}
        broken = f"the notebook's run broke off ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
    found = sources(nb)
    reports, scores = {}, {}
    with _stopped_by_signals():  # a function's process is killed, and grading stops
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


@contextmanager
def _stopped_by_signals():
    """SIGINT and SIGTERM raise ``GradingStopped`` in the block (in the main thread), so that the process of
    the function being graded is killed (``call_in_fresh_process``'s cleanup) before grading stops."""
    def stop(signum, frame):
        raise GradingStopped(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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
