"""The speed layer's linear layer: W as one column block per CPU core, read by minillm's few-row kernel (or one
batched matmul) for products of a few rows, and a copy in oneDNN's blocked layout for products of many rows (see
``FastLinear``). Its twin is the library's ``minillm.linear.Linear`` (``linear_naive`` is the baseline of both)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..linear import Linear
from . import kernels


def _onednn_linear_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_linear_available()  # oneDNN's packed float32 linear (see Linear)


def _cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), or "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def _amd_avx512() -> bool:
    """AMD's AVX-512 (Zen 4, whose vector units are 256 bits wide), where the measured choices differ."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and _cpu_vendor() == "AuthenticAMD"


def _few_rows() -> int:
    """The most rows ``kernels.f32_linear`` takes (more go to oneDNN): up to where it is ahead over a forward's
    layers (``bench products``, docs/decode.md). On the Intel Xeon that is 96 rows in AVX-512's 16 lanes. On AMD's
    CPUs, reading W in tiles (``KERNEL_TILES``), it is 48 rows with AVX-512 (Zen 4) and 24 in AVX2's 8 lanes, bound
    by their arithmetic sooner. Elsewhere in AVX2 it is ahead up to 4 rows."""
    vendor = _cpu_vendor()
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return 24 if vendor == "AuthenticAMD" else 4
    return {"AuthenticAMD": 48, "GenuineIntel": 96}.get(vendor, 4)


def _kernel_tiles() -> bool:
    """Whether the few-row kernel reads W in tiles of columns, each over all of W^T's rows with the sums in
    registers while the next tile streams into L2, rather than in blocks of rows (dense.cpp). On AMD's CPUs the
    tiles were measured faster at every row count, with AVX-512 and capped at AVX2 (docs/decode.md: a Zen 4); on
    Intel's AVX-512 the blocks were measured best."""
    return _cpu_vendor() == "AuthenticAMD"


FEW_ROWS, KERNEL_TILES = _few_rows(), _kernel_tiles()


def _onednn_padding() -> dict[int, int]:
    """Row counts ``Linear`` pads with zero rows before a oneDNN product (rows -> padded rows; cut off after). On the
    AMD EPYC with AVX-512 oneDNN's kernels for two rows are slower than its kernels for four: a forward's layers took
    28.9 ms at two rows and 24.4 padded to four, while three rows gained nothing from padding (docs/decode.md). Two
    rows reach oneDNN there only where minillm's kernels are not built. Elsewhere no padding is measured."""
    return {2: 4} if _amd_avx512() else {}


ONEDNN_PADDING = _onednn_padding()


