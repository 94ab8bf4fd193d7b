"""A Hugging Face model folder from any model minillm loads (``python -m minillm export-hf DIR``).

What tools built on transformers need to talk about a model: ``tokenizer.json`` (the tokenizers library's
format) and ``tokenizer_config.json`` (the chat template, the special tokens) always; with weights,
``config.json`` and ``model.safetensors`` in the names of transformers' ``LlamaForCausalLM`` or
``GPT2LMHeadModel`` (the inverse of ``minillm.formats.hf``).

The tokenizer is minillm's own (``minillm.tokenizer``, tiktoken) written back as a byte-level BPE that counts
the same tokens. Token ids follow the merge list (``Tokenizer.from_vocab`` checks it), so a token's merge is
the last step of tiktoken's merge loop on its own bytes with the tokens ranked below it, and the merges, one per
token in id order, rank pairs as tiktoken does; tiktoken takes a piece that is a whole token as it is, which is
the tokenizers library's ``ignore_merges``.

The folder appears only when complete: everything is written into a temporary folder beside it, which is then
renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..errors import ModelFileError
from ..files import check_output_path
from ..config import ModelConfig
from ..tokenizer import Tokenizer
from .tokenizer_files import GPT2_PATTERN, SMOLLM_PATTERN, bytes_to_unicode
from .hf import _hf_config, load_hf_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors")


# -- the tokenizer ----------------------------------------------------------------------------------------
def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _pre_tokenizer(pattern: str) -> dict:
    """The tokenizers pre-tokenizer that splits text as tiktoken's regex ``pattern`` does (the inverse of
    ``minillm.formats.tokenizer_files._hf_pretokenizer``)."""
    if pattern == GPT2_PATTERN:
        return _byte_level(True)
    if pattern == SMOLLM_PATTERN:
        return {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(True)]}
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, _byte_level(False)]}


def _added_token(token_id: int, text: str, special: bool) -> dict:
    return {"id": token_id, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def _bpe(ranks: dict[bytes, int], piece: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's merge loop on ``piece`` with the tokens ranked below ``max_rank``: the parts it stops at. For a
    token's own bytes and rank these are the two tokens its merge joins (or more, for a token that no merge makes,
    which only a whole piece matches)."""
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        rank, at = min((ranks.get(a + b, max_rank), k) for k, (a, b) in enumerate(zip(parts, parts[1:])))
        if rank >= max_rank:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts


def tokenizer_json(tokenizer: Tokenizer) -> dict:
    """``tokenizer.json`` (the tokenizers library's BPE) that encodes every text as ``tokenizer.encode`` does,
    and text holding a special token's spelling as ``tokenizer.encode(text, allow_special=True)`` does.

    Returns the JSON object: vocabulary (token strings in GPT-2's byte-to-unicode form), merges, the
    pre-tokenizer, and the special tokens as added tokens.
    """
    b2u = bytes_to_unicode()
    enc = tokenizer.encoding
    special_ids = set(tokenizer.special_tokens.values())
    ids = {}  # token bytes -> id, the ordinary tokens only
    vocab = {}
    for i in range(tokenizer.vocab_size):
        if i in special_ids:
            continue
        piece = enc.decode_single_token_bytes(i)
        ids[piece] = i
        vocab["".join(b2u[b] for b in piece)] = i
    for text, i in tokenizer.special_tokens.items():
        vocab[text] = i
    merges = []  # one per token, in id order: the pair BPE joins last to make it
    for piece, i in sorted(ids.items(), key=lambda kv: kv[1]):
        if len(piece) > 1:
            parts = _bpe(ids, piece, max_rank=i)
            if len(parts) == 2:
                merges.append((i, *parts))
    as_text = lambda bs: "".join(b2u[b] for b in bs)  # noqa: E731
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added_tokens(tokenizer), "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(enc._pat_str),
        "post_processor": None,  # minillm adds no BOS or EOS around a text
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": [[as_text(a), as_text(b)] for _, a, b in merges]},
    }


