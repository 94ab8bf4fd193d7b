"""Ctrl-C (a Jupyter interrupt too) waits while the engine does its bookkeeping.

A step undoes itself exactly when an interrupt lands in the forward or the draw, where the time goes; in
the bookkeeping around them (a few milliseconds) an interrupt halfway through a list update would leave a
sequence in neither list. So there SIGINT is held and raised as soon as the state is whole again.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


@contextmanager
def interrupts_deferred():
    """Hold SIGINT until the block ends, then raise it through the installed handler; outside the main
    thread, where Python delivers no SIGINT, do nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    except (ValueError, TypeError):  # no signal handling here (an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])
        elif caught and previous == signal.SIG_DFL:
            raise KeyboardInterrupt
