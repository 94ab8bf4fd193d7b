"""llama.cpp's GGUF block formats, dequantized with minillm's own code.

A quantized GGUF tensor is a sequence of blocks; each covers consecutive weights of one row and stores
its scales beside the packed integer codes (ggml's ``ggml-common.h``; the GGUF specification). The
"legacy" formats (Q8_0, Q4_0, Q4_1, Q5_0) hold 32 weights with one float16 scale (and offset); the
k-quants (Q4_K, Q6_K) hold super-blocks of 256 weights whose sub-block scales are quantized too.
docs/formats.md draws every layout byte by byte.

Everything is computed in float32 in the reference's order, so the results are bit-identical to
``gguf.quants.dequantize`` (tested on every tensor of the embedded model and on random blocks). Each
k-quant has a per-block loop written as the C reads (``dequantize_q4_k_naive``, ``dequantize_q6_k_naive``)
beside the vectorized version, tested to agree. Other block types go through ``gguf.quants``.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

QK = 32  # weights per block for Q8_0 / Q4_0 / Q4_1 / Q5_0
QK_K = 256  # weights per super-block for the k-quants
K_SCALE_SIZE = 12  # bytes of Q4_K's packed 6-bit scales and mins

# (weights, bytes) per block, for the formats minillm dequantizes itself
BLOCK_SIZES = {
    GGMLQuantizationType.Q8_0: (QK, 2 + QK),
    GGMLQuantizationType.Q4_0: (QK, 2 + QK // 2),
    GGMLQuantizationType.Q4_1: (QK, 2 + 2 + QK // 2),
    GGMLQuantizationType.Q5_0: (QK, 2 + 4 + QK // 2),
    GGMLQuantizationType.Q4_K: (QK_K, 2 + 2 + K_SCALE_SIZE + QK_K // 2),
    GGMLQuantizationType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}
BLOCK_BYTES = {t: b for t, (_, b) in BLOCK_SIZES.items()}


def _f16(raw: np.ndarray) -> torch.Tensor:
    """(N, 2) uint8 -> (N, 1) float32, reading little-endian float16."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """(N, 16) uint8 -> (N, 32) float32 codes 0..15: low nibbles first, then high nibbles."""
    q = torch.from_numpy(np.ascontiguousarray(qs))
    return torch.cat([q & 0x0F, q >> 4], dim=1).to(torch.float32)


def dequantize_q8_0(blocks: np.ndarray) -> torch.Tensor:
    """Q8_0 blocks (N, 34) uint8 -> weights (N, 32) float32: ``d * qs``."""
    d = _f16(blocks[:, :2])
    qs = torch.from_numpy(np.ascontiguousarray(blocks[:, 2:]).view(np.int8)).to(torch.float32)
    return qs * d


def dequantize_q4_0(blocks: np.ndarray) -> torch.Tensor:
    """Q4_0 blocks (N, 18) uint8 -> weights (N, 32) float32: ``d * (q - 8)``."""
    d = _f16(blocks[:, :2])
    return (_nibbles(blocks[:, 2:]) - 8.0) * d


def dequantize_q4_1(blocks: np.ndarray) -> torch.Tensor:
    """Q4_1 blocks (N, 20) uint8 -> weights (N, 32) float32: ``d * q + m``."""
    d = _f16(blocks[:, 0:2])
    m = _f16(blocks[:, 2:4])
    return _nibbles(blocks[:, 4:]) * d + m


def dequantize_q5_0(blocks: np.ndarray) -> torch.Tensor:
    """Q5_0 blocks (N, 22) uint8 -> weights (N, 32) float32: ``d * (q - 16)``, q = 4 low bits | fifth bit."""
    d = _f16(blocks[:, :2])
    qh = torch.from_numpy(np.ascontiguousarray(blocks[:, 2:6]).view("<u4").astype(np.int64))  # (N, 1)
    fifth = (qh >> torch.arange(32)) & 1  # (N, 32): bit j of qh belongs to weight j
    return (_nibbles(blocks[:, 6:]) + 16.0 * fifth - 16.0) * d


def q4_k_scales(scales: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 packed bytes (N, 12) uint8 -> (sc, m), each (N, 8) integers 0..63 (as float32)."""
    s = torch.from_numpy(np.ascontiguousarray(scales)).to(torch.int32)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]  # (N, 4) each
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc.to(torch.float32), m.to(torch.float32)


