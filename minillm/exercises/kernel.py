"""A student's notebook run in a Jupyter kernel (nbclient), for what its cells print and raise: the kernel is
this Python whatever the notebook names; a cell that runs past its timeout (the kernel's stacks say which
exercise function was running), kills its kernel or floods the output is skipped and the notebook run again
without it, and a function that ran out of time is not called again; SIGINT and SIGTERM kill the kernel and
stop the grading (``GradingStopped``). ``grading.py`` judges what the run defines.
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
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import nbformat

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
MAX_OUTPUT = 1_000_000  # characters of output a notebook may print in all (a flood is stopped)
MAX_RERUNS = 3  # runs without a stopped cell, at most


class GradingStopped(Exception):
    """SIGINT or SIGTERM arrived while a notebook ran: its kernel is killed, and grading stops."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}; the student's kernel was killed")
        self.signum = signum


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


def _functions_running(stacks: str, names: list[str]) -> list[str]:
    """The exercise functions in a kernel's stack dump (faulthandler's), innermost frames first, in the
    student's cells only (the package has methods of the same names)."""
    found = re.findall(r'File "([^"]+)", line \d+ in (\w+)', stacks)
    return list(dict.fromkeys(fn for filename, fn in found if fn in names
                              and not filename.startswith(str(Path(__file__).parents[1]))
                              and "site-packages" not in filename))


def run_notebook(nb: nbformat.NotebookNode, cwd: Path, names: list[str], timeout: int, max_output: int):
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


@contextmanager
def stopped_by_signals():
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
