"""llama.cpp's Q8_0, Q4_0, Q4_1 and Q5_0 quantizers, written with torch, and a GGUF writer.

Each format cuts a row into blocks of 32 weights (layouts in ``minillm.formats.gguf_blocks``):

    Q8_0  d = max|x| / 127                  q = round(x / d)          (round half away from zero)
    Q4_0  d = x[argmax |x|] / -8            q = min(15, trunc(x / d + 8.5))   (symmetric, signed max)
    Q4_1  d = (max - min) / 15, m = min     q = min(15, trunc((x - m) / d + 0.5))
    Q5_0  d = x[argmax |x|] / -16           q = min(31, trunc(x / d + 16.5))  (Q4_0 with a fifth bit)

``1/d`` is computed once per block (0 when d = 0) and multiplied, in float32, as ggml-quants.c's
``quantize_row_*_ref`` does, so the bytes equal ``gguf.quants.quantize``'s (tested); d and m are float16.
Q4_0 takes the *signed* largest-magnitude weight so that it lands exactly on code 0 (-8 d). The k-quants
and the Q4_K_M recipe are ``minillm.formats.kquants``. ``write_gguf`` re-quantizes every 2-D tensor of a
GGUF file and writes one that ``gguf.GGUFReader``, llama.cpp and ``minillm.load_model`` read back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, Keys, LlamaFileType
from tqdm.auto import tqdm

from ..files import atomic_write, check_output_path
from .gguf import read_gguf
from .gguf_blocks import dequantize
from .kquants import blocks_of, f16_bytes, q4_k_m_types, quantize_q4_k, quantize_q6_k

QK = 32


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return blocks_of(x, QK)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, 32) codes 0..15 -> (N, 16) bytes: low nibbles hold weights 0..15, high nibbles 16..31."""
    q = q.to(torch.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _out(blocks: torch.Tensor, shape) -> np.ndarray:
    return blocks.reshape(*shape[:-1], -1).numpy()  # (..., bytes per row), the gguf package's shape


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``: halves go away from zero (torch.round goes to even)."""
    a = x.abs()
    f = a.floor()
    return x.sign() * (f + (2 * (a - f)).floor())


def quantize_q8_0(x: torch.Tensor) -> np.ndarray:
    """Q8_0 bytes of x (..., n) float, n a multiple of 32 -> uint8 (..., n / 32 * 34).

    Raises:
        ValueError: the last dimension is not a multiple of 32.
    """
    b = _blocks(x)
    d = b.abs().amax(dim=1, keepdim=True) / 127
    q = round_half_away(b * _inverse(d)).to(torch.int8).view(torch.uint8)
    return _out(torch.cat([f16_bytes(d), q], 1), tuple(torch.as_tensor(x).shape))


def quantize_q4_0(x: torch.Tensor) -> np.ndarray:
    """Q4_0 bytes of x (..., n) -> uint8 (..., n / 32 * 18). Raises like ``quantize_q8_0``."""
    b = _blocks(x)
    imax = b.abs().argmax(dim=1, keepdim=True)
    d = b.gather(1, imax) / -8
    q = torch.trunc(b * _inverse(d) + 8.5).clamp(0, 15)
    return _out(torch.cat([f16_bytes(d), _nibbles(q)], 1), tuple(torch.as_tensor(x).shape))


def quantize_q4_1(x: torch.Tensor) -> np.ndarray:
    """Q4_1 bytes of x (..., n) -> uint8 (..., n / 32 * 20). Raises like ``quantize_q8_0``."""
    b = _blocks(x)
    mx = b.amax(dim=1, keepdim=True)
    mn = b.amin(dim=1, keepdim=True)
    d = (mx - mn) / 15
    q = torch.trunc((b - mn) * _inverse(d) + 0.5).clamp(0, 15)
    return _out(torch.cat([f16_bytes(d), f16_bytes(mn), _nibbles(q)], 1), tuple(torch.as_tensor(x).shape))


def quantize_q5_0(x: torch.Tensor) -> np.ndarray:
    """Q5_0 bytes of x (..., n) -> uint8 (..., n / 32 * 22). Raises like ``quantize_q8_0``."""
    b = _blocks(x)
    imax = b.abs().argmax(dim=1, keepdim=True)
    d = b.gather(1, imax) / -16
    q = torch.trunc(b * _inverse(d) + 16.5).clamp(0, 31).to(torch.int64)  # (N, 32) codes 0..31
    qh = ((q >> 4) << torch.arange(32)).sum(dim=1, keepdim=True)  # fifth bits: bit j for weight j
    qh = qh.to(torch.int32).view(torch.uint8).reshape(-1, 4)  # little-endian uint32 (this machine's order)
    return _out(torch.cat([f16_bytes(d), qh, _nibbles(q & 0x0F)], 1), tuple(torch.as_tensor(x).shape))


def to_f16(x: torch.Tensor) -> np.ndarray:
    """x (..., n) float -> float16 (..., n), round to nearest even as ggml's conversion: the Q4_K_M recipe's
    type for rows that no 32-weight block divides."""
    return torch.as_tensor(x).half().numpy()


QUANTIZERS = {
    GGMLQuantizationType.F16: to_f16,
    GGMLQuantizationType.Q8_0: quantize_q8_0,
    GGMLQuantizationType.Q4_0: quantize_q4_0,
    GGMLQuantizationType.Q4_1: quantize_q4_1,
    GGMLQuantizationType.Q5_0: quantize_q5_0,
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
}
UNIFORM = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0)
# llama.cpp's general.file_type (enum llama_ftype) of what write_gguf writes
FILE_TYPES = {name: int(LlamaFileType[f"MOSTLY_{name}"]) for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K_M")}
CHOICES = "Q8_0, Q4_0, Q4_1, Q5_0 or the recipe Q4_K_M"


def write_gguf(src: str | Path, dst: str | Path, qtype: GGMLQuantizationType | str, progress: bool = False) -> Path:
    """Re-quantize a GGUF file: every tensor with 2+ dimensions and rows a multiple of 32 becomes
    ``qtype`` (Q8_0, Q4_0, Q4_1 or Q5_0), or for ``"q4_k_m"`` the type llama.cpp's Q4_K_M recipe gives it
    (``kquants.q4_k_m_types``); others (norms) stay as they are. The sources are dequantized first, as
    ``llama-quantize --allow-requantize`` does; names, layout and metadata are kept, and ``general.file_type``
    is set to what is written (``FILE_TYPES``, added where the source has none). ``dst`` is written beside itself and renamed into place when complete
    (``minillm.files``), so the source, memory-mapped while it is read, is never overwritten.

    Returns:
        ``dst`` as a Path.

    Raises:
        ValueError: an unsupported qtype, or ``dst`` resolving to ``src``.
        ModelFileError: a bad source.
    """
    name = qtype.upper() if isinstance(qtype, str) else qtype.name
    if name not in FILE_TYPES:
        raise ValueError(f"qtype: {qtype!r} is not a type minillm writes; use {CHOICES}")
    check_output_path(dst, "out", sources=[src], suffix=".gguf")
    reader = read_gguf(src)
    with atomic_write(dst, sources=[src]) as tmp:
        _copy_quantized(reader, GGUFWriter(str(tmp), str(reader.fields["general.architecture"].contents())),
                        name, progress)
    return Path(dst)


def tensor_types(reader, name: str) -> dict[str, GGMLQuantizationType | None]:
    """{tensor name: the type ``write_gguf`` gives it} (None: copied as it is) for the type or recipe ``name``."""
    tensors = [(t.name, tuple(int(s) for s in reversed(t.shape.tolist()))) for t in reader.tensors]
    if name == "Q4_K_M":
        return q4_k_m_types(tensors, int(reader.fields["llama.block_count"].contents()))
    qtype = GGMLQuantizationType[name]
    return {n: qtype if len(shape) >= 2 and shape[-1] % QK == 0 else None for n, shape in tensors}


def _copy_quantized(reader, writer, name: str, progress: bool) -> None:
    """Every field and tensor of ``reader`` into ``writer``, tensors of 2+ dimensions as ``tensor_types`` says."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        if key == Keys.General.FILE_TYPE:  # replaced in place, as llama.cpp's gguf_set_val_u32 does
            writer.add_file_type(FILE_TYPES[name])
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    if Keys.General.FILE_TYPE not in reader.fields:  # llama.cpp and the tools show it as the file's type
        writer.add_file_type(FILE_TYPES[name])
    types = tensor_types(reader, name)
    for t in tqdm(reader.tensors, desc=f"quantize {name}", disable=not progress, leave=False):
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # numpy order (rows, cols)
        qtype = types[t.name]
        if qtype is None:
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape), raw_dtype=t.tensor_type)
            continue
        w = dequantize(t.data, t.tensor_type, shape)
        writer.add_tensor(t.name, QUANTIZERS[qtype](w), raw_dtype=qtype)  # byte shape -> weight shape
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
