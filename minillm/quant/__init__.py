"""Weight quantization: one module per method, all producing the same ``QuantizedWeight``.

    rtn.py        round-to-nearest (the baseline every method is compared with)
    gptq.py       GPTQ (Frantar et al., ICLR 2023): error feedback through the inverse Hessian
    awq.py        AWQ (Lin et al., MLSys 2024): activation-aware per-channel scales, then clipping
    pack.py       int2/3/4/8 codes packed into int32 words; cli.py: ``python -m minillm perplexity | quantize``
    qlinear.py    ``QuantLinear``: packed weights + scales + zeros, a reference and a fast forward
    recipe.py     ``Recipe``: a run's options in one frozen dataclass; GPTQ's presets ``PAPER`` and ``BEST``
    pipeline.py   ``quantize_model(model, recipe, calib)``: block by block, in execution order, on calibration text
    checkpoint.py save / load a quantized model (safetensors); head.py: the output layer in int8 or int4
    activations.py  int8 activations for the 4-bit layers (llama.cpp's Q8 blocks, integer dot products)
    bitrate.py    variable bitrate as ExLlamaV2 does it (bitrate_cli.py: ``quantize --bpw``; sensitivity.py: KL costs)

Conventions (GPTQ / AutoGPTQ / vLLM's; shapes in ``QuantizedWeight``): W is (out_features, in_features), input column
j is in group ``g_idx[j]``, and the dequantized weight is ``scales[:, g_idx] * (codes - zeros[:, g_idx])``.
"""

from ..formats.gguf_quant import write_gguf  # re-exported from its old place (it moved to formats/)
from .awq import search_clip, search_scales
from .checkpoint import load_quantized, save_quantized
from .gptq import Hessian, gptq_quantize
from .pipeline import calibration_tokens, quantize_model
from .qlinear import QuantLinear
from .recipe import BEST, PAPER, Recipe
from .rtn import QuantConfig, QuantizedWeight, fake_quantize, rtn_quantize

__all__ = ["BEST", "Hessian", "PAPER", "QuantConfig", "QuantLinear", "QuantizedWeight", "Recipe", "calibration_tokens",
           "fake_quantize", "gptq_quantize", "load_quantized", "quantize_model", "rtn_quantize", "save_quantized",
           "search_clip", "search_scales", "write_gguf"]
