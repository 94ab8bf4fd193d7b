"""The output layer (the language-model head) quantized, and with it a tied token embedding.

SmolLM2-135M ties its output projection to its token embedding: one (49,152 x 576) matrix, 113 MB in
float32, read whole at every decode step (one row of it per token for the embedding). Once the blocks'
linear layers are 4-bit (about 60 MB) it is most of what a decode step reads. GPTQ and AWQ leave it
in float16; llama.cpp's files keep it in 6 or 8 bits (the shipped Q4_1 file: Q8_0).
``quantize_output(model, kind)`` replaces ``model.output`` by a ``QuantLinear``: "int8" (symmetric, one
scale per row, torch's int8 weight-only kernel: 28 MB) or "int4" (groups of ``INT4_GROUP_SIZE`` with the
range search, the blocks' int4 kernel: 15-16 MB).

A tied embedding then reads the same quantized matrix (``QuantLinear.rows`` dequantizes only the
looked-up rows: no second copy). Round to nearest only; the int8 head costs nothing measurable in
perplexity, the int4 head is past the course's quality budget (docs/quantization.md).
"""

from __future__ import annotations

import torch

from .qlinear import QuantLinear
from .rtn import QuantConfig, rtn_quantize

HEAD_KINDS = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32


def head_config(kind: str) -> QuantConfig | None:
    """The ``QuantConfig`` of a head kind ("none": None).

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in HEAD_KINDS:
        raise ValueError(f"quant_head: {kind!r} is not one of {HEAD_KINDS}")
    if kind == "int8":
        return QuantConfig(8, -1, sym=True)
    if kind == "int4":
        return QuantConfig(4, INT4_GROUP_SIZE, mse=True)
    return None


def head_kind(config: QuantConfig) -> str:
    """The kind whose ``head_config`` is ``config`` (a checkpoint's metadata names it)."""
    return next(k for k in HEAD_KINDS[1:] if head_config(k) == config)


@torch.no_grad()
def quantize_output(model, kind: str, fast: bool = True) -> dict:
    """Quantize ``model.output`` in place (``kind`` "int8" or "int4"; "none" leaves it).

    Returns {"quant_head": kind, "bits", "group_size", "bytes" (what a forward reads), "float_bytes",
    "rel_error" (||W_hat - W|| / ||W||)}.

    Raises:
        ValueError: an unknown kind, or an output layer already quantized.
    """
    config = head_config(kind)
    if config is None:
        return {"quant_head": "none"}
    if isinstance(model.output, QuantLinear):
        raise ValueError("model: its output layer is quantized already; load the float model to quantize it again")
    model.drop_compiled_step()  # a compiled decode froze the weights as they were
    w = model.output.weight.float()  # (V, C)
    float_bytes = w.numel() * model.output.weight.element_size()
    qw = rtn_quantize(w, config)
    bias = getattr(model.output, "bias", None)
    model.output = (model.quant_linear_class or QuantLinear)(qw, bias, fast=fast)  # the speed layer's, if swapped in
    rel = ((qw.dequantize() - w).norm() / w.norm()).item()
    return {"quant_head": kind, "bits": config.bits, "group_size": config.group_size,
            "bytes": model.output.kernel_nbytes(), "float_bytes": float_bytes, "rel_error": rel}
