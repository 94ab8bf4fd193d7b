"""Round-to-nearest (RTN) quantization: the baseline of GPTQ and AWQ.

Each group of ``group_size`` consecutive input columns of one output row gets its own scale and
zero point from the group's min and max (asymmetric) or max |w| (symmetric):

    asymmetric: scale = (max - min) / (2^b - 1),   zero = round(-min / scale)
    symmetric:  scale = 2 max|w| / (2^b - 1),       zero = 2^(b-1)   (the middle code)
    codes = clamp(round(w / scale) + zero, 0, 2^b - 1),   w_hat = scale * (codes - zero)

The range always includes 0, as in the GPTQ reference code, so a zero weight stays zero. Scales are rounded to float16
before the zero point and codes follow from them: a quantizer measures the error of the weight a GPTQ / AWQ checkpoint
holds. A group size that does not divide in_features leaves a shorter last group; ``group_size=-1`` is per channel.

Sources: Frantar et al. 2023 (GPTQ), Sec. 2 and the quantizer of its reference implementation;
Jacob et al. 2018 (integer-arithmetic-only inference) for the affine scheme.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize a weight.

    Attributes:
        bits: 2..8.
        group_size: input columns per (scale, zero) pair; -1 = per output channel.
        sym: symmetric (zero fixed at the middle code) instead of asymmetric.
        mse: search each group's range instead of taking its min and max: shrink [min, max] by
            p = 1, 0.99, ..., 0.21 and keep the p minimising sum |w - w_hat|^2.4 (the ``mse=True``
            option of the GPTQ reference quantizer). Off in the paper's experiments. None (the
            default) means the method's measured best: ``Recipe.of`` turns it on for GPTQ and
            AWQ+GPTQ and leaves it off for RTN (the baseline) and AWQ (whose clip search is its range
            search); ``rtn_quantize`` and ``find_params`` read None as off.

    Raises:
        ValueError: naming the field.
    """

    bits: int = 4
    group_size: int = 128
    sym: bool = False
    mse: bool | None = None

    def __post_init__(self):
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"bits: must be an integer in 2..8, got {self.bits!r}")
        if not isinstance(self.group_size, int) or (self.group_size != -1 and self.group_size < 2):
            raise ValueError(f"group_size: must be -1 (per channel) or >= 2, got {self.group_size!r}")

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def group_of_columns(self, in_features: int) -> int:
        """Columns per group for a layer with ``in_features`` inputs."""
        return in_features if self.group_size == -1 else self.group_size

    def bits_per_weight(self, in_features: int) -> float:
        """Stored bits per weight of a layer with ``in_features`` inputs, as GPTQ / AWQ / ExLlama count
        them: the code, plus one float16 scale and one ``bits``-bit zero point per group, spread over
        the group's columns (4-bit group 64: 4 + 20/64 = 4.31; group 128: 4.16). ``g_idx`` is not
        counted (it is ``j // group_size`` unless act-order ran with dynamic groups; then it adds 32
        bits per input column, 32 / out_features per weight), nor the 2 spare bits of each 32-bit word
        that 3-bit codes leave (10 codes per word, ``pack.py``)."""
        groups = -(-in_features // self.group_of_columns(in_features))
        return self.bits + (16 + self.bits) * groups / in_features


@dataclass
class QuantizedWeight:
    """A quantized (out_features, in_features) weight.

    Attributes:
        codes: (O, I) int32 in [0, 2^bits - 1].
        scales: (O, G) float32 holding float16 values (``find_params`` rounds them), G = number of groups.
        zeros: (O, G) int32 zero points (codes).
        g_idx: (I,) int32, the group of each input column (``j // group_size`` unless GPTQ ran with
            act_order and dynamic groups).
        config: the ``QuantConfig``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    config: QuantConfig

    def dequantize(self) -> torch.Tensor:
        """(O, I) float32: ``scales[:, g_idx] * (codes - zeros[:, g_idx])``."""
        g = self.g_idx.long()
        return dequantize_codes(self.codes, self.scales[:, g], self.zeros[:, g])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)


def find_params(w: torch.Tensor, config: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero for each row of ``w`` (O, n) -> ((O,) float32 holding float16 values, (O,) int32).

    The range [min(w_min, 0), max(w_max, 0)] is mapped onto the codes 0..2^b-1; an all-zero row gets
    scale 1 (asymmetric: range [-1, 1]) so nothing divides by zero. With ``config.mse`` the range is
    shrunk per row to minimise the rounding error (see ``QuantConfig``).
    """
    w = w.float()
    xmin = w.min(dim=1).values.clamp(max=0)
    xmax = w.max(dim=1).values.clamp(min=0)
    if config.sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -1.0, xmin)
    xmax = torch.where(empty, 1.0, xmax)
    scale, zero = _scale_zero(xmin, xmax, config)
    if config.mse:
        best = torch.full_like(scale, float("inf"))
        for i in range(80):  # grid 100, max shrink 0.8, norm 2.4: the GPTQ reference's settings
            s1, z1 = _scale_zero((1 - i / 100) * xmin, (1 - i / 100) * xmax, config)
            err = (fake_quantize(w, s1[:, None], z1[:, None], config.maxq) - w).abs().pow(2.4).sum(1)
            better = err < best
            best, scale, zero = torch.where(better, err, best), torch.where(better, s1, scale), torch.where(better, z1, zero)
    return scale, zero.to(torch.int32)