def tokenizer_config(tokenizer: Tokenizer, max_seq_len: int | None) -> dict:
    """``tokenizer_config.json``: the special tokens (EOS also pads: batched tools need a pad token, and an
    EOS past the end is never read), the chat template, no BOS or EOS added to a text."""
    def text(token_id):
        return tokenizer._special_text(token_id) or None

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                 for a in added_tokens(tokenizer)},
        "bos_token": text(tokenizer.bos_id), "eos_token": text(tokenizer.eos_id), "pad_token": text(tokenizer.eos_id),
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
    if max_seq_len:
        cfg["model_max_length"] = max_seq_len
    return cfg


def added_tokens(tokenizer: Tokenizer) -> list[dict]:
    """The added tokens of ``tokenizer.json``: every special token, in id order; those minillm matches in any
    text (``Tokenizer.plain_added``) are not special, as in the folder they came from."""
    return [_added_token(i, text, text not in tokenizer.plain_added)
            for text, i in sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])]


# -- the weights --------------------------------------------------------------------------------------------
def hf_config(config: ModelConfig, tokenizer: Tokenizer | None) -> dict:
    """``config.json`` of transformers' LlamaForCausalLM or GPT2LMHeadModel for ``config``."""
    ids = {"bos_token_id": getattr(tokenizer, "bos_id", None), "eos_token_id": getattr(tokenizer, "eos_id", None)}
    ids["pad_token_id"] = ids["eos_token_id"]
    c = config
    if c.arch == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": c.n_layers, "n_embd": c.dim,
                "n_head": c.n_heads, "n_inner": c.ffn_dim, "n_positions": c.max_seq_len, "vocab_size": c.vocab_size,
                "layer_norm_epsilon": c.norm_eps, "activation_function": "gelu_new", "tie_word_embeddings": True,
                "dtype": "float32", **ids}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": c.n_layers,
            "hidden_size": c.dim, "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
            "head_dim": c.head_dim, "intermediate_size": c.ffn_dim, "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base}, "rope_theta": c.rope_base,
            "hidden_act": "silu", "tie_word_embeddings": c.tie_embeddings, "attention_bias": c.attn_bias,
            "mlp_bias": c.mlp_bias, "dtype": "float32", **ids}


def hf_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """minillm's names and layouts (``minillm.formats.gguf``) -> transformers' (the inverse of
    ``minillm.formats.hf``): Llama's Linear weights stay (out, in); GPT-2's Conv1D weights are (in, out), with
    q, k and v side by side in ``c_attn``. A tied output layer is left out (transformers ties it)."""
    out = {}
    if config.arch == "gpt2":
        out = {"transformer.wte.weight": state["tok_embeddings.weight"],
               "transformer.wpe.weight": state["pos_embeddings.weight"],
               "transformer.ln_f.weight": state["norm.weight"], "transformer.ln_f.bias": state["norm.bias"]}
        for i in range(config.n_layers):
            p, h = f"layers.{i}", f"transformer.h.{i}"
            for ours, theirs in (("attn_norm", "ln_1"), ("ffn_norm", "ln_2")):
                out[f"{h}.{theirs}.weight"] = state[f"{p}.{ours}.weight"]
                out[f"{h}.{theirs}.bias"] = state[f"{p}.{ours}.bias"]
            qkv = [state[f"{p}.attn.{n}.weight"] for n in ("wq", "wk", "wv")]
            out[f"{h}.attn.c_attn.weight"] = torch.cat(qkv).t()  # (C, 3C)
            out[f"{h}.attn.c_attn.bias"] = torch.cat([state[f"{p}.attn.{n}.bias"] for n in ("wq", "wk", "wv")])
            for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.w_up", "mlp.c_fc"), ("mlp.w_down", "mlp.c_proj")):
                out[f"{h}.{theirs}.weight"] = state[f"{p}.{ours}.weight"].t()
                out[f"{h}.{theirs}.bias"] = state[f"{p}.{ours}.bias"]
    else:
        out = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
        if not config.tie_embeddings:
            out["lm_head.weight"] = state["output.weight"]
        names = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
                 "attn.wo": "self_attn.o_proj", "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj",
                 "mlp.w_down": "mlp.down_proj"}
        for i in range(config.n_layers):
            p, h = f"layers.{i}", f"model.layers.{i}"
            out[f"{h}.input_layernorm.weight"] = state[f"{p}.attn_norm.weight"]
            out[f"{h}.post_attention_layernorm.weight"] = state[f"{p}.ffn_norm.weight"]
            for ours, theirs in names.items():
                out[f"{h}.{theirs}.weight"] = state[f"{p}.{ours}.weight"]
                if f"{p}.{ours}.bias" in state:
                    out[f"{h}.{theirs}.bias"] = state[f"{p}.{ours}.bias"]
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in out.items()}


