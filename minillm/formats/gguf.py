"""GGUF files: llama.cpp's container, read with the ``gguf`` package (llama.cpp's own reader).

minillm reads the config from the metadata, dequantizes the blocks (``minillm.formats.gguf_blocks``), undoes
llama.cpp's Q/K row permutation and maps tensor names to its own. State-dict names (Linear weights
as (out, in), like torch)::

State-dict names (Linear weights as (out, in), like torch)::

    tok_embeddings.weight (V, C)        pos_embeddings.weight (max_seq_len, C)  [gpt2]
    layers.{i}.attn_norm.weight (C,)    layers.{i}.attn_norm.bias [gpt2]
    layers.{i}.attn.wq.weight (H*D, C)  wk, wv (Hkv*D, C)   wo (C, H*D)   (+ .bias where present)
    layers.{i}.ffn_norm.weight (C,)
    layers.{i}.mlp.w_gate.weight (F, C) [llama]   w_up (F, C)   w_down (C, F)
    norm.weight (C,)                    output.weight (V, C) [untied models]
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import gguf_blocks
from ..errors import ModelFileError
from ..config import ModelConfig, weight_shapes


def read_gguf(path: str | Path):
    """Open a GGUF file with the ``gguf`` package's reader (memory-mapped).

    Raises:
        ModelFileError: missing file, not a GGUF file (wrong magic), or truncated/corrupt.
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/... on cut or corrupt files
        raise ModelFileError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    # the reader memory-maps lazily; a file cut inside the tensor data shows up as short tensors
    for t in reader.tensors:
        if t.data.nbytes < t.n_bytes:
            raise ModelFileError(
                f"{path}: truncated GGUF file: tensor {t.name} has {t.data.nbytes} of its {t.n_bytes} bytes"
            )
    # a damaged offset points into another tensor's bytes, which would load as another model: as llama.cpp, refuse
    # tensors that are not aligned or that overlap
    alignment = getattr(reader, "alignment", 32)
    end = reader.data_offset
    for t in sorted(reader.tensors, key=lambda t: t.data_offset):
        if (t.data_offset - reader.data_offset) % alignment or t.data_offset < end:
            where = "inside the previous tensor" if t.data_offset < end else f"off the {alignment}-byte alignment"
            raise ModelFileError(f"{path}: corrupt GGUF file: tensor {t.name} starts at byte {t.data_offset}, {where}")
        end = t.data_offset + t.n_bytes
    return reader


def _field(reader, key: str, path, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise ModelFileError(f"{path}: metadata key {key!r} is missing")
    return field.contents()


def config_from_gguf(reader, path="<gguf>") -> ModelConfig:
    """Read a ``ModelConfig`` from GGUF metadata (``{arch}.block_count`` etc.).

    Raises:
        ModelFileError: architecture other than llama, or a missing metadata key.
    """
    try:
        return _config_from_gguf(reader, path)
    except (ValueError, ZeroDivisionError, TypeError) as e:
        if isinstance(e, ModelFileError):
            raise
        raise ModelFileError(f"{path}: bad metadata: {e}") from e


def _config_from_gguf(reader, path) -> ModelConfig:
    arch = _field(reader, "general.architecture", path)
    if arch != "llama":
        raise ModelFileError(
            f"{path}: architecture {arch!r} is not supported; minillm reads GGUF files of the 'llama' "
            "architecture (or Hugging Face folders of LlamaForCausalLM / GPT2LMHeadModel)"
        )
    n_heads = int(_field(reader, "llama.attention.head_count", path))
    dim = int(_field(reader, "llama.embedding_length", path))
    names = {t.name for t in reader.tensors}
    scaling = reader.fields.get("llama.rope.scaling.type")
    if (scaling is not None and scaling.contents() not in ("none", "")) or "rope_freqs.weight" in names:
        raise ModelFileError(f"{path}: RoPE scaling (llama.rope.scaling.* or rope_freqs.weight) is not supported; "
                             "minillm implements plain RoPE")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, "llama.vocab_size", path, default=len(tokens.data) if tokens else None)
    return ModelConfig(
        arch="llama",
        n_layers=int(_field(reader, "llama.block_count", path)),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv", path, default=n_heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", path, default=dim // n_heads)),
        ffn_dim=int(_field(reader, "llama.feed_forward_length", path)),
        vocab_size=int(vocab),
        max_seq_len=int(_field(reader, "llama.context_length", path)),
        rope_base=float(_field(reader, "llama.rope.freq_base", path, default=10000.0)),
        norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", path)),
        tie_embeddings="output.weight" not in names,
    )


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (its converter's ``permute``).

    llama.cpp rotates dimension pairs (2i, 2i+1); Hugging Face Llama rotates (i, i + D/2). The
    converter reorders each head's rows from halves to interleaved pairs; this puts them back.
    w: (n_heads * D, C) -> same shape. Use n_heads for Q and n_kv_heads for K.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_q.weight": "attn.wq.weight",
    "attn_k.weight": "attn.wk.weight",
    "attn_v.weight": "attn.wv.weight",
    "attn_output.weight": "attn.wo.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "mlp.w_gate.weight",
    "ffn_up.weight": "mlp.w_up.weight",
    "ffn_down.weight": "mlp.w_down.weight",
}


def load_gguf_state(reader, config: ModelConfig, path="<gguf>", progress: bool = False) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of a llama GGUF to float32, in minillm's names and layout.

    Raises:
        ModelFileError: a missing tensor, a shape that disagrees with the metadata, or a tensor type
            that cannot be dequantized.
    """
    from tqdm.auto import tqdm

    by_name = {t.name: t for t in reader.tensors}
    if config.n_layers * len(_GGUF_NAMES) > len(by_name):  # before listing them: a damaged count can be in the millions
        raise ModelFileError(f"{path}: block_count says {config.n_layers} layers, but the file holds only "
                             f"{len(by_name)} tensors; the file is damaged or not a complete model")
    wanted = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight"}
    if not config.tie_embeddings:
        wanted["output.weight"] = "output.weight"
    for i in range(config.n_layers):
        for g, m in _GGUF_NAMES.items():
            wanted[f"blk.{i}.{g}"] = f"layers.{i}.{m}"
    missing = [g for g in wanted if g not in by_name]
    if missing:
        raise ModelFileError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    shapes = weight_shapes(config)
    state = {}
    for gname, name in tqdm(wanted.items(), desc="dequantizing", disable=not progress, leave=False):
        t = by_name[gname]
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dimensions innermost first
        if shape != shapes[name]:
            raise ModelFileError(
                f"{path}: tensor {gname} has shape {shape} but the metadata implies {shapes[name]}"
            )
        try:
            w = gguf_blocks.dequantize(t.data, t.tensor_type, shape)
        except ValueError as e:
            raise ModelFileError(f"{path}: tensor {gname}: {e}") from e
        if not torch.isfinite(w).all():
            raise ModelFileError(f"{path}: tensor {gname} holds NaN or infinite values: the file is corrupt")
        if gname.endswith("attn_q.weight"):
            w = unpermute_rope_rows(w, config.n_heads)
        elif gname.endswith("attn_k.weight"):
            w = unpermute_rope_rows(w, config.n_kv_heads)
        state[name] = w
    return state