def round_scale(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` rounded to the nearest float16 (kept in float32): what a checkpoint stores. A scale
    below float16's smallest subnormal (2^-24) becomes 2^-24 rather than 0, so nothing divides by zero."""
    return scale.float().clamp(max=65504.0).half().float().clamp(min=2.0 ** -24)


def _scale_zero(xmin: torch.Tensor, xmax: torch.Tensor, config: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    scale = round_scale((xmax - xmin) / config.maxq)  # the zero and codes follow from the stored scale
    if config.sym:
        return scale, torch.full_like(scale, (config.maxq + 1) // 2)
    return scale, torch.round(-xmin / scale).clamp(0, config.maxq)


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Codes of ``w`` (..., n) with per-row ``scale``/``zero`` broadcast against it -> int32."""
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, maxq).to(torch.int32)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``scale * (codes - zero)`` in float32: the one formula every path uses (so they agree bit for bit)."""
    return scale * (codes - zero).float()


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Quantize then dequantize: the float values the quantized weight stands for."""
    return dequantize_codes(quantize_codes(w, scale, zero, maxq), scale, zero)


def group_index(in_features: int, config: QuantConfig) -> torch.Tensor:
    """(I,) int32 group of each input column, ``j // group_size`` (a shorter last group when it does
    not divide)."""
    return (torch.arange(in_features) // config.group_of_columns(in_features)).to(torch.int32)


def rtn_quantize(weight: torch.Tensor, config: QuantConfig) -> QuantizedWeight:
    """Round-to-nearest quantization of ``weight`` (O, I).

    Returns:
        QuantizedWeight with G = ceil(I / group_size) groups (1 when per-channel).

    Raises:
        ValueError: weight is not 2-D or holds non-finite values.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight: expected (out_features, in_features), got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError("weight: holds NaN or inf; quantize a finite weight")
    O, I = weight.shape
    g = config.group_of_columns(I)
    scales, zeros, codes = [], [], []
    for start in range(0, I, g):
        block = weight[:, start:start + g]  # (O, g), shorter for a partial last group
        s, z = find_params(block, config)
        scales.append(s)
        zeros.append(z)
        codes.append(quantize_codes(block, s[:, None], z[:, None], config.maxq))
    return QuantizedWeight(torch.cat(codes, dim=1), torch.stack(scales, 1), torch.stack(zeros, 1),
                           group_index(I, config), config)