def decoder_state(model) -> dict[str, torch.Tensor]:
    """A loaded ``Decoder``'s weights back in minillm's state names, float32; quantized layers are dequantized
    (``QuantLinear.weight``), fused projections (q, k, v in one; gate and up in one) split again."""
    c = model.config

    def weight(layer):
        return layer.weight.detach().float()

    state = {"tok_embeddings.weight": model.embedding_weight().detach().float()}
    if not c.tie_embeddings:
        state["output.weight"] = weight(model.output)
    if model.pos_embeddings is not None:
        state["pos_embeddings.weight"] = model.pos_embeddings.detach().float()

    def put(prefix, module):
        state[f"{prefix}.weight"] = weight(module)
        if getattr(module, "bias", None) is not None:
            state[f"{prefix}.bias"] = module.bias.detach().float()

    put("norm", model.norm)
    for i, block in enumerate(model.layers):
        p = f"layers.{i}"
        put(f"{p}.attn_norm", block.attn_norm)
        put(f"{p}.ffn_norm", block.ffn_norm)
        sizes = [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]
        _put_parts(state, block.attn, "wqkv", [f"{p}.attn.{n}" for n in ("wq", "wk", "wv")], sizes)
        put(f"{p}.attn.wo", block.attn.wo)
        if c.arch == "llama":
            _put_parts(state, block.mlp, "w_gate_up", [f"{p}.mlp.w_gate", f"{p}.mlp.w_up"], [c.ffn_dim, c.ffn_dim])
        else:
            put(f"{p}.mlp.w_up", block.mlp.w_up)
        put(f"{p}.mlp.w_down", block.mlp.w_down)
    return state


def _put_parts(state: dict, parent, fused: str, names: list[str], sizes: list[int]) -> None:
    """Projections that a model holds as one fused layer (rows side by side) or as separate layers."""
    if hasattr(parent, fused):
        layer = getattr(parent, fused)
        for name, w in zip(names, layer.weight.detach().float().split(sizes)):
            state[f"{name}.weight"] = w
        if getattr(layer, "bias", None) is not None:
            for name, b in zip(names, layer.bias.detach().float().split(sizes)):
                state[f"{name}.bias"] = b
        return
    for name in names:
        layer = getattr(parent, name.rsplit(".", 1)[1])
        state[f"{name}.weight"] = layer.weight.detach().float()
        if getattr(layer, "bias", None) is not None:
            state[f"{name}.bias"] = layer.bias.detach().float()


# -- reading the source and writing the folder ------------------------------------------------------------
def read_source(path: str | Path | None, weights: bool):
    """(max_seq_len or None, ModelConfig or None, state in minillm's names or None, Tokenizer or None) of a model
    minillm loads: the embedded GGUF (None), a .gguf file, a Hugging Face folder, a .safetensors file written
    by ``quantize``. The config and the state are read only with ``weights``.

    Raises:
        ModelFileError: see ``minillm.loading.load_model``.
    """
    from ..loading import default_model_path, load_model, tokenizer_of
    from .gguf import config_from_gguf, load_gguf_state, read_gguf

    path = default_model_path() if path is None else Path(path)
    if path.suffix == ".safetensors" and path.is_file():
        model, tokenizer = load_model(path, fast=False)  # the plain layers: their weights are read
        return model.config.max_seq_len, model.config, decoder_state(model) if weights else None, tokenizer
    if path.is_dir():
        tokenizer = tokenizer_of(path)
        if not weights:
            cfg = _hf_config(path)
            return cfg.get("max_position_embeddings") or cfg.get("n_positions"), None, None, tokenizer
        config, state = load_hf_checkpoint(path)
        return config.max_seq_len, config, state, tokenizer
    reader = read_gguf(path)
    config = config_from_gguf(reader, path)
    tokenizer = tokenizer_of(path, reader)
    return config.max_seq_len, config, load_gguf_state(reader, config, path) if weights else None, tokenizer


