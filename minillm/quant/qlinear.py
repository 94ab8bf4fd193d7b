"""``QuantLinear``: a linear layer that holds packed integer weights, scales and zeros.

Two forwards with the same signature:

* ``forward_reference`` (the baseline): unpack, dequantize ``scales[:, g_idx] * (codes - zeros)`` to float32, then
  ``F.linear``. Exact: it computes with the very weight the quantizer chose.
* ``forward`` (the fast path): a kernel that reads the packed codes (about 1/7 of float32's bytes) and dequantizes in
  registers: torch's int4 weight-only kernels on bfloat16 activations, scales and zeros (within bfloat16 rounding;
  tested), on the CPU and on CUDA. 8-bit per-channel codes take torch's int8 kernel; other layouts fall back to the
  reference path (``fast`` says which, ``kernel`` names it). The speed layer's ``FastQuantLinear``
  (``minillm.fast.quant``) adds minillm's own CPU kernels, float32 throughout.

``rows(index)`` dequantizes only some output rows: the lookup of a tied embedding whose output layer is quantized
(``minillm.quant.head``). docs/quant_methods.md says which layouts the kernels take and how act-order and zero points
are mapped onto them.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .pack import codes_per_word, pack_weight, pack_zeros, unpack_rows, unpack_weight, unpack_zeros
from .rtn import QuantConfig, QuantizedWeight, dequantize_codes

KERNEL_GROUP_SIZES = (256, 128, 64, 32)


class QuantLinear(nn.Module):
    """``y = x W_hat^T + b`` with W_hat stored as packed codes.

    Buffers (saved by ``state_dict``):
        qweight: (ceil(I / k), O) int32, k = 32 // bits codes per word (``pack.pack_weight``).
        qzeros: (G, ceil(O / k)) int32 packed zero points.
        scales: (G, O) float32.
        g_idx: (I,) int32 group of each input column.
        bias: (O,) or absent.

    Args:
        qw: a ``QuantizedWeight`` from ``rtn_quantize``, ``gptq_quantize`` or AWQ.
        bias: (O,) float or None.
        fast: use the int4 kernel when the layout allows it (``prepare_fast``).
    """

    #: ``minillm.fast.compiled.compile_decode`` may trace it (torch's kernels have inductor lowerings; the
    #: reference path's dequantization is folded into a float32 constant under freezing)
    compilable = True
    act_bits = None  # 8: activations rounded to int8 in blocks of 32 first (``minillm.quant.activations``)

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, fast: bool = True):
        super().__init__()
        self.config = qw.config
        self.out_features, self.in_features = qw.shape
        bits = qw.config.bits
        self.register_buffer("qweight", pack_weight(qw.codes, bits))
        self.register_buffer("qzeros", pack_zeros(qw.zeros, bits))
        self.register_buffer("scales", qw.scales.t().contiguous().float())
        self.register_buffer("g_idx", qw.g_idx.to(device=qw.codes.device, dtype=torch.int32))
        self.register_buffer("bias", None if bias is None else bias.detach().clone().float())
        self.want_fast = fast  # use the kernel wherever the layout and device allow (kept across .to())
        self._kernel = None  # (kind, the tensors its product reads ...): see prepare_fast
        if fast:
            self.prepare_fast()

    @property
    def fast(self) -> bool:
        """Whether ``forward`` takes the int4 kernel (its tensors are built)."""
        return self._kernel is not None

    @property
    def kernel(self) -> str:
        """Which product ``forward`` runs: "torch-int4", "torch-int8" or "reference" (the speed layer's
        "minillm-int4", "minillm-int4-a8", "minillm-int8")."""
        return "reference" if self._kernel is None else self._kernel[0]

    # ---- storage ------------------------------------------------------------------------------
    def quantized_weight(self) -> QuantizedWeight:
        """Unpack into a ``QuantizedWeight`` (codes (O, I), scales/zeros (O, G))."""
        bits = self.config.bits
        return QuantizedWeight(unpack_weight(self.qweight, bits, self.in_features), self.scales.t().contiguous(),
                               unpack_zeros(self.qzeros, bits, self.out_features), self.g_idx, self.config)

    def dequantize(self) -> torch.Tensor:
        """(O, I) float32 weight the codes stand for."""
        return self.quantized_weight().dequantize()

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``W_hat[index]`` (..., I) float32, reading only those rows' codes, scales and
        zeros (a tied embedding's lookup; equal to ``dequantize()[index]`` bit for bit)."""
        bits, k = self.config.bits, codes_per_word(self.config.bits)
        flat = index.reshape(-1).long()
        codes = unpack_rows(self.qweight[:, flat], bits, self.in_features)  # (I, n)
        words = self.qzeros[:, flat // k].to(torch.int64) & 0xFFFFFFFF  # (G, n), as unsigned
        zeros = ((words >> (bits * (flat % k))) & ((1 << bits) - 1)).to(torch.int32)  # (G, n)
        g = self.g_idx.long()
        w = dequantize_codes(codes, self.scales[:, flat][g], zeros[g])  # (I, n)
        return w.t().reshape(*index.shape, self.in_features)

    def nbytes(self) -> int:
        """Bytes of the stored tensors (packed weights, zeros, scales, g_idx, bias)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.qzeros, self.scales, self.g_idx)
                   ) + (0 if self.bias is None else self.bias.numel() * 4)

    # ---- forwards -----------------------------------------------------------------------------
    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """(..., I) -> (..., O): dequantize, then ``F.linear`` (exact; with ``act_bits``, of x rounded first)."""
        x = self.round_activations(x)
        w = self.dequantize().to(device=x.device, dtype=x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def round_activations(self, x: torch.Tensor) -> torch.Tensor:
        """x as the layer's products see it: rounded to int8 in blocks of 32 inputs where ``act_bits`` is 8
        (``quantize_q8``, then back to x's dtype), else x itself."""
        if self.act_bits is None:
            return x
        # the rounded value; gradients pass through as if unrounded (straight-through)
        return x + (round_q8(x.detach()) - x).detach()

    def prepare_fast(self) -> bool:
        """Build the kernel's tensors if the layout allows it; returns whether the fast path is on."""
        self._kernel = None  # nothing stale if a build raises
        self._kernel = self._build()
        return self._kernel is not None

    def _build(self) -> tuple | None:
        """The kernel's (kind, tensors ...); None where no kernel takes the layout (the reference path)."""
        if self.qweight.device.type == "meta":  # no values to pack (a model being built before loading)
            return None
        qw = self.quantized_weight()
        I = self.in_features
        if self.config.bits == 8:
            return self._build_int8(qw)
        if self.config.bits > 4:
            return None
        # group ids outside the scales' columns are no layout at all (to_empty's uninitialised buffers, until
        # load_state_dict writes them): no kernel, rather than a bincount as large as a garbage id
        g_idx = qw.g_idx.long()
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= qw.scales.shape[1]):
            return None
        # the kernel wants contiguous groups: sort input columns by group once (identity unless act_order)
        perm = torch.argsort(g_idx, stable=True)
        g_sorted = g_idx[perm]
        sizes = torch.bincount(g_sorted)  # columns per group (a shorter last group is fine)
        # kernel groups: the largest supported size that tiles every group (a group of 128 is two
        # kernel groups of 64 sharing a scale; per-channel rows repeat their one scale)
        kg = next((k for k in KERNEL_GROUP_SIZES if I % k == 0 and bool((sizes % k == 0).all())), None)
        if kg is None:
            return None
        codes = qw.codes[:, perm]  # (O, I) in kernel order
        group_of_kernel_group = g_sorted.reshape(-1, kg)[:, 0]  # (I / kg,)
        s = qw.scales[:, group_of_kernel_group]  # (O, I / kg)
        z = qw.zeros[:, group_of_kernel_group].float()
        dev = self.qweight.device
        order = None if (perm == torch.arange(I, device=perm.device)).all() else perm.to(dev)
        return self._pack_int4(codes, s, z, kg, order)

    def _pack_int4(self, codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor, kg: int,
                   order: torch.Tensor | None) -> tuple | None:
        """torch's int4 kernel's tensors for codes (O, I) in kernel order, scales and zeros (O, I / kg) per kernel
        group of kg columns, and the input order (None: as stored)."""
        I, dev = self.in_features, self.qweight.device
        if dev.type == "cuda":
            # the CUDA kernel tiles K by 16 x inner_k_tiles (2, 4 or 8) and N by 8 (by 16 in ROCm builds:
            # asked here of every build); kernel groups make I a multiple of 32, so 2 always tiles K
            if self.out_features % 16:
                return None
            inner_k_tiles = next(t for t in (8, 4, 2) if I % (16 * t) == 0)
            # (O, I / 2) uint8, two codes per byte, the even column in the high nibble (torch >= 2.5)
            pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs.to(dev), inner_k_tiles)  # pragma: no cover
        else:
            if self.out_features % 16:  # the CPU kernel packs rows in blocks of 16
                return None
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        # torch's: s (q - z) = s (q - 8) + s (8 - z): its (scale, zero) pair is (s, s (8 - z)), in bfloat16
        scales_and_zeros = torch.stack([s.t(), (s * (8 - z)).t()], dim=-1).to(torch.bfloat16).contiguous()
        return ("torch-int4", packed, kg, scales_and_zeros.to(dev), order)

    def _build_int8(self, qw: QuantizedWeight) -> tuple | None:
        """The int8 kernel's tensors: one group per row (per channel) on the CPU only."""
        if qw.scales.shape[1] != 1 or self.qweight.device.type != "cpu":
            return None
        # s (q - z) = s (q - 128) + s (128 - z): int8 codes q - 128, and a per-row term times sum(x)
        w8 = (qw.codes - 128).to(torch.int8).contiguous()  # (O, I)
        s = qw.scales[:, 0].float()
        offset = s * (128 - qw.zeros[:, 0].float())  # (O,), zero for symmetric codes
        offset = None if bool((offset == 0).all()) else offset
        return self._pack_int8(w8, s, offset)

    def _pack_int8(self, w8: torch.Tensor, s: torch.Tensor, offset: torch.Tensor | None) -> tuple:
        """torch's int8 kernel's tensors for codes w8 (O, I) int8, scales s (O,) and the per-row offset (or None)."""
        return ("torch-int8", w8, s.to(torch.bfloat16), offset)

    def kernel_nbytes(self) -> int:
        """Bytes a forward through the fast path reads: the kernel's packed codes, scales and zeros (the
        stored ``nbytes`` when it falls back to dequantizing)."""
        if self._kernel is None:
            return self.nbytes()
        return sum(t.numel() * t.element_size() for t in self._kernel if isinstance(t, torch.Tensor)) + (
            0 if self.bias is None else self.bias.numel() * 4)

    def __getstate__(self):  # pickle / deepcopy: the kernel's tensors are rebuilt where the layer lands,
        return {**self.__dict__, "_kernel": None}  # whose machine may lack the kernel

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.want_fast:
            self.prepare_fast()

    def _load_from_state_dict(self, *args, **kwargs):  # load_state_dict writes the buffers in place:
        super()._load_from_state_dict(*args, **kwargs)  # the kernel's packed copies are rebuilt from them
        if self.want_fast:
            self.prepare_fast()

    def _apply(self, fn, recurse=True):  # .to(device): rebuild the kernel's tensors where the buffers went
        out = super()._apply(fn, recurse)
        if self.want_fast:
            try:
                self.prepare_fast()
            except RuntimeError:  # to_empty: the buffers hold no values yet; load_state_dict builds the kernel
                self._kernel = None
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., I) -> (..., O)
        if not self.fast or (torch.is_grad_enabled() and x.requires_grad):  # the kernels have no backward
            return self.forward_reference(x)
        return self.forward_kernel(self._kernel, x)

    def forward_kernel(self, kernel: tuple, x: torch.Tensor) -> torch.Tensor:
        """x (..., I) through ``kernel`` ((kind, tensors ...), as ``prepare_fast`` builds it) -> (..., O)."""
        kind, *tensors = kernel
        x2 = self.round_activations(x.reshape(-1, self.in_features))
        if kind == "torch-int8":
            w8, s, offset = tensors
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), w8, s)
            if offset is not None:
                y = y.to(x.dtype) + x2.sum(-1, keepdim=True) * offset.to(x.dtype)
        else:
            packed, kg, sz, perm = tensors
            x2 = (x2 if perm is None else x2[:, perm]).to(torch.bfloat16)
            if x2.is_cuda:  # pragma: no cover (no GPU in CI)
                y = torch.ops.aten._weight_int4pack_mm(x2, packed, kg, sz)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, kg, sz)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)