def dequantize_q4_k(blocks: np.ndarray) -> torch.Tensor:
    """Q4_K super-blocks (N, 144) uint8 -> weights (N, 256) float32: ``d * sc[j] * q - dmin * m[j]``."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # (N, 1)
    sc, m = q4_k_scales(blocks[:, 4:16])  # (N, 8)
    qs = torch.from_numpy(np.ascontiguousarray(blocks[:, 16:])).reshape(n, 4, 1, 32)  # 4 groups of 32 bytes
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).to(torch.float32)  # (N, sub-block, weight)
    return ((d * sc).unsqueeze(2) * q - (dmin * m).unsqueeze(2)).reshape(n, QK_K)


def dequantize_q6_k(blocks: np.ndarray) -> torch.Tensor:
    """Q6_K super-blocks (N, 210) uint8 -> weights (N, 256) float32: ``d * scales[s] * (q - 32)``."""
    n = blocks.shape[0]
    ql = torch.from_numpy(np.ascontiguousarray(blocks[:, :128])).reshape(n, 2, 2, 32)  # (N, half, ql[l] / ql[l+32], l)
    qh = torch.from_numpy(np.ascontiguousarray(blocks[:, 128:192])).reshape(n, 2, 1, 32)  # (N, half, 1, l)
    scales = torch.from_numpy(np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)).to(torch.float32)  # (N, 16)
    d = _f16(blocks[:, 208:210])  # (N, 1)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # (N, half, 4, 32): weights l, l+32, l+64, l+96
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).to(torch.float32) - 32.0  # (N, 2, 4, 32) = (N, 256) in weight order
    return ((d * scales).unsqueeze(2) * q.reshape(n, 16, 16)).reshape(n, QK_K)


def dequantize_q4_k_naive(blocks: np.ndarray) -> torch.Tensor:
    """The per-block loop of ``dequantize_row_q4_K`` (ggml-quants.c), same signature as ``dequantize_q4_k``."""
    out = np.zeros((len(blocks), QK_K), dtype=np.float32)
    for i, b in enumerate(np.asarray(blocks, dtype=np.uint8)):
        d, dmin = b[0:2].view(np.float16)[0].astype(np.float32), b[2:4].view(np.float16)[0].astype(np.float32)
        scales, qs = b[4:16], b[16:]
        for j in range(8):
            if j < 4:
                sc, m = scales[j] & 63, scales[j + 4] & 63
            else:
                sc = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)
                m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)
            dl, ml = d * np.float32(sc), dmin * np.float32(m)
            for l in range(32):
                byte = qs[32 * (j // 2) + l]
                q = byte & 0xF if j % 2 == 0 else byte >> 4
                out[i, 32 * j + l] = dl * np.float32(q) - ml
    return torch.from_numpy(out)


def dequantize_q6_k_naive(blocks: np.ndarray) -> torch.Tensor:
    """The per-block loop of ``dequantize_row_q6_K`` (ggml-quants.c), same signature as ``dequantize_q6_k``."""
    out = np.zeros((len(blocks), QK_K), dtype=np.float32)
    for i, b in enumerate(np.asarray(blocks, dtype=np.uint8)):
        d = b[208:210].view(np.float16)[0].astype(np.float32)
        sc = b[192:208].view(np.int8).astype(np.float32)
        for half in range(2):
            ql, qh, y = b[64 * half:64 * half + 64], b[128 + 32 * half:128 + 32 * half + 32], 128 * half
            for l in range(32):
                s = 8 * half + l // 16
                codes = ((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4, (ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4,
                         (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4, (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4)
                for k, q in enumerate(codes):  # weights l, l+32, l+64, l+96 of this half
                    out[i, y + l + 32 * k] = d * sc[s + 2 * k] * np.float32(int(q) - 32)
    return torch.from_numpy(out)


_DEQUANTIZERS = {
    GGMLQuantizationType.Q8_0: dequantize_q8_0,
    GGMLQuantizationType.Q4_0: dequantize_q4_0,
    GGMLQuantizationType.Q4_1: dequantize_q4_1,
    GGMLQuantizationType.Q5_0: dequantize_q5_0,
    GGMLQuantizationType.Q4_K: dequantize_q4_k,
    GGMLQuantizationType.Q6_K: dequantize_q6_k,
}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Turn one GGUF tensor's stored data into a float32 torch tensor.

    Args:
        data: the tensor's data as the ``gguf`` reader returns it: float32/float16 values for F32
            and F16, or (rows, bytes_per_row) uint8 for block types.
        qtype: the tensor's ``GGMLQuantizationType``.
        shape: the logical shape, outermost first (numpy order; GGUF lists it innermost first).

    Returns:
        float32 tensor of ``shape``.

    Raises:
        ValueError: a block type that neither minillm nor ``gguf.quants`` can dequantize, or data
            whose size does not match ``shape``.
    """
    n = int(np.prod(shape))
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        out = torch.from_numpy(np.asarray(data).astype(np.float32).reshape(-1))
    elif qtype in _DEQUANTIZERS:
        block_weights, block_bytes = BLOCK_SIZES[qtype]
        raw = np.asarray(data, dtype=np.uint8).reshape(-1)
        if raw.size * block_weights != n * block_bytes:
            raise ValueError(
                f"{qtype.name} data has {raw.size} bytes but shape {tuple(shape)} needs "
                f"{n // block_weights * block_bytes}"
            )
        out = _DEQUANTIZERS[qtype](raw.reshape(-1, block_bytes)).reshape(-1)
    else:
        try:
            out = torch.from_numpy(quants.dequantize(np.asarray(data), qtype).astype(np.float32).reshape(-1))
        except NotImplementedError as e:
            raise ValueError(f"tensor type {qtype.name} is not supported (no dequantizer)") from e
    if out.numel() != n:
        raise ValueError(f"{qtype.name} data holds {out.numel()} values but shape {tuple(shape)} needs {n}")
    return out.reshape(shape)
