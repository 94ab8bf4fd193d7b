"""minillm: a readable, measured reference for fast LLM inference.

Shape legend used in every docstring and ``# (...)`` comment:
    B batch, T tokens in this forward, S key/value positions, H query heads, Hkv key/value heads,
    D head dim, C model dim, F feed-forward dim, V vocabulary size.

Start with ``load_model()`` (the embedded SmolLM2-135M-Instruct), then ``generate_cached`` or its
baseline ``generate_naive``.
"""

from .generation import GenerationResult, decode_step, generate, generate_cached, generate_naive, prefill
from .kv_cache import KVCache, kv_cache_bytes
from .errors import ModelFileError
from .loading import default_model_path, load_model
from .config import ModelConfig
from .model import Decoder
from .sampling import logits_to_probs, sample
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer
from .paged.llm import LLM  # vLLM's API: from minillm import LLM, SamplingParams
from .paged.beam import BeamSearchParams

__all__ = [
    "BeamSearchParams", "Decoder", "GenerationResult", "KVCache", "LLM", "ModelConfig", "ModelFileError",
    "SamplingParams", "Tokenizer",
    "decode_step", "default_model_path", "generate", "generate_cached", "generate_naive", "kv_cache_bytes",
    "load_model", "logits_to_probs", "prefill", "sample",
]
