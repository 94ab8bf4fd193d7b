"""The speed layer's versions of the decoder's layers: the same parameters and results as ``minillm.model``'s, with a
layer's small operations fused in minillm's C++ (``kernels``: RMSNorm with the residual add, SwiGLU, RoPE with the
KV write) where they take the call: float32 on the CPU, kernels built, nothing differentiating, not traced by
``torch.compile`` (inductor fuses torch's operators itself). Elsewhere each falls back to its library twin.

Why: on a CPU a decode step's rows are short, and each torch operator costs a dispatch and a pass over memory;
these do in one pass what takes torch two to ten operators.

``accelerate`` changes each module's class in place (``swap``): the state stays where it is, only ``forward``
changes, so the library's module and the speed layer's share one set of weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kv_cache import KVCache
from ..model import Attention, Block, MLP, RMSNorm, attention
from . import kernels
from .paged import FastPagedKVCache


def swap(module: nn.Module, cls: type) -> None:
    """Give ``module`` the forward of ``cls``, a subclass of its class that adds no state."""
    if not issubclass(cls, type(module)):
        raise TypeError(f"{cls.__name__} is not a speed-layer twin of {type(module).__name__}")
    module.__class__ = cls


class FastRMSNorm(RMSNorm):
    """``RMSNorm`` in one pass per row (``kernels.rms_norm``); ``add_forward`` adds the residual in the same pass."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.fused_ok(x, self.weight):
            return kernels.rms_norm(x, self.weight, self.eps)
        return super().forward(x)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, forward(x + delta))``: a sublayer's output added to the residual stream, and the next
        sublayer's input (vLLM's ``fused_add_rms_norm``)."""
        if kernels.fused_ok(x, delta, self.weight):
            return kernels.add_rms_norm(x, delta, self.weight, self.eps)
        h = x + delta
        return h, self.forward(h)


class FastBlock(Block):
    """``Block`` whose attention output joins the residual stream in the same pass as the MLP's norm reads it
    (RMSNorm blocks only: ``accelerate`` leaves GPT-2's LayerNorm blocks as they are)."""

    def forward(self, x, layer_idx, rope, cache, mask):
        x, h = self.ffn_norm.add_forward(x, self.attn(self.attn_norm(x), layer_idx, rope, cache, mask))
        return x + self.mlp(h)


class FastMLP(MLP):
    """``MLP`` with SwiGLU's ``silu(gate) * up`` in one pass (``kernels.silu_mul``)."""

    def forward(self, x):
        if not self.gated:
            return super().forward(x)
        gate_up = self.w_gate_up(x)
        silu_mul = kernels.silu_mul if kernels.fused_ok(gate_up) else kernels.silu_mul_naive
        return self.w_down(silu_mul(gate_up))


class FastAttention(Attention):
    """``Attention`` that hands the fused QKV product to the paged cache's ``attend_qkv`` (RoPE and the KV write in
    one kernel) where it takes it, and under ``torch.compile`` on the CPU attends one unmasked query per row with
    ``attention_decode``, which inductor fuses better there."""

    def forward(self, x, layer_idx, rope, cache, mask):
        B, T, _ = x.shape
        qkv = self.wqkv(x)  # (B, T, (H + 2 Hkv) D)
        if rope is not None and isinstance(cache, FastPagedKVCache) and cache.takes_qkv and kernels.fused_ok(qkv):
            return self.wo(cache.attend_qkv(layer_idx, qkv, rope))
        q, k, v = self.heads(qkv, rope)
        if (T == 1 and mask is None and q.device.type == "cpu" and torch.compiler.is_compiling()
                and (cache is None or isinstance(cache, KVCache))):
            if cache is not None:
                k, v = cache.update(layer_idx, k, v)
            y = attention_decode(q, k, v)
        else:
            y = attention(q, k, v, mask) if cache is None else cache.attend(layer_idx, q, k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


def attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query per row, no mask (a decode step): softmax(q k^T / sqrt(D)) v as broadcast products
    and sums, each query head beside its KV head's group (GQA without repeating K and V).

    Written for ``torch.compile`` (``minillm.fast.compiled``): inductor turns the two sums into short loops
    fused with the softmax, where SDPA's fused kernel sets up a parallel region and buffers for each
    of the layers' one-row products (docs/roofline.md times the compiled step both ways).

    Args:
        q: (B, H, 1, D).
        k, v: (B, Hkv, S, D).

    Returns:
        (B, H, 1, D), as ``minillm.model.attention_naive``.
    """
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv, 1, D) / math.sqrt(D)  # each KV head's group of query heads, scaled
    scores = (qg * k[:, :, None]).sum(-1)  # (B, Hkv, group, S)
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (p[..., None] * v[:, :, None]).sum(-2).reshape(B, H, 1, D)


#: each library layer and its speed-layer twin
TWINS = {RMSNorm: FastRMSNorm, Block: FastBlock, MLP: FastMLP, Attention: FastAttention}
