"""Quantized models on disk: one ``.safetensors`` file (no pickle) holding the packed ``QuantLinear``
buffers (GPTQ / AutoGPTQ names: ``qweight``, ``qzeros``, ``scales``, ``g_idx``), the norms and the
token embedding, with the model and quantization configs in its metadata.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..errors import ModelFileError
from ..files import atomic_write
from ..formats.gguf_blocks import dequantize_q8_0
from ..formats.gguf_quant import quantize_q8_0
from ..model import Decoder, ModelConfig, weight_shapes
from .head import head_config, head_kind
from .pipeline import LAYERS, linear_of
from .qlinear import QuantLinear, from_state
from .rtn import QuantConfig


def save_quantized(model, path: str | Path, report: dict, tokenizer_source: str | None = None) -> Path:
    """Write ``model`` (quantized by ``quantize_model``) to one ``.safetensors`` file, written beside ``path`` and
    renamed into place when complete (``minillm.files``): each ``QuantLinear``'s packed buffers (``qweight``, ``qzeros``,
    ``scales`` in float16 as in GPTQ and AWQ checkpoints, ``g_idx``: ``layers.{i}.attn.wqkv.qweight``, ...), the norms,
    and the token embedding as GGUF Q8_0 blocks (``tok_embeddings.q8_0``) where that is lossless (the shipped model's
    is Q8_0), else float32. The metadata holds the model config, the quantization config with every layer's
    [bits, group_size] (``layer_configs``) and ``tokenizer_source`` (the GGUF of the tokenizer).

    Returns:
        The path.

    Raises:
        ValueError: float linear layers are left, or ``path`` resolves to ``tokenizer_source``.
    """
    state, layer_configs = {}, {}
    for i, block in enumerate(model.layers):
        for name in LAYERS:
            lin = linear_of(block, name)[0]
            if not isinstance(lin, QuantLinear):
                raise ValueError(f"model: layers.{i}.{name} is not quantized; run quantize_model first")
            layer_configs[f"layers.{i}.{name}"] = [lin.config.bits, lin.config.group_size]  # mixed bits (bitrate.py)
            for key, t in lin.state_dict().items():
                if key == "scales":
                    t = _float16_scales(t, f"layers.{i}.{name}")
                state[f"layers.{i}.{name}.{key}"] = t.contiguous()
        state[f"layers.{i}.attn_norm.weight"] = block.attn_norm.weight.detach().float()
        state[f"layers.{i}.ffn_norm.weight"] = block.ffn_norm.weight.detach().float()
    state["norm.weight"] = model.norm.weight.detach().float()
    head = model.output if isinstance(model.output, QuantLinear) else None  # quantized by quant.head
    if head is not None:
        for key, t in head.state_dict().items():
            state[f"output.{key}"] = t.contiguous()
    if head is None or not model.config.tie_embeddings:  # a tied embedding is the quantized head's rows
        emb = model.embedding_weight().float().contiguous()
        q8 = quantize_q8_0(emb) if emb.shape[1] % 32 == 0 else None
        if q8 is not None and torch.equal(dequantize_q8_0(q8.reshape(-1, 34)).reshape(emb.shape), emb):
            state["tok_embeddings.q8_0"] = torch.from_numpy(q8)  # lossless: the embedding was Q8_0 already
        else:
            state["tok_embeddings.weight"] = emb
    if head is None and not model.config.tie_embeddings:
        state["output.weight"] = model.output.weight.detach().float().contiguous()  # reassembled from its shards
    meta = {"format": "minillm-quantized-1", "model_config": json.dumps(asdict(model.config)),
            "quant_config": json.dumps({**{k: report[k] for k in ("method", "bits", "group_size", "sym", "mse",
                                                                  "act_order", "static_groups")},
                                        **{k: report.get(k) for k in ("awq_clip", "percdamp", "true_sequential", "v2",
                                                                      "v2_alpha", "v2_percdamp", "calib_samples",
                                                                      "calib_seqlen")},
                                        "layer_configs": layer_configs}),
            "tokenizer_source": tokenizer_source or "",
            "quant_head": "none" if head is None else head_kind(head.config)}
    path = Path(path)
    with atomic_write(path, sources=[tokenizer_source] if tokenizer_source else ()) as tmp:
        save_file(state, str(tmp), metadata=meta)
    return path


def _float16_scales(scales: torch.Tensor, name: str) -> torch.Tensor:
    """The scales as float16, as GPTQ and AWQ checkpoints store them. The quantizers already round them
    (``rtn.round_scale``), so this loses nothing; scales that float16 cannot hold exactly are refused
    rather than silently changed (the codes and zeros were chosen for the exact values)."""
    half = scales.half()
    if not torch.equal(half.float(), scales.float()):
        raise ValueError(f"model: {name}.scales are not float16 values (quantize with minillm.quant, whose "
                         "quantizers round them); a float16 checkpoint would change the weights")
    return half


def load_quantized(path: str | Path, fast: bool = True):
    """Load a file written by ``save_quantized``: returns (Decoder with QuantLinear layers, metadata dict).

    Raises:
        ModelFileError: not a minillm quantized file, or missing tensors.
    """
    path = Path(path)
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        state = load_file(str(path))
    except Exception as e:  # safetensors raises several types for corrupt files
        raise ModelFileError(f"{path}: not a readable safetensors file ({e})") from e
    if meta.get("format") != "minillm-quantized-1":
        raise ModelFileError(f"{path}: not a minillm quantized model (metadata format={meta.get('format')!r}); "
                             "write one with `python -m minillm quantize`")
    try:
        config = ModelConfig(**json.loads(meta["model_config"]))
        q = json.loads(meta["quant_config"])
        layer_configs = q.get("layer_configs")  # files before it have one config for every layer
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModelFileError(f"{path}: its metadata (model_config / quant_config) is damaged ({type(e).__name__}: "
                             f"{e}); write the file again with `python -m minillm quantize`") from None
    head = meta.get("quant_head", "none")  # files written before heads were quantized have none
    try:
        if head != "none" and config.tie_embeddings:  # the embedding is the head's rows: a placeholder
            state["tok_embeddings.weight"] = torch.zeros(config.vocab_size, config.dim)
        if "tok_embeddings.q8_0" in state:
            emb = dequantize_q8_0(state.pop("tok_embeddings.q8_0").numpy().reshape(-1, 34))
            emb = emb.reshape(config.vocab_size, config.dim)
        else:
            emb = state["tok_embeddings.weight"]
        float_state = {"tok_embeddings.weight": emb, "norm.weight": state["norm.weight"]}
        if not config.tie_embeddings:
            float_state["output.weight"] = state["output.weight"] if head == "none" else torch.zeros(
                config.vocab_size, config.dim)  # a placeholder, replaced by the quantized head below
        for name, shape in weight_shapes(config).items():
            if name.endswith("norm.weight"):
                float_state[name] = state[name]
            elif name.startswith("layers."):
                float_state[name] = torch.zeros(shape)  # a placeholder, replaced by a QuantLinear below
        model = Decoder(config, float_state)
        for i, block in enumerate(model.layers):
            for name in LAYERS:
                lin, parent, attr = linear_of(block, name)
                bits, group = layer_configs[f"layers.{i}.{name}"] if layer_configs else (q["bits"], q["group_size"])
                qconfig = QuantConfig(bits, group, q["sym"], q.get("mse", False))
                setattr(parent, attr, from_state(state, f"layers.{i}.{name}", qconfig, lin.out_features,
                                                 lin.in_features, fast))
        if head != "none":
            model.output = from_state(state, "output", head_config(head), config.vocab_size, config.dim, fast)
    except KeyError as e:
        raise ModelFileError(f"{path}: missing tensor {e}") from None
    except (RuntimeError, IndexError, ValueError) as e:  # tensors of other shapes than the config says
        raise ModelFileError(f"{path}: its tensors do not fit its config ({type(e).__name__}: {str(e)[:200]}); "
                             "write the file again with `python -m minillm quantize`") from None
    return model.eval(), {**meta, "quant_config": q}
