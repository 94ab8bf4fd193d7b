"""Packing b-bit codes into int32 words, and back.

Order (the one GPTQ / AutoGPTQ use for ``qweight``, along the **input** dimension): a weight's
codes (O, I) are transposed to (I, O); each int32 word of ``qweight`` (I / k, O) holds the codes of
k = 32 // bits consecutive input rows, the first row in the lowest bits:

    word[r, o] = sum_{t < k} codes[o, r*k + t] << (bits * t)

For bits that do not divide 32 (3, 5, 6, 7), k = 32 // bits codes go in each word and the top
``32 - k*bits`` bits stay zero (3 bits: 10 codes per word, 2 bits unused; GPTQ's own 3-bit format
instead lets codes straddle words, which saves 6% but is harder to read). Input rows are padded with
zero codes to a multiple of k. ``qzeros`` (G, O / k) packs zero points the same way along the
output dimension. Words are stored as int32; the shifts are done in int64 so the sign bit is just
bit 31.
"""

from __future__ import annotations

import torch


def codes_per_word(bits: int) -> int:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits: must be in 1..8, got {bits}")
    return 32 // bits


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack along dim 0: (N, M) ints in [0, 2^bits) -> (ceil(N / k), M) int32.

    Raises:
        ValueError: a code outside [0, 2^bits).
    """
    k = codes_per_word(bits)
    codes = codes.to(torch.int64)
    if codes.numel() and (codes.min() < 0 or codes.max() >= 1 << bits):
        raise ValueError(f"codes: must be in [0, {1 << bits}) for {bits}-bit packing, "
                         f"got range [{int(codes.min())}, {int(codes.max())}]")
    N, M = codes.shape
    pad = (-N) % k
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, M)])
    codes = codes.reshape(-1, k, M)  # (N / k, k, M)
    shifts = (torch.arange(k, dtype=torch.int64, device=codes.device) * bits)[None, :, None]
    words = (codes << shifts).sum(dim=1)  # (N / k, M), < 2^32
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_rows(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_rows``: (ceil(n / k), M) int32 -> (n, M) int32 codes."""
    k = codes_per_word(bits)
    w = words.to(torch.int64) & 0xFFFFFFFF  # (W, M), as unsigned
    shifts = (torch.arange(k, dtype=torch.int64, device=words.device) * bits)[None, :, None]
    codes = (w[:, None, :] >> shifts) & ((1 << bits) - 1)  # (W, k, M)
    return codes.reshape(-1, words.shape[1])[:n].to(torch.int32)


def pack_weight(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``qweight``: codes (O, I) -> (ceil(I / k), O) int32, packed along the input dimension."""
    return pack_rows(codes.t(), bits)


def unpack_weight(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """codes (O, I) int32 from ``qweight``."""
    return unpack_rows(qweight, bits, in_features).t().contiguous()


def pack_zeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """``qzeros``: zero points (O, G) -> (G, ceil(O / k)) int32, packed along the output dimension."""
    return pack_rows(zeros, bits).t().contiguous()


def unpack_zeros(qzeros: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """zero points (O, G) int32 from ``qzeros``."""
    return unpack_rows(qzeros.t().contiguous(), bits, out_features)
