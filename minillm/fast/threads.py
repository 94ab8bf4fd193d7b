"""How a step's threads wait and how many there are, chosen for a CPU that other programs share.

Why: every multi-threaded operation of a step ends at a barrier that waits for its slowest thread, and a
step runs a few hundred of them. GNU OpenMP (torch's) lets a thread that reaches a barrier spin about
300,000 rounds before it sleeps: on a shared core the spinning thread burns the time slice its
descheduled partner needs (docs/decode.md measures how much). So ``ThreadGovernor`` keeps one thread per
core that other processes leave free. Spinning stays the default because it is what makes a step fast on
a quiet machine; a user who shares the CPU may set ``OMP_WAIT_POLICY=PASSIVE`` before torch loads, and
then every usable core is used.

``choose_threads`` is the rule (a pure function); ``others_busy`` turns two readings of /proc/stat and of
this process's CPU time into the cores other processes used; the governor re-reads them every
``INTERVAL_S`` (the step itself is the probe) and sets ``torch.set_num_threads``. ``Linear``'s column shards
follow the cores, not the threads. ``OMP_NUM_THREADS``/``MINILLM_THREADS`` or ``torch.set_num_threads`` fix the count.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass

import torch

#: a core counts as free when other processes leave at least this share of it: a thread on a core that is
#: busier than that is descheduled at too many of a step's barriers to pay for itself
FREE_SHARE = 0.75
#: seconds between two readings of the machine's load during a run
INTERVAL_S = 2.0


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and ``taskset`` narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def choose_threads(usable: int, others: float | None, passive: bool = False, free_share: float = FREE_SHARE) -> int:
    """Threads for the next steps: every usable core when waiting threads sleep (``passive``), else one
    per usable core that other processes leave free.

    Args:
        usable: cores this process may run on (``usable_cores``).
        others: cores other processes kept busy lately (``others_busy``), or None when unknown (then
            every usable core is used, torch's own default).
        passive: whether idle OpenMP threads sleep rather than spin (``waits_passively``).
        free_share: the share of a core that must be free for a thread on it (``FREE_SHARE``).

    Returns:
        an int in 1..usable.

    Raises:
        ValueError: usable below 1, or free_share outside (0, 1].
    """
    if usable < 1:
        raise ValueError(f"usable: must be at least 1 core, got {usable}")
    if not 0 < free_share <= 1:
        raise ValueError(f"free_share: must be in (0, 1], got {free_share}")
    if passive or others is None or math.isnan(others):
        return usable
    free = usable - max(0.0, others)
    return max(1, min(usable, math.floor(free + 1 - free_share + 1e-9)))


@dataclass(frozen=True)
class Sample:
    """One reading: jiffies the whole machine spent busy and in total (/proc/stat's ``cpu`` line), this
    process's CPU seconds (all its threads) and the wall clock."""
    busy_jiffies: int
    total_jiffies: int
    own_cpu_s: float
    wall_s: float


def read_sample(stat: str = "/proc/stat") -> Sample | None:
    """The machine's and this process's counters now; None where /proc/stat cannot be read (not Linux)."""
    try:
        with open(stat) as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait; steal counts as busy
    except (OSError, ValueError, IndexError):
        return None
    return Sample(sum(values) - idle, sum(values), time.process_time(), time.monotonic())


def others_busy(before: Sample, after: Sample, cores: int) -> float | None:
    """Cores other processes kept busy between two samples: the machine's busy share times its cores,
    less this process's own CPU time over the wall time. None when no time passed."""
    total = after.total_jiffies - before.total_jiffies
    wall = after.wall_s - before.wall_s
    if total <= 0 or wall <= 0:
        return None
    machine = (after.busy_jiffies - before.busy_jiffies) / total * cores
    own = (after.own_cpu_s - before.own_cpu_s) / wall
    return max(0.0, machine - own)


def waits_passively(environ=None) -> bool:
    """Whether OpenMP's waiting threads sleep rather than spin: ``OMP_WAIT_POLICY=PASSIVE``, or a
    ``GOMP_SPINCOUNT`` of at most 1000 rounds (measured as fast as passive on a crowded machine). Read from
    the environment, which ``minillm/__init__`` sets before torch loads (libgomp reads it then, once)."""
    env = os.environ if environ is None else environ
    spins = env.get("GOMP_SPINCOUNT", "").strip()
    if spins.isdigit():
        return int(spins) <= 1000
    return env.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def fixed_by_user() -> int | None:
    """The thread count the environment fixes (``MINILLM_THREADS``, else ``OMP_NUM_THREADS``), or None."""
    for name in ("MINILLM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return None


class ThreadGovernor:
    """Sets torch's thread count from the machine's load: ``fit(probe_s)`` at once (a short sleep is the
    probe), ``tick()`` from a step (every ``interval`` seconds it re-reads the counters, else it costs one
    clock read). Does nothing when the environment fixes the count (``fixed_by_user``) or ``enabled`` is
    False; ``last`` holds the latest choice, ``others`` what it was chosen from."""

    def __init__(self, interval: float = INTERVAL_S):
        self.interval = interval
        self.enabled = fixed_by_user() is None
        self.passive = waits_passively()
        self.cores = usable_cores()
        self.last: int | None = None
        self.others: float | None = None
        self._expected = torch.get_num_threads()  # the count it last saw or set: anything else is the user's
        self._sample = read_sample()

    def fit(self, probe_s: float = 0.1) -> int:
        """Probe the load for ``probe_s`` seconds and set the threads; returns torch's thread count."""
        if self.enabled and self.passive:  # waiting threads sleep: every usable core pays (no probe needed)
            if torch.get_num_threads() != self._expected:  # the user's own count
                self.enabled = False
            else:
                torch.set_num_threads(self.cores)
                self.last = self._expected = self.cores
        elif self.enabled:
            self._sample = read_sample()
            time.sleep(probe_s)
            self._update()
        return torch.get_num_threads()

    def tick(self) -> None:
        """From a step: re-choose when ``interval`` seconds have passed since the last reading."""
        if self.enabled and not self.passive and self._sample is not None and time.monotonic() - self._sample.wall_s >= self.interval:
            self._update()

    def _update(self) -> None:
        if torch.get_num_threads() != self._expected:  # set by the user (or a --threads option): theirs wins
            self.enabled = False
            return
        now = read_sample()
        if now is None or self._sample is None:
            return
        others = others_busy(self._sample, now, os.cpu_count() or self.cores)
        self._sample = now
        if others is None:
            return
        self.others = others
        n = choose_threads(self.cores, others, passive=self.passive)
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self.last = self._expected = n


@contextlib.contextmanager
def torch_default_threads():
    """Run the block with torch's own default (one thread per usable core), the governor paused: how a
    peer (transformers) runs when nothing chooses for it. A count the user fixed stays as it is. The
    previous count and state come back after the block."""
    enabled, before = GOVERNOR.enabled, torch.get_num_threads()
    if enabled:
        GOVERNOR.enabled = False
        torch.set_num_threads(usable_cores())
    try:
        yield
    finally:
        torch.set_num_threads(before)
        GOVERNOR.enabled = enabled


def fix_threads(n: int) -> None:
    """Use ``n`` threads from now on and stop the governor (a command's ``--threads``)."""
    GOVERNOR.enabled = False
    torch.set_num_threads(n)


#: the process's governor: ``minillm.fast.accelerate`` fits it, and ticks it before every forward of the model
GOVERNOR = ThreadGovernor()
