"""The roofline model of prefill and decode: predicted from a decoder's config, measured on this machine.

Roofline (Williams, Waterman, Patterson, CACM 2009): a kernel that does F FLOPs and moves M bytes
takes at least ``max(F / peak_flops, M / bandwidth)``. Its arithmetic intensity ``I = F / M``
(FLOP/byte) against the machine's ridge point ``peak_flops / bandwidth`` says which bound applies.

For a decoder (Pope et al. 2023, "Efficiently Scaling Transformer Inference", Sec. 2-3):

* every forward reads every weight once, whatever the number of tokens B x T it processes;
* linear layers do 2 FLOPs per weight per token, so their intensity is about
  ``2 x B x T / bytes_per_weight``: decode (T = 1, small B) is far below the ridge point
  (bandwidth-bound), prefill (T in the hundreds) is above it (compute-bound);
* attention reads the KV cache: ``2 x B x S x n_layers x Hkv x D x bytes`` (``kv_cache.kv_cache_bytes``),
  and does ``4 x B x T x S x H x D`` FLOPs per layer (Q K^T and scores V).

``decode_cost`` / ``prefill_cost`` predict; ``minillm.measurements`` measures (``measure()``: this
machine's ceilings; ``measure_decode`` / ``measure_prefill`` / ``measure_verify``: the real model);
``compare`` and the plots set the two side by side. The measuring functions are importable from here
too, so that ``roofline.measure(device)`` reads as the roofline's own step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kv_cache import kv_cache_bytes
# re-exported, so that roofline.measure(device) and roofline.measure_decode(...) read as the roofline's steps
from .measurements import (Ceilings, check_fits, measure, measure_decode, measure_linear_layouts,  # noqa: F401
                           measure_prefill, measure_verify, measure_weight_read, time_median)
from .model import ModelConfig

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class Hardware:
    """Peak memory bandwidth (bytes/s) and peak dense matmul throughput (FLOP/s) per dtype.

    Datasheet numbers are leads, not truth: ``measure()`` gives what torch reaches here.
    """

    name: str
    bandwidth: float  # bytes/s
    flops: dict[str, float]  # dtype name -> FLOP/s (dense, no sparsity)
    source: str = ""

    def ridge_point(self, dtype: str) -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound."""
        return self.flops[dtype] / self.bandwidth


T_ = 1e12
HARDWARE = {
    "H100 SXM": Hardware("H100 SXM", 3.35e12, {"float32": 67 * T_, "tf32": 494.5 * T_, "float16": 989.5 * T_,
                                                "bfloat16": 989.5 * T_, "int8": 1979 * T_},
                         "NVIDIA H100 Tensor Core GPU datasheet (SXM5; dense = half the sparse figures)"),
    "H200": Hardware("H200", 4.8e12, {"float32": 67 * T_, "tf32": 494.5 * T_, "float16": 989.5 * T_,
                                      "bfloat16": 989.5 * T_, "int8": 1979 * T_},
                     "NVIDIA H200 Tensor Core GPU datasheet (SXM; dense = half the sparse figures)"),
    "A100 80GB": Hardware("A100 80GB", 2.039e12, {"float32": 19.5 * T_, "tf32": 156 * T_, "float16": 312 * T_,
                                                  "bfloat16": 312 * T_, "int8": 624 * T_},
                          "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)"),
    "RTX 4090": Hardware("RTX 4090", 1.008e12, {"float32": 82.6 * T_, "float16": 165.2 * T_, "bfloat16": 165.2 * T_,
                                                "int8": 660.6 * T_},
                         "NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090; FP16/BF16 with FP32 accumulate)"),
    "Apple M2 Max": Hardware("Apple M2 Max", 400e9, {"float32": 13.6 * T_, "float16": 13.6 * T_},
                             "Apple newsroom, M2 Pro and M2 Max (Jan 2023): 400 GB/s, 38-core GPU 13.6 TFLOPS"),
}


