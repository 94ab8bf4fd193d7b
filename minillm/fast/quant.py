"""``FastQuantLinear``: ``QuantLinear`` with minillm's own CPU kernels for its packed codes (``kernels.int4_linear``,
``int4_a8_linear``, ``int8_linear``: float32 throughout, so within float32 rounding of the reference, where torch's
int4 kernels compute in bfloat16). Layouts they do not take keep the library's torch kernels or reference path.

Under ``torch.compile`` on a CPU with AVX-512, inductor lowers torch's int4 and int8 products to GEMM templates of
its own and fuses them with the step (batch-1 compiled decode about 1.3x minillm's kernels there, which it can only
call): ``prepare_compile`` keeps torch's for compiled traces, minillm's for eager forwards (prefill, verification).
"""

from __future__ import annotations

import torch

from ..quant.qlinear import QuantLinear
from . import kernels


class FastQuantLinear(QuantLinear):
    """``QuantLinear`` whose CPU products are minillm's kernels where the layout allows (``kernel`` names it)."""

    torch_kernels = False  # True: compiled traces take torch's kernels (``prepare_compile``)
    _compile_kernel = None  # what compiled traces run when it is not ``_kernel``
    _library = False  # True while building the library's choice (``_torch_build``)

    def _ours(self) -> bool:
        return (not self._library and self.qweight.device.type == "cpu" and self.out_features % kernels.TILE == 0
                and kernels.available())

    def prepare_fast(self) -> bool:
        """The kernel's tensors (and, after ``prepare_compile``, torch's for compiled traces)."""
        self._compile_kernel = None
        on = super().prepare_fast()
        if self.torch_kernels and self.kernel.startswith("minillm"):
            self._compile_kernel = self._torch_build()
        return on

    def _torch_build(self) -> tuple | None:
        """The library's choice (torch's kernels), for compiled traces."""
        self._library = True
        try:
            return self._build()
        finally:
            self._library = False

    def _pack_int4(self, codes, s, z, kg, order):
        if not self._ours():
            return super()._pack_int4(codes, s, z, kg, order)
        if self.act_bits == 8 and order is None:
            # int8 activations times the codes in integer dot products (blocks of 32 in input order: not after
            # act-order's permutation, where the next kernel runs on x rounded first); z's term as s z sum(x)
            sz = (s * z).t().contiguous().float() if bool((z != 0).any()) else None
            return ("minillm-int4-a8", kernels.int4_a8_panels(codes), s.t().contiguous().float(), sz, kg)
        # W_hat = s (q - z) per kernel group, in float32, as the reference dequantizes
        return ("minillm-int4", kernels.int4_panels(codes), s.t().contiguous().float(), z.t().contiguous(), kg, order)

    def _pack_int8(self, w8, s, offset):
        if not self._ours():
            return super()._pack_int8(w8, s, offset)
        return ("minillm-int8", kernels.int8_panels(w8), s, offset)

    @property
    def compiled_kernel(self) -> str:
        """Which product a compiled trace (``compile_decode``) runs: ``kernel``, unless ``prepare_compile`` chose."""
        k = self._compile_kernel or self._kernel
        return "reference" if k is None else k[0]

    def prepare_compile(self) -> None:
        """``compile_decode`` is about to trace this layer: with AVX-512, compiled traces take torch's kernels
        (inductor's templates); elsewhere (AVX2 only: no template) minillm's serve both."""
        if self.kernel.startswith("minillm") and torch.backends.cpu.get_cpu_capability() == "AVX512":
            self.torch_kernels = True  # kept across .to(), copies and pickles (prepare_fast builds both)
            self._compile_kernel = self._torch_build()

    def __getstate__(self):
        return {**super().__getstate__(), "_compile_kernel": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., I) -> (..., O)
        if not self.fast or (torch.is_grad_enabled() and x.requires_grad):  # the kernels have no backward
            return self.forward_reference(x)
        compiled = self._compile_kernel is not None and torch.compiler.is_compiling()
        return self.forward_kernel(self._compile_kernel if compiled else self._kernel, x)

    def forward_kernel(self, kernel: tuple, x: torch.Tensor) -> torch.Tensor:
        kind, *tensors = kernel
        if not kind.startswith("minillm"):
            return super().forward_kernel(kernel, x)
        x2 = x.reshape(-1, self.in_features)
        if kind == "minillm-int4-a8":  # rounds the activations itself, in integer dot products
            y = kernels.int4_a8_linear(x2.float(), *tensors)
        else:
            x2 = self.round_activations(x2).float()
            if kind == "minillm-int4":
                panels, s, z, kg, perm = tensors
                y = kernels.int4_linear(x2 if perm is None else x2[:, perm], panels, s, z, kg)
            else:
                y = kernels.int8_linear(x2, *tensors)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)
