"""Timing on this machine: what it is, whether it is quiet, and how long the model's steps take.

The measuring rule every benchmark follows: a warm-up run, device
synchronization, several repeats, the median (``time_median``), and every number printed with the
machine (``machine``), dtype, batch size and lengths. ``measure_decode`` / ``measure_prefill`` /
``measure_verify`` time the real model's forwards; the roofline (``minillm.roofline``) sets them
against its predictions and speculative decoding's bench uses ``measure_verify`` for its cost ratio.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

import torch

from .kv_cache import KVCache


def synchronize(device: str | torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock timings cover it (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32": how reports and tables name a dtype."""
    return str(dtype).removeprefix("torch.")


def instruction_set() -> str:
    """The vector instructions torch's CPU kernels use here ("AVX512", "AVX2", ...): which int4 kernel
    inductor can generate depends on it, so every decode record names it."""
    try:
        isa = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "unknown"
    if os.environ.get("ATEN_CPU_CAPABILITY") in ("avx2", "default"):  # a cap: =avx2 runs as a CPU without AVX-512
        isa += f" by ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']}"
    return isa


def machine() -> str:
    """One line naming the CPU and its vector instructions (or the GPU), core count and torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    s = (f"{cpu} ({instruction_set()}), {os.cpu_count()} cores, torch {torch.__version__} "
         f"({threads} thread{'' if threads == 1 else 's'})")
    if torch.cuda.is_available():
        s += f", GPU {torch.cuda.get_device_name()}"
    return s


def busy_cores(seconds: float = 0.25, stat: str = "/proc/stat") -> float | None:
    """Cores that other processes keep busy while this one sleeps for ``seconds``.

    Read from the aggregate ``cpu`` line of /proc/stat (jiffies): (busy delta / total delta) x cores,
    busy being everything but idle and iowait. Timings of multi-threaded steps are only trustworthy
    when this is near 0 (a step waits for its slowest core). Returns None where /proc/stat cannot be
    read (not Linux).
    """
    def sample():
        with open(stat) as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values) - idle, sum(values)

    try:
        busy0, total0 = sample()
        time.sleep(seconds)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (busy1 - busy0) / max(1, total1 - total0) * (os.cpu_count() or 1)


def warn_if_busy(threshold: float = 0.5) -> float | None:
    """Print a warning (stderr) when other processes keep at least ``threshold`` cores busy: the
    timings about to be measured would be slow and noisy. Returns the busy cores (None if unknown)."""
    busy = busy_cores()
    if busy is not None and busy >= threshold:
        print(f"warning: other processes keep {busy:.1f} of {os.cpu_count()} cores busy; timings will be slower and "
              f"noisier than on a quiet machine (compare ratios measured in one run, not absolute numbers)",
              file=sys.stderr)
    return busy


def time_median(fn, device="cpu", repeats: int = 7, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs, device synchronized."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _random_tokens(model, shape) -> torch.Tensor:
    """Seeded random ids of the model's vocabulary (what they are does not change the work), on its device."""
    return torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(0)).to(model.device)


def check_fits(model, positions: int, what: str) -> None:
    """Raises ValueError (naming ``what``) unless 1 <= positions <= the model's context."""
    if not 1 <= positions <= model.config.max_seq_len:
        raise ValueError(f"{what}: {positions} positions do not fit the model's context of "
                         f"{model.config.max_seq_len}; measure shorter sequences")


@torch.inference_mode()
def measure_decode(model, batch_size: int = 1, context: int = 64, steps: int = 16, repeats: int = 3) -> float:
    """Median seconds of one decode step (B rows, one token each) after ``context`` cached positions,
    averaged over ``steps`` consecutive steps. ``model``: a ``Decoder`` (as ``load_model()`` returns).

    Raises:
        ValueError: batch_size < 1, or context + steps + 1 positions past the model's context.
    """
    device = model.device
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    check_fits(model, context + steps + 1, f"context {context} + {steps} decode steps + 1")
    cache = KVCache(model.config, batch_size, context + steps + 1, model.dtype, device)
    tokens = _random_tokens(model, (batch_size, context))
    model(tokens, torch.arange(context, device=device), cache)
    token = tokens[:, -1:]

    def run():
        cache.truncate(context)
        for i in range(steps):
            model(token, torch.tensor([context + i], device=device), cache)

    return time_median(run, device, repeats, warmup=1) / steps


@torch.inference_mode()
def measure_prefill(model, prompt_tokens: int, batch_size: int = 1, repeats: int = 3) -> float:
    """Median seconds of a prefill forward of ``prompt_tokens`` tokens per row into an empty cache.

    Raises:
        ValueError: prompt_tokens outside 1..the model's context.
    """
    device = model.device
    check_fits(model, prompt_tokens, "prompt_tokens")
    cache = KVCache(model.config, batch_size, prompt_tokens, model.dtype, device)
    tokens = _random_tokens(model, (batch_size, prompt_tokens))
    pos = torch.arange(prompt_tokens, device=device)

    def run():
        cache.reset()
        model(tokens, pos, cache)

    return time_median(run, device, repeats, warmup=1)


@torch.inference_mode()
def measure_verify(model, ks=range(1, 17), context: int = 64, repeats: int = 5) -> dict[int, float]:
    """Seconds of one forward over k new tokens after ``context`` positions, for each k: what it costs
    the target to verify k - 1 speculative tokens (and the pending one) at once. Absolute seconds;
    divide by ``[1]``, one decode step, for the ratio that ``speculative.predicted_speedup`` uses.

    Args:
        model: a ``Decoder`` (as ``load_model()`` returns), batch 1.

    Returns:
        {k: median seconds} for each k in ``ks``.

    Raises:
        ValueError: context + max(ks) positions past the model's context.
    """
    device = model.device
    check_fits(model, context + max(ks), f"context {context} + k {max(ks)}")
    cache = KVCache(model.config, 1, context + max(ks), model.dtype, device)
    tokens = _random_tokens(model, (1, context + max(ks)))
    model(tokens[:, :context], torch.arange(context, device=device), cache)
    out = {}
    for k in ks:
        pos = torch.arange(context, context + k, device=device)

        def run():
            cache.truncate(context)
            model(tokens[:, context:context + k], pos, cache)

        out[k] = time_median(run, device, repeats, warmup=1)
    return out


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of memory available to new allocations (Linux's MemAvailable); None where unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
