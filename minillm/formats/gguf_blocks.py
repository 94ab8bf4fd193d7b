"""llama.cpp's GGUF block formats, dequantized with minillm's own code.

A quantized GGUF tensor is a sequence of *blocks*; each block covers ``QK = 32`` consecutive
weights of one row and stores one or two float16 numbers next to the packed integer codes.
The layouts below are ggml's (``ggml/src/ggml-common.h``, ``block_q8_0`` etc.; see also the GGUF
specification, ggml repository ``docs/gguf.md``)::

    Q8_0  34 bytes: d (f16) | qs[32] (int8)               w[j] = d * qs[j]
    Q4_0  18 bytes: d (f16) | qs[16] (two 4-bit codes)    w[j] = d * (lo(qs[j]) - 8)
                                                           w[j + 16] = d * (hi(qs[j]) - 8)
    Q4_1  20 bytes: d (f16) | m (f16) | qs[16]             w[j] = d * lo(qs[j]) + m
                                                           w[j + 16] = d * hi(qs[j]) + m

Note the nibble order: the low nibbles of the 16 bytes hold weights 0..15 of the block and the
high nibbles hold weights 16..31 (not interleaved pairs).

Everything is computed in float32 in the same order as the reference (``d * q`` then ``+ m``), so
the results are bit-identical to ``gguf.quants.dequantize`` (tested on every tensor of the
embedded model and on hand-built blocks). Other block types (the K-quants, IQ formats) go through
``gguf.quants``.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

QK = 32  # weights per block for Q8_0 / Q4_0 / Q4_1

# bytes per block, for the formats minillm dequantizes itself
BLOCK_BYTES = {
    GGMLQuantizationType.Q8_0: 2 + QK,
    GGMLQuantizationType.Q4_0: 2 + QK // 2,
    GGMLQuantizationType.Q4_1: 2 + 2 + QK // 2,
}


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


_DEQUANTIZERS = {
    GGMLQuantizationType.Q8_0: dequantize_q8_0,
    GGMLQuantizationType.Q4_0: dequantize_q4_0,
    GGMLQuantizationType.Q4_1: dequantize_q4_1,
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
        block_bytes = BLOCK_BYTES[qtype]
        raw = np.asarray(data, dtype=np.uint8).reshape(-1)
        if raw.size * QK != n * block_bytes:
            raise ValueError(
                f"{qtype.name} data has {raw.size} bytes but shape {tuple(shape)} needs "
                f"{n // QK * block_bytes}"
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
