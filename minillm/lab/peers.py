"""The peers every benchmark measures beside minillm, loaded in one place: transformers on the same GGUF
weights (``bench decode``, ``serve-bench --peer``, the tests' oracle) and llama.cpp through
llama-cpp-python (``bench decode --peer llamacpp``, notebook 05a). Both are optional at import time:
each loader imports its package when called."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..loading import default_model_path

LLAMACPP_INSTALL = "pip install llama-cpp-python==0.3.36 (it compiles llama.cpp from source: several minutes)"


def load_transformers_peer(model_path=None, dtype=torch.float32, device="cpu", attn_implementation: str | None = None):
    """transformers' LlamaForCausalLM on the same GGUF (the oracle and the speed peer), in eval mode.

    transformers dequantizes the GGUF itself (through the gguf package), so both run the same
    float weights. ``attn_implementation``: None for transformers' default, "sdpa" for its continuous
    batching (``serve-bench --peer``; transformers 5 pages it in the manager, and "paged|sdpa" is deprecated).
    """
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = Path(model_path) if model_path else default_model_path()
    attn = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, **attn)
    return hf.to(device).eval()


def llamacpp_available() -> bool:
    """Whether the optional peer ``llama_cpp`` (llama-cpp-python) imports."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llamacpp_build() -> str:
    """The x86 vector extensions this llama.cpp build uses, e.g. "AVX2 FMA F16C AVX512": a record states which
    instructions the peer ran, since llama-cpp-python compiles for the machine it is installed on."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    flags = re.findall(r"\b(AVX\w*|FMA|F16C|AMX\w*) = 1", info)
    return " ".join(dict.fromkeys(flags)) or "no AVX"


def load_llamacpp_peer(model_path, n_threads: int, n_ctx: int):
    """llama.cpp (through llama-cpp-python) on a GGUF file, CPU only, ``n_threads`` for decode and prefill.

    Raises:
        ValueError: ``llama_cpp`` is not installed (the message says how to install it).
    """
    try:
        import llama_cpp
    except ImportError:
        raise ValueError(f"peer: llamacpp needs the optional package llama-cpp-python; {LLAMACPP_INSTALL}") from None
    path = Path(model_path) if model_path else default_model_path()
    return llama_cpp.Llama(model_path=str(path), n_threads=n_threads, n_threads_batch=n_threads, n_ctx=n_ctx,
                           n_gpu_layers=0, verbose=False)
