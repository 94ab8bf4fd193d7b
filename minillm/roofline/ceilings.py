"""The roofline's measurements: this machine's ceilings (``measure``: bandwidth and matmul
throughput), a diagnostic of how decode reads its weights (``measure_weight_read``; the speed layer's
layouts are timed by ``minillm.lab.layouts``), and ``compare``: the cost model's prediction (``roofline.cost``) beside
the real model's measured forwards (``minillm.timing``), row by row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..loading import parse_dtype
from ..timing import dtype_name, measure_decode, measure_prefill, time_median
from .cost import DTYPE_BYTES, decode_cost, prefill_cost


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
    # the linear layers' float weights as the model holds them (a tied output layer's is the embedding's);
    # quantized layers keep buffers, not parameters, and are left out
    weights = [p for name, p in model.named_parameters() if p.dim() >= 2 and "embeddings" not in name]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    seconds = time_median(lambda: [w.sum() for w in weights], model.device, repeats)
    return {"bytes": nbytes, "seconds": seconds, "bandwidth": nbytes / seconds}


def compare(model, ceilings: Ceilings, batch_sizes=(1,), prompt_lengths=(), context: int = 64,
            progress: bool = False) -> list[dict]:
    """Predicted and measured time per forward for the model as loaded (its dtype and device).

    Rows: decode at each batch size (one token per row after ``context`` positions) and prefill at
    each prompt length (batch 1).

    Returns:
        One dict per row: kind, dtype, compiled (decode through ``minillm.fast.compiled.compile_decode``; prefill is
        never compiled), batch_size, tokens, flops, bytes, intensity, bound, predicted_s, measured_s,
        predicted_tokens_per_s, measured_tokens_per_s, measured/predicted ratio and achieved FLOP/s and bytes/s.

    Raises:
        ValueError: no matmul peak in ``ceilings`` for the model's dtype, a batch size < 1, or
            sequences longer than the model's context.
    """
    dtype = dtype_name(model.dtype)
    nbytes = DTYPE_BYTES[dtype]
    if dtype not in ceilings.matmul_flops:
        raise ValueError(f"ceilings: no matmul peak measured for {dtype}, the model's dtype; "
                         f"measure it with measure(device, dtypes=({dtype!r},))")
    peak = ceilings.matmul_flops[dtype]
    jobs = [("decode", b, None) for b in batch_sizes] + [("prefill", 1, t) for t in prompt_lengths]
    rows = []
    for kind, b, t in tqdm(jobs, desc="roofline", disable=not progress, leave=False):
        if kind == "decode":
            cost = decode_cost(model.config, b, context, nbytes, nbytes)
            measured = measure_decode(model, b, context)
        else:
            cost = prefill_cost(model.config, t, b, nbytes, nbytes)
            measured = measure_prefill(model, t, b)
        predicted = cost.time(peak, ceilings.bandwidth)
        rows.append({
            "kind": kind, "dtype": dtype, "compiled": kind == "decode" and model.compiled,
            "batch_size": b, "tokens": cost.tokens, "flops": cost.flops,
            "bytes": cost.bytes, "intensity": cost.intensity, "bound": cost.bound(peak, ceilings.bandwidth),
            "predicted_s": predicted, "measured_s": measured,
            "predicted_tokens_per_s": cost.tokens / predicted, "measured_tokens_per_s": cost.tokens / measured,
            "measured_over_predicted": measured / predicted,
            "achieved_flops": cost.flops / measured, "achieved_bandwidth": cost.bytes / measured,
        })
    return rows
