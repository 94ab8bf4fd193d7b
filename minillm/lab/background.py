"""Other programs on the CPU, on purpose: ``background_load(n)`` runs n CPU-bound processes beside a
benchmark (``serve-bench --background-load N``, notebook 01a), so that the busy-machine figures are one
command. A student's laptop is never idle; this is the browser or the video call, made repeatable.

Each process spins in pure Python until the block ends, ``limit_s`` passes, or its parent is gone
(it checks every few milliseconds), so none outlives the benchmark even when that is killed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

#: seconds a background process spins at most when nothing stops it
LIMIT_S = 1800.0

_SPIN = """
import os, sys, time
parent, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < end and os.getppid() == parent:
    t = time.monotonic() + 0.005
    while time.monotonic() < t:
        pass
"""


def busy_note(n: int) -> str:
    """What a report's machine line adds when ``n`` background processes ran beside it ("" for none)."""
    return f"; {n} CPU-bound background process{'es' * (n != 1)} ran beside it" if n else ""


def check_load(n: int, limit_s: float = LIMIT_S) -> None:
    """Raises ValueError (naming the field) unless 0 <= n <= 64 and limit_s > 0."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 64:
        raise ValueError(f"--background-load: the number of CPU-bound processes must be an integer in 0..64, got "
                         f"{n!r}; one per core is already a fully busy machine")
    if not limit_s > 0:
        raise ValueError(f"limit_s: seconds the processes may spin must be positive, got {limit_s!r}")


@contextlib.contextmanager
def background_load(n: int, limit_s: float = LIMIT_S):
    """Run ``n`` CPU-bound processes while the block runs; yields their pids. They are stopped (terminated,
    then killed if they linger) when the block ends, also on an error or Ctrl-C.

    Raises:
        ValueError: ``n`` or ``limit_s`` out of range (``check_load``).
    """
    check_load(n, limit_s)
    procs = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(os.getpid()), str(limit_s)],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        yield [p.pid for p in procs]
    finally:
        stop(procs)


def stop(procs) -> None:
    """Terminate ``procs`` (``subprocess.Popen``), wait for each, kill those still there after 5 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