class FastLinear(nn.Module):
    """``y = x W^T + b``, with W stored as ``n_shards`` column blocks, one per CPU core, and (on a
    CPU in float32, for products of several rows) a second copy packed in oneDNN's blocked layout.

    ``weight_shards`` is (n_shards, in_features, out_features / n_shards): shard s holds output columns
    ``s * n .. (s + 1) * n - 1`` of ``W^T``, contiguous, so each core streams a block of its own
    (Megatron-LM's column-parallel linear, Shoeybi et al. 2019, across cores). Products of up to
    ``FEW_ROWS`` rows (a decode step, a speculative verification, a small batch) read the shards with
    minillm's kernel (``kernels.f32_linear``: W streamed once, in blocks of rows or in tiles of columns,
    ``KERNEL_TILES``, the rows' sums in registers; a row's result does not depend on the other rows)
    where it is built, else as one batched matmul. Larger products
    (a prefill, a large batch) go through oneDNN's ``linear`` with W reordered once (``packed_weight``: as much
    memory again as W, rebuilt when ``weight_shards`` is replaced or written through the Parameter), the
    kernel ``torch.compile`` uses for frozen float32 linears (a row count oneDNN runs slowly is padded first:
    ``ONEDNN_PADDING``). Why: the kernel decides how close to the memory
    bandwidth the same bytes stream, and which wins moves with the rows and the machine (docs/decode.md;
    notebook 01's ``minillm.lab.layouts.measure_linear_layouts``). Gradients, other devices and dtypes use the shards;
    ``minillm.threads`` chooses the threads. ``linear_naive`` is the baseline the tests compare with.

    Args:
        weight: (out_features, in_features), in PyTorch's usual layout.
        bias: (out_features,) or None.
        n_shards: column blocks (1 = a plain ``x @ W^T``); falls back to 1 when it does not divide
            out_features.
    """

    @classmethod
    def from_linear(cls, layer: Linear, n_shards: int) -> FastLinear:
        """The same product as the library's ``layer`` (its weight and bias), laid out for this CPU."""
        return cls(layer.weight.detach(), None if layer.bias is None else layer.bias.detach(), n_shards)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, n_shards: int = 1):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if n_shards < 1 or self.out_features % n_shards:
            n_shards = 1
        self.n_shards = n_shards
        shards = weight.t().reshape(self.in_features, n_shards, -1).transpose(0, 1)  # (S, in, out/S)
        self.weight_shards = nn.Parameter(shards.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
        self._packed = None  # oneDNN copy of W: never saved, copied or moved
        self._packed_from = None  # the tensor it was made from, kept alive so that its address is not reused
        self._packed_version = None

    @property
    def weight(self) -> torch.Tensor:
        """(out_features, in_features), reassembled (a copy when sharded)."""
        return self.weight_shards.transpose(0, 1).reshape(self.in_features, self.out_features).t()

    def load_weight(self, weight: torch.Tensor) -> None:
        """Replace W with ``weight`` (out_features, in_features), keeping the shard layout."""
        self.weight_shards.data = FastLinear(weight.to(self.weight_shards.dtype), None, self.n_shards).weight_shards.data

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``W[index]`` (..., in_features) without reassembling W (tied-embedding lookups)."""
        per_shard = self.out_features // self.n_shards
        return self.weight_shards[index // per_shard, :, index % per_shard]

    def packed_weight(self) -> torch.Tensor:
        """W reordered into oneDNN's blocked layout (an opaque tensor), built once per weight."""
        w, src = self.weight_shards, self._packed_from
        # same storage (still held by src, so a new tensor cannot sit at its address) and no in-place write
        if src is None or src.data_ptr() != w.data_ptr() or src.shape != w.shape or self._packed_version != w._version:
            self._packed = None  # free the old copy first
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous())
            self._packed_from, self._packed_version = w.detach(), w._version
        return self._packed

    def _uses_onednn(self, x: torch.Tensor) -> bool:
        w = self.weight_shards
        return (_ONEDNN and x.numel() > self.in_features and w.device.type == "cpu"
                and w.dtype == torch.float32 and x.dtype == torch.float32
                and not kernels.differentiated(x, w, *(() if self.bias is None else (self.bias,))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if torch.compiler.is_compiling():  # traced by torch.compile: its own GEMM picks the layout
            return F.linear(x, self.weight, self.bias)
        w = self.weight_shards
        if (x.numel() <= FEW_ROWS * self.in_features and w.shape[2] % kernels.TILE == 0 and w.is_contiguous()
                and kernels.fused_ok(x, w)):
            return self.forward_few_rows(x)
        return self.forward_onednn(x) if self._uses_onednn(x) else self.forward_shards(x)

    def forward_few_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The product through minillm's few-row kernel over the shards (CPU, float32)."""
        y = kernels.f32_linear(x.reshape(-1, self.in_features), self.weight_shards, tiles=KERNEL_TILES)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def forward_onednn(self, x: torch.Tensor, pad: bool = True) -> torch.Tensor:
        """The product through the packed oneDNN copy (CPU, float32); with ``pad`` a row count in ``ONEDNN_PADDING`` is
        padded with zero rows, which oneDNN's kernels for more rows stream faster (the padding is cut off)."""
        rows = x.numel() // self.in_features
        padded = ONEDNN_PADDING.get(rows, rows) if pad else rows
        x2 = x if padded == rows else torch.cat([x.reshape(rows, self.in_features),
                                                 x.new_zeros(padded - rows, self.in_features)])
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed_weight(), self.bias, "none", [], "")
        return y if padded == rows else y[:rows].reshape(*x.shape[:-1], self.out_features)

    def forward_shards(self, x: torch.Tensor) -> torch.Tensor:
        """The product through the column shards (one ``torch.bmm``)."""
        if self.n_shards == 1:
            y = x @ self.weight_shards[0]
        else:
            x2 = x.reshape(1, -1, self.in_features).expand(self.n_shards, -1, -1)  # (S, N, in)
            y = torch.bmm(x2, self.weight_shards)  # (S, N, out/S)
            y = y.transpose(0, 1).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def __getstate__(self):  # copy.deepcopy / pickle: the packed copy is rebuilt, not copied
        return {**self.__dict__, "_packed": None, "_packed_from": None, "_packed_version": None}
