"""Readers and writers of model files: GGUF (llama.cpp's container and its block formats) and Hugging
Face checkpoint folders, into minillm's state-dict names (listed in ``minillm.formats.gguf``)."""

from .gguf import config_from_gguf, load_gguf_state, read_gguf
from .gguf_blocks import dequantize
from .hf import load_hf_checkpoint

__all__ = ["config_from_gguf", "dequantize", "load_gguf_state", "load_hf_checkpoint", "read_gguf"]