def export_hf(out: str | Path, model: str | Path | None = None, weights: bool = False,
              overwrite: bool = False) -> Path:
    """Write a Hugging Face folder for ``model`` (default: the embedded SmolLM2-135M-Instruct) at ``out``.

    Args:
        out: the folder to write; it appears only once complete.
        model: a .gguf file, a Hugging Face folder, a .safetensors file written by ``quantize``, or None.
        weights: also write config.json, generation_config.json and model.safetensors (float32).
        overwrite: replace an existing non-empty folder ``out``.

    Returns the folder. Raises ValueError naming the argument (``DIR``, ``--overwrite``) for a folder that
    exists and is not empty, a file at ``out``, or ``out`` holding the model read; ModelFileError for a model
    that cannot be read or has no tokenizer.
    """
    from safetensors.torch import save_file

    out = check_output_path(out, "DIR", sources=[model] if model else (), folder=True)
    if model is not None and Path(model).resolve().is_relative_to(out.resolve()):
        raise ValueError(f"DIR: {str(out)!r} holds the model being read ({model}); give another folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"DIR: {str(out)!r} exists and is not empty; pass --overwrite to replace it, "
                         "or give a new folder")
    max_len, config, state, tokenizer = read_source(model, weights)
    if tokenizer is None:
        raise ModelFileError(f"{model}: has no tokenizer.json minillm reads (byte-level BPE), so there is no "
                             "tokenizer to write")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    old = None
    try:  # from the moment it exists: any exception, KeyboardInterrupt and SystemExit included, removes it
        _write_json(tmp / "tokenizer.json", tokenizer_json(tokenizer))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(tokenizer, max_len))
        if weights:
            _write_json(tmp / "config.json", hf_config(config, tokenizer))
            _write_json(tmp / "generation_config.json",
                        {k: v for k, v in hf_config(config, tokenizer).items() if k.endswith("_token_id")})
            save_file(hf_state(config, state), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        # as mkdir and open would make them: mkdtemp, and safetensors' save_file, make them private
        os.chmod(tmp, 0o777 & ~umask)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
        if out.exists():  # the old folder steps aside and goes only once the new one is in place
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
        os.replace(tmp, out)
    except BaseException:
        if old is not None and not out.exists():
            os.replace(old / out.name, out)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def cmd_export_hf(args) -> int:
    out = export_hf(args.dir, args.model, weights=args.weights, overwrite=args.overwrite)
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {out}: {', '.join(files)}")
    return 0


def register(sub) -> None:
    """``python -m minillm export-hf DIR [--model FILE] [--weights] [--overwrite]``."""
    p = sub.add_parser("export-hf", help="write a Hugging Face folder (tokenizer; with --weights, the model) that "
                       "transformers, lm-eval, guidellm and vLLM's clients open")
    p.add_argument("dir", metavar="DIR", help="the folder to write (refused if it exists and is not empty, "
                   "unless --overwrite)")
    p.add_argument("--model", default=None, help="a .gguf file, a Hugging Face checkpoint folder, or a "
                   ".safetensors file written by `quantize` (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--weights", action="store_true", help="also write config.json and model.safetensors (float32) "
                   "for transformers' AutoModelForCausalLM")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it exists and is not empty")
    p.set_defaults(func=cmd_export_hf)
