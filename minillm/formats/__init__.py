"""Readers and writers of model files: GGUF (llama.cpp's container and its block formats) and Hugging
Face checkpoint folders, into minillm's state-dict names (listed in ``minillm.formats.gguf``).

    gguf.py         read a GGUF file: its config, its tensors dequantized
    gguf_blocks.py  llama.cpp's block formats decoded (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K, F16)
    gguf_quant.py   the same blocks encoded (Q8_0, Q4_0, Q4_1, Q5_0), and ``write_gguf``
    kquants.py      the k-quant encoders (Q4_K, Q6_K) and llama.cpp's Q4_K_M recipe
    hf.py           Hugging Face checkpoint folders (config.json + safetensors)
"""

from .gguf import config_from_gguf, load_gguf_state, read_gguf
from .gguf_blocks import dequantize
from .hf import load_hf_checkpoint

__all__ = ["config_from_gguf", "dequantize", "load_gguf_state", "load_hf_checkpoint", "read_gguf"]
