"""Hugging Face checkpoint folders (config.json + *.safetensors) of LlamaForCausalLM and
GPT2LMHeadModel, read into minillm's state-dict names (see ``minillm.formats.gguf``).

Anything the decoder does not implement (RoPE scaling, other activations) is refused with a
``ModelFileError``, never approximated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import ModelFileError
from ..config import ModelConfig, weight_shapes


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
    arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
    raw = {k: v.float() for k, v in _read_safetensors(folder).items()}
    if arch not in READERS:
        raise ModelFileError(
            f"{folder}: architecture {arch!r} is not supported; minillm reads LlamaForCausalLM and "
            "GPT2LMHeadModel checkpoints (and llama GGUF files)"
        )

    def take(name):
        for key in (name, f"model.{name}", f"transformer.{name}"):
            if key in raw:
                return raw[key]
        raise ModelFileError(f"{folder}: tensor {name!r} is missing from the safetensors files")

    config, state, shapes = READERS[arch](folder, cfg, raw, take)
    for name, shape in shapes.items():
        if name in state and tuple(state[name].shape) != shape:
            raise ModelFileError(
                f"{folder}: tensor {name} has shape {tuple(state[name].shape)} but config.json implies {shape}"
            )
    return config, {k: v.contiguous() for k, v in state.items()}


def _read_llama(folder: Path, cfg: dict, raw: dict, take):
    """LlamaForCausalLM: (config, state in minillm's names, the shapes config.json implies)."""
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
    state = {"tok_embeddings.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if not config.tie_embeddings:
        if "lm_head.weight" not in raw:
            raise ModelFileError(f"{folder}: tie_word_embeddings is false but lm_head.weight is missing")
        state["output.weight"] = raw["lm_head.weight"]
    attn = {"q_proj": "attn.wq", "k_proj": "attn.wk", "v_proj": "attn.wv", "o_proj": "attn.wo"}
    mlp = {"gate_proj": "mlp.w_gate", "up_proj": "mlp.w_up", "down_proj": "mlp.w_down"}
    for i in range(config.n_layers):
        p = f"layers.{i}"
        state[f"{p}.attn_norm.weight"] = take(f"{p}.input_layernorm.weight")
        state[f"{p}.ffn_norm.weight"] = take(f"{p}.post_attention_layernorm.weight")
        for names, part, bias in ((attn, "self_attn", config.attn_bias), (mlp, "mlp", config.mlp_bias)):
            for theirs, ours in names.items():
                state[f"{p}.{ours}.weight"] = take(f"{p}.{part}.{theirs}.weight")
                if bias:
                    state[f"{p}.{ours}.bias"] = take(f"{p}.{part}.{theirs}.bias")
    return config, state, weight_shapes(config)


def _read_gpt2(folder: Path, cfg: dict, raw: dict, take):
    """GPT2LMHeadModel: (config, state in minillm's names, the shapes config.json implies)."""
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
    state = {"tok_embeddings.weight": take("wte.weight"), "pos_embeddings.weight": take("wpe.weight"),
             "norm.weight": take("ln_f.weight"), "norm.bias": take("ln_f.bias")}
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
        for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.w_up", "mlp.c_fc"), ("mlp.w_down", "mlp.c_proj")):
            state[f"{p}.{ours}.weight"] = take(f"{h}.{theirs}.weight").t()
            state[f"{p}.{ours}.bias"] = take(f"{h}.{theirs}.bias")
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    shapes["pos_embeddings.weight"] = (config.max_seq_len, C)
    shapes["tok_embeddings.weight"] = (config.vocab_size, C)
    return config, state, shapes


READERS = {"LlamaForCausalLM": _read_llama, "GPT2LMHeadModel": _read_gpt2}