# ---------------------------------------------------------------------------------------------
# Cost model


@dataclass
class Cost:
    """FLOPs and bytes moved by one forward pass, and the time the roofline allows."""

    flops: float
    weight_bytes: float
    kv_bytes: float
    tokens: int  # new tokens produced or processed (B x T)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """FLOP per byte moved."""
        return self.flops / self.bytes

    def time(self, peak_flops: float, bandwidth: float) -> float:
        """Attainable seconds: max(FLOPs / peak, bytes / bandwidth)."""
        return max(self.flops / peak_flops, self.bytes / bandwidth)

    def bound(self, peak_flops: float, bandwidth: float) -> str:
        return "compute" if self.flops / peak_flops > self.bytes / bandwidth else "memory"


def linear_params(config: ModelConfig) -> tuple[int, int]:
    """(weights in the linear layers of one block, weights of the output projection)."""
    return config.layer_linear_params, config.vocab_size * config.dim


def forward_cost(config: ModelConfig, batch_size: int, new_tokens: int, context: int, weight_bytes: float = 4,
                 kv_bytes: float = 4, causal_prefill: bool = False, all_logits: bool = True) -> Cost:
    """Cost of one forward of ``new_tokens`` per row after ``context`` cached positions.

    Args:
        config: the model.
        batch_size: B rows.
        new_tokens: T tokens per row in this forward.
        context: L positions already in the KV cache (read by attention).
        weight_bytes: bytes per weight (4 float32, 2 float16, 0.5 int4, ...).
        kv_bytes: bytes per KV-cache element.
        causal_prefill: count attention FLOPs over the causal triangle (each new token attends to
            L + its index + 1 keys) instead of all L + T keys.
        all_logits: the output projection runs for all T tokens (minillm's forward) or only the last.

    Returns:
        ``Cost``: FLOPs, weight bytes (every weight read once), KV bytes (cache read + new K/V written).
    """
    B, T, L = batch_size, new_tokens, context
    per_layer, head = linear_params(config)
    H, D = config.n_heads, config.head_dim
    keys = (L * T + T * (T + 1) / 2) if causal_prefill else T * (L + T)  # (query, key) pairs per row
    flops = config.n_layers * (2 * B * T * per_layer + 4 * B * keys * H * D)
    flops += 2 * B * (T if all_logits else 1) * head
    norms = (2 * config.n_layers + 1) * config.dim
    weights = (config.n_layers * per_layer + head + norms) * weight_bytes
    kv = kv_cache_bytes(config, B, L, kv_bytes) + kv_cache_bytes(config, B, T, kv_bytes)
    return Cost(flops=flops, weight_bytes=weights, kv_bytes=kv, tokens=B * T)


def decode_cost(config: ModelConfig, batch_size: int = 1, context: int = 0, weight_bytes: float = 4,
                kv_bytes: float = 4) -> Cost:
    """One decode step: one new token per row after ``context`` positions."""
    return forward_cost(config, batch_size, 1, context, weight_bytes, kv_bytes)


def prefill_cost(config: ModelConfig, prompt_tokens: int, batch_size: int = 1, weight_bytes: float = 4,
                 kv_bytes: float = 4) -> Cost:
    """Prefill of a ``prompt_tokens``-token prompt per row (causal attention, logits for every token)."""
    return forward_cost(config, batch_size, prompt_tokens, 0, weight_bytes, kv_bytes, causal_prefill=True)


def decode_time_lower_bound(n_params: float, bytes_per_param: float, bandwidth: float) -> float:
    """Seconds per batch-1 decode step when only the weight reads count: params x bytes / bandwidth.

    The article's example: 70e9 x 2 bytes / 2e12 B/s = 0.07 s, so at most ~14 tokens/s.
    """
    return n_params * bytes_per_param / bandwidth


LLAMA2_70B = ModelConfig(arch="llama", n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=28672,
                         vocab_size=32000, max_seq_len=4096, rope_base=10000.0, tie_embeddings=False)
