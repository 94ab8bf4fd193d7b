"""Measuring this machine with torch: the ceilings of the roofline (``measure``: bandwidth and matmul
throughput) and the real model's prefill, decode and verify times, each with warm-up, device
synchronization and the median of repeats.

``minillm.roofline`` predicts these times from a decoder's config (Williams et al. 2009; Pope et al.
2023) and ``roofline.compare`` sets the two side by side. Kept apart so that the cost model reads
without the timing code, and so that ``bench`` and ``bench spec`` time the same way.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from .generation import synchronize
from .kv_cache import KVCache
from .model import _ONEDNN


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


@dataclass
class Ceilings:
    """What torch reaches on a device: bandwidths in bytes/s, matmul throughput in FLOP/s."""

    device: str
    copy_bandwidth: float  # (bytes read + bytes written) / s of a large copy
    read_bandwidth: float  # bytes/s of a streaming read (a sum over a large tensor)
    matmul_flops: dict[str, float] = field(default_factory=dict)
    matmul_size: dict[str, int] = field(default_factory=dict)

    @property
    def bandwidth(self) -> float:
        """The bandwidth the model uses: the best of the two streaming measurements."""
        return max(self.copy_bandwidth, self.read_bandwidth)


def measure(device: str = "cpu", dtypes=("float32", "float16", "bfloat16"), megabytes: int = 512,
            matmul_n: dict[str, int] | None = None, repeats: int = 7) -> Ceilings:
    """Measure memory bandwidth and matmul throughput on ``device`` with torch.

    Args:
        device: "cpu" or "cuda".
        dtypes: matmul dtypes to measure.
        megabytes: size of the tensors streamed (well above any cache).
        matmul_n: square matmul size per dtype (default: 2048 on CPU, 1024 for CPU half types,
            8192 on CUDA) so that it fills the chip.
        repeats: timed runs per measurement (median reported).

    Returns:
        ``Ceilings``.

    Raises:
        ValueError: a CUDA device on a machine without one.
    """
    from .loading import parse_dtype

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} is not available here (torch sees no CUDA GPU); use 'cpu'")
    n = megabytes * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_s = time_median(lambda: dst.copy_(src), dev, repeats)
    read_s = time_median(lambda: src.sum(), dev, repeats)
    del src, dst
    ceilings = Ceilings(str(dev), 2 * n * 4 / copy_s, n * 4 / read_s)
    for name in dtypes:
        size = (matmul_n or {}).get(name) or (8192 if dev.type == "cuda" else (2048 if name == "float32" else 1024))
        a = torch.randn(size, size, device=dev).to(parse_dtype(name))
        b = torch.randn(size, size, device=dev).to(parse_dtype(name))
        s = time_median(lambda: a @ b, dev, max(3, repeats // 2), warmup=1)
        ceilings.matmul_flops[name] = 2 * size**3 / s
        ceilings.matmul_size[name] = size
    return ceilings


@torch.inference_mode()
def measure_weight_read(model, repeats: int = 7) -> dict:
    """A plain streaming read (``sum``) of the model's own float linear weights, tensor by tensor.

    These are the bytes a decode step must read, in the allocations it reads them from: a diagnostic
    beside ``measure``'s ceiling, which reads one large buffer. When decode streams its weights nearly as
    fast as this read, what is left between it and the bound is not the kernels but reading 121 separate
    tensors (a parallel region each) instead of one buffer, and the machine's moods.

    Returns:
        {"bytes": bytes read (float linear weights; quantized layers are left out), "seconds": median
        time of one pass, "bandwidth": bytes / seconds}.
    """
    from .linear import Linear

    weights = [m.weight_shards for m in model.modules() if isinstance(m, Linear)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    seconds = time_median(lambda: [w.sum() for w in weights], model.device, repeats)
    return {"bytes": nbytes, "seconds": seconds, "bandwidth": nbytes / seconds}


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


@torch.inference_mode()
def measure_linear_layouts(model, batch_size: int = 1, repeats: int = 5) -> dict[str, float]:
    """Seconds to run every linear layer of one decode step (B rows) in four weight layouts:

    * ``F.linear(x, W)`` with W (out, in) contiguous: PyTorch's default (``nn.Linear``, MKL);
    * ``x @ W^T`` with W^T (in, out) contiguous;
    * W^T split into one column block per core, one ``torch.bmm`` (minillm's ``Linear`` for one row);
    * oneDNN's ``linear`` on W reordered into its blocked layout (minillm's ``Linear`` for 2+ rows);

    and minillm's ``Linear`` itself. The same bytes are read in each; the difference is the kernel.
    """
    import torch.nn.functional as F

    from .model import Linear

    layers = [m for m in model.modules() if isinstance(m, Linear)]
    device = model.device
    xs = {n: torch.randn(batch_size, n, dtype=model.dtype, device=device) for n in {m.in_features for m in layers}}
    out = {}
    weights = [m.weight.contiguous() for m in layers]  # (out, in)
    out["F.linear(x, W), W (out, in)"] = time_median(
        lambda: [F.linear(xs[w.shape[1]], w) for w in weights], device, repeats)
    del weights
    weights_t = [m.weight.t().contiguous() for m in layers]  # (in, out)
    out["x @ W^T, W^T (in, out)"] = time_median(lambda: [xs[w.shape[0]] @ w for w in weights_t], device, repeats)
    del weights_t
    out[f"W^T in {layers[0].n_shards} column shards, bmm"] = time_median(
        lambda: [m.forward_shards(xs[m.in_features]) for m in layers], device, repeats)
    if device.type == "cpu" and model.dtype == torch.float32 and _ONEDNN:
        out["oneDNN linear, W packed (blocked)"] = time_median(
            lambda: [m.forward_onednn(xs[m.in_features]) for m in layers], device, repeats)
    out["minillm Linear"] = time_median(lambda: [m(xs[m.in_features]) for m in layers], device, repeats)
    return out
