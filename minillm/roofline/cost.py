"""The roofline model of prefill and decode: predicted from a decoder's config, measured on this machine.

Roofline (Williams, Waterman, Patterson, CACM 2009): a kernel that does F FLOPs and moves M bytes
takes at least ``max(F / peak_flops, M / bandwidth)``. Its arithmetic intensity ``I = F / M``
(FLOP/byte) against the machine's ridge point ``peak_flops / bandwidth`` says which bound applies.
For a decoder (Pope et al. 2023, "Efficiently Scaling Transformer Inference", Sec. 2-3):

* every forward reads every weight once, whatever the number of tokens B x T it processes;
* linear layers do 2 FLOPs per weight per token, so their intensity is about ``2 x B x T / bytes_per_weight``: decode
  (T = 1, small B) is far below the ridge point (bandwidth-bound), prefill (T in the hundreds) above it (compute-bound);
* attention reads the KV cache: ``2 x B x S x n_layers x Hkv x D x bytes`` (``kv_cache.kv_cache_bytes``),
  and does ``4 x B x T x S x H x D`` FLOPs per layer (Q K^T and scores V).

``decode_cost`` / ``prefill_cost`` predict; ``roofline.ceilings`` measures this machine's ceilings and
``roofline.compare`` sets prediction and measurement side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kv_cache import kv_cache_bytes
from ..config import ModelConfig

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