LLAMA2_7B = ModelConfig(arch="llama", n_layers=32, dim=4096, n_heads=32, n_kv_heads=32, head_dim=128, ffn_dim=11008,
                        vocab_size=32000, max_seq_len=4096, rope_base=10000.0, tie_embeddings=False)


# ---------------------------------------------------------------------------------------------
# Predicted vs measured


def compare(model, ceilings: Ceilings, batch_sizes=(1,), prompt_lengths=(), context: int = 64,
            progress: bool = False) -> list[dict]:
    """Predicted and measured time per forward for the model as loaded (its dtype and device).

    Rows: decode at each batch size (one token per row after ``context`` positions) and prefill at
    each prompt length (batch 1). Each row: kind, dtype, compiled (decode through
    ``minillm.compiled.compile_decode``; prefill is never compiled), batch_size, tokens, flops, bytes, intensity,
    bound, predicted_s, measured_s, predicted_tokens_per_s, measured_tokens_per_s,
    measured/predicted ratio and achieved FLOP/s and bytes/s.

    Raises:
        ValueError: no matmul peak in ``ceilings`` for the model's dtype, a batch size < 1, or
            sequences longer than the model's context.
    """
    from tqdm.auto import tqdm

    from .compiled import is_compiled

    dtype = str(model.dtype).replace("torch.", "")
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
            "kind": kind, "dtype": dtype, "compiled": kind == "decode" and is_compiled(model),
            "batch_size": b, "tokens": cost.tokens, "flops": cost.flops,
            "bytes": cost.bytes, "intensity": cost.intensity, "bound": cost.bound(peak, ceilings.bandwidth),
            "predicted_s": predicted, "measured_s": measured,
            "predicted_tokens_per_s": cost.tokens / predicted, "measured_tokens_per_s": cost.tokens / measured,
            "measured_over_predicted": measured / predicted,
            "achieved_flops": cost.flops / measured, "achieved_bandwidth": cost.bytes / measured,
        })
    return rows


def plot_roofline(ceilings: Ceilings, rows: list[dict], path, dtype: str = "float32", title: str | None = None):
    """The classic log-log roofline (attainable FLOP/s vs arithmetic intensity) with measured points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    bw, peak = ceilings.bandwidth, ceilings.matmul_flops[dtype]
    x = np.logspace(-1, 4, 200)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.loglog(x, np.minimum(peak, bw * x), "k-", lw=2, label=f"roofline ({dtype}, measured)")
    ax.axvline(peak / bw, color="gray", ls=":", lw=1)
    ax.text(peak / bw, peak * 1.15, f"ridge {peak / bw:.0f} FLOP/B", ha="center", fontsize=8)
    for kind, marker in (("decode", "o"), ("prefill", "s")):
        pts = [r for r in rows if r["kind"] == kind and r["dtype"] == dtype]
        if pts:
            ax.loglog([r["intensity"] for r in pts], [r["achieved_flops"] for r in pts], marker, ls="",
                      label=f"{kind} (measured)")
            for r in pts:
                label = f"B={r['batch_size']}" if kind == "decode" else f"T={r['tokens']}"
                ax.annotate(label, (r["intensity"], r["achieved_flops"]), fontsize=7, xytext=(3, -9),
                            textcoords="offset points")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or "Roofline, SmolLM2-135M on this machine")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_predicted_vs_measured(rows: list[dict], path, title: str | None = None):
    """Predicted and measured milliseconds per token for each row of ``compare``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['kind']}\n{r['dtype']}\n{'B=' + str(r['batch_size']) if r['kind'] == 'decode' else 'T=' + str(r['tokens'])}"
              for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [1e3 * r["predicted_s"] / r["tokens"] for r in rows], 0.4, label="predicted")
    ax.bar([i + 0.2 for i in x], [1e3 * r["measured_s"] / r["tokens"] for r in rows], 0.4, label="measured")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms per token")
    ax.set_title(title or "Predicted vs measured time per token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
