"""Int8 activations for the 4-bit layers: llama.cpp's recipe for its 4-bit formats on x86 (a Q4 weight meets a
Q8 activation). Each row of x is rounded to int8 in blocks of 32 inputs with one float scale per block, d =
max |x| / 127, so that the codes can meet it in integer dot products (``minillm.kernels.int4_a8_linear``):
one vpmaddubsw does 32 multiply-adds, where the float path converts every code and spends one FMA on it. On
a CPU without AVX-512 that conversion, not the memory, bounds a one-row product (docs/decode.md). The price
is the rounding of x (each layer's output moves by about 1% of its size; measured in docs/decode.md). The
choice is not saved with a quantized checkpoint: call ``quantize_activations`` after loading.
"""

from __future__ import annotations

from torch import nn

from .qlinear import QuantLinear


def quantize_activations(model: nn.Module, bits: int = 8) -> int:
    """Make every 4-bit ``QuantLinear`` of ``model`` round its input to ``bits``-bit blocks before its product
    (``QuantLinear.act_bits``; its reference rounds the same way). Returns how many layers changed.

    Raises:
        ValueError: ``bits`` is not 8 (the only width the kernel takes), or the model has no 4-bit layer.
    """
    if bits != 8:
        raise ValueError(f"bits: activations are rounded to 8 bits (llama.cpp's Q8 blocks), got {bits}")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.config.bits == 4]
    if not layers:
        raise ValueError("model: no 4-bit QuantLinear layers; quantize the weights to 4 bits first "
                         "(quantize_model or load_quantized)")
    odd = sorted({m.in_features for m in layers if m.in_features % 32})
    if odd:
        raise ValueError(f"model: activations are rounded in blocks of 32 inputs; layers with {odd} inputs do not "
                         "split into them")
    for m in layers:
        m.act_bits = bits
        if m.want_fast:
            m.prepare_fast()
    if hasattr(model, "drop_compiled_step"):  # a Decoder: a compiled decode froze the weights as they were
        model.drop_compiled_step()
    return len(layers)