def quantize_q8(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float32 -> (codes, d): int8 codes (..., K) and one scale per block of ``block`` inputs (..., K /
    block), d = max |x| / 127 and codes = round(x / d) (0 where a block is all zero): llama.cpp's Q8_0."""
    xb = x.reshape(*x.shape[:-1], -1, block)
    d = xb.abs().amax(-1) / 127
    q = torch.where(d[..., None] == 0, torch.zeros_like(xb), torch.round(xb / d[..., None]))
    return q.to(torch.int8).reshape(x.shape), d


def round_q8(x: torch.Tensor) -> torch.Tensor:
    """x as int8 activations see it: ``quantize_q8``'s codes times their block's scale, in x's dtype."""
    q, d = quantize_q8(x.float())
    return (q.float().reshape(*d.shape, -1) * d[..., None]).reshape(x.shape).to(x.dtype)


def quant_linear_naive(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """The baseline of ``QuantLinear.forward`` (same signature): dequantize then matmul."""
    return layer.forward_reference(x)


def from_state(state: dict[str, torch.Tensor], prefix: str, config: QuantConfig, out_features: int,
               in_features: int, fast: bool = True) -> QuantLinear:
    """Rebuild a ``QuantLinear`` from saved buffers ``{prefix}.qweight`` etc. (``pipeline.load_quantized``).

    Raises:
        KeyError: a missing buffer; ValueError: buffers whose shapes or values disagree with each other and with
            (out_features, in_features, config), as in a damaged file.
    """
    bits = config.bits
    qw = QuantizedWeight(unpack_weight(state[f"{prefix}.qweight"], bits, in_features), state[f"{prefix}.scales"].t().float(),
                         unpack_zeros(state[f"{prefix}.qzeros"], bits, out_features), state[f"{prefix}.g_idx"], config)
    groups = qw.scales.shape[1] if qw.scales.dim() == 2 else -1
    if (tuple(qw.codes.shape) != (out_features, in_features) or tuple(qw.scales.shape) != (out_features, groups)
            or tuple(qw.zeros.shape) != (out_features, groups) or tuple(qw.g_idx.shape) != (in_features,)
            or (in_features and not 0 <= int(qw.g_idx.min()) <= int(qw.g_idx.max()) < groups)
            or not bool(torch.isfinite(qw.scales).all()) or (qw.codes.numel() and int(qw.codes.max()) >= 2 ** bits)):
        raise ValueError(f"{prefix}: codes {tuple(qw.codes.shape)}, scales {tuple(qw.scales.shape)}, zeros "
                         f"{tuple(qw.zeros.shape)}, g_idx {tuple(qw.g_idx.shape)} do not make a {bits}-bit "
                         f"({out_features}, {in_features}) layer with finite scales and groups in range")
    return QuantLinear(qw, state.get(f"{prefix}.bias"), fast=fast)


def warn_slow_layers(model, config: QuantConfig) -> int:
    """Warn once when layers that asked for the int4 kernel fall back to dequantizing their weight in
    every forward (about 20x slower than float on the 2-core CPU): more than 4 bits, or groups that no
    kernel group size tiles. Returns the number of such layers."""
    slow = [m for m in model.modules() if isinstance(m, QuantLinear) and m.want_fast and not m.fast]
    if slow:
        reason = (f"{config.bits} bits (the kernel reads 4-bit codes)" if config.bits > 4 else
                  f"group size {config.group_size} (the kernel's groups are {', '.join(map(str, KERNEL_GROUP_SIZES))}"
                  " columns, or -1 per channel, and must tile every group)")
        warnings.warn(f"{len(slow)} quantized layers have no int4 kernel for {reason}: they dequantize their weight "
                      "in every forward, about 20x slower than float. For speed use 2-4 bits and group size "
                      "32, 64, 128, 256 or -1", stacklevel=3)
    return len(slow)

