"""Quantized models on disk: one ``.safetensors`` file (no pickle) holding the packed ``QuantLinear``
buffers (GPTQ / AutoGPTQ names: ``qweight``, ``qzeros``, ``scales``, ``g_idx``), the norms and the
token embedding, with the model and quantization configs in its metadata.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..errors import ModelFileError
from ..files import atomic_write
from ..formats.gguf_blocks import dequantize_q8_0
from ..formats.gguf_quant import quantize_q8_0
from ..config import ModelConfig, weight_shapes
from ..model import Decoder
from .head import HEAD_KINDS, head_config, head_kind
from .pack import codes_per_word
from .pipeline import LAYERS, linear_of
from .qlinear import QuantLinear, from_state
from .rtn import QuantConfig

FORMAT = "minillm-quantized-1"
REWRITE = "write the file again with `python -m minillm quantize`"
FLOATS = ("F16", "BF16", "F32")  # safetensors' dtype names; the writer stores float32, scales float16
FUSED = {"attn.wqkv": ("attn.wq", "attn.wk", "attn.wv"), "attn.wo": ("attn.wo",),
         "mlp.w_gate_up": ("mlp.w_gate", "mlp.w_up"), "mlp.w_down": ("mlp.w_down",)}  # LAYERS: the rows they stack


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
    meta = {"format": FORMAT, "model_config": json.dumps(asdict(model.config)),
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
    ``check_file`` reads the metadata against every tensor's shape and dtype first, and ``check_spare_bits`` the
    packed words, so a damaged file is refused before any tensor is used.

    Raises:
        ModelFileError: not a minillm quantized file, or one whose metadata and tensors disagree (naming the
            field or tensor).
    """
    path = Path(path)
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for corrupt files
        raise ModelFileError(f"{path}: not a readable safetensors file ({e})") from e
    checked = check_file(path, meta, tensors)
    config, q, head = checked.config, checked.quant_config, checked.head
    try:
        state = load_file(str(path))
    except Exception as e:  # the header read, the data did not: a truncated file
        raise ModelFileError(f"{path}: not a readable safetensors file ({e})") from e
    check_spare_bits(path, state, checked)
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
                prefix = f"layers.{i}.{name}"
                setattr(parent, attr, from_state(state, prefix, checked.layer_configs[prefix], lin.out_features,
                                                 lin.in_features, fast))
        if head != "none":
            model.output = from_state(state, "output", head_config(head), config.vocab_size, config.dim, fast)
    except (RuntimeError, IndexError, ValueError) as e:  # values check_file cannot see (g_idx out of range, NaN scales)
        raise ModelFileError(f"{path}: its tensors do not fit its config ({type(e).__name__}: {str(e)[:200]}); "
                             f"{REWRITE}") from None
    return model.eval(), {**meta, "quant_config": q}


@dataclass(frozen=True)
class CheckedFile:
    """What ``check_file`` read from a quantized file's metadata.

    Attributes:
        config: the ``ModelConfig``.
        quant_config: the quantization config as stored (a dict).
        layer_configs: {"layers.{i}.{name}": its ``QuantConfig``} for every quantized layer.
        head: the ``quant_head`` kind ("none", "int8", "int4").
    """

    config: ModelConfig
    quant_config: dict
    layer_configs: dict[str, QuantConfig]
    head: str


def check_file(path: str | Path, meta: dict[str, str], tensors: dict[str, tuple[tuple[int, ...], str]]) -> CheckedFile:
    """Check a quantized file's metadata against its tensors' shapes and dtypes, before any tensor is read.

    The model config gives every layer's (out, in) and the norms' length; the quantization config gives each
    layer's bits and group size, and so the exact shapes of its packed buffers: ``qweight`` (ceil(I / k), O) and
    ``qzeros`` (G, ceil(O / k)) int32 with k = 32 // bits codes per word, ``scales`` (G, O) float, ``g_idx`` (I,)
    int32, G = ceil(I / group_size). Every tensor must be one the metadata implies, and every one it implies must
    be there: a file whose bits, group size or layer count were changed, or one tensor of the wrong shape, is refused.

    Args:
        path: the file, for the messages.
        meta: its safetensors metadata.
        tensors: {name: (shape, safetensors dtype name such as "I32")} of every tensor in it.

    Returns:
        A ``CheckedFile``.

    Raises:
        ModelFileError: naming the file, the field or tensor, and what to do.
    """
    def refused(what: str) -> ModelFileError:
        return ModelFileError(f"{path}: {what}; {REWRITE}")

    if meta.get("format") != FORMAT:
        raise ModelFileError(f"{path}: not a minillm quantized model (metadata format={meta.get('format')!r}); "
                             "write one with `python -m minillm quantize`")
    try:
        config = ModelConfig(**json.loads(meta["model_config"]))
        q = json.loads(meta["quant_config"])
        sym, mse = q["sym"], q.get("mse", False)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise refused(f"its metadata (model_config / quant_config) is damaged ({type(e).__name__}: {e})") from None
    if config.arch != "llama":
        raise refused(f"model_config.arch is {config.arch!r}; minillm quantizes llama models only")
    if not isinstance(sym, bool) or not isinstance(mse, (bool, type(None))):
        raise refused(f"quant_config.sym / mse must be true or false, got {sym!r} / {mse!r}")
    held = {int(k.split(".")[1]) for k in tensors if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if held != set(range(config.n_layers)):
        what = f"{len(held)} layers" if held == set(range(len(held))) else f"layers {sorted(held)[:8]}"
        raise refused(f"model_config.n_layers is {config.n_layers} but the file holds the tensors of {what}")
    layer_configs = _layer_configs(q, config, refused)
    head = meta.get("quant_head", "none")  # files written before heads were quantized have none
    if head not in HEAD_KINDS:
        raise refused(f"quant_head is {head!r}, not one of {HEAD_KINDS}")

    shapes = weight_shapes(config)
    C, V = config.dim, config.vocab_size
    expected = {"norm.weight": ((C,), FLOATS, "model_config.dim")}  # name: (shape, dtypes, where the shape comes from)
    for i in range(config.n_layers):
        for norm in ("attn_norm", "ffn_norm"):
            expected[f"layers.{i}.{norm}.weight"] = ((C,), FLOATS, "model_config.dim")
        for name, parts in FUSED.items():
            prefix = f"layers.{i}.{name}"
            out = sum(shapes[f"layers.{i}.{p}.weight"][0] for p in parts)
            expected.update(_packed(prefix, out, shapes[f"layers.{i}.{parts[0]}.weight"][1], layer_configs[prefix]))
            if config.attn_bias if name.startswith("attn.") else config.mlp_bias:
                expected[f"{prefix}.bias"] = ((out,), FLOATS, "model_config's attn_bias / mlp_bias")
    if head != "none":
        expected.update(_packed("output", V, C, head_config(head)))
    if head == "none" or not config.tie_embeddings:  # a tied quantized head holds the embedding's rows
        if "tok_embeddings.q8_0" in tensors and C % 32 == 0:  # GGUF Q8_0 blocks: 32 weights in 34 bytes
            expected["tok_embeddings.q8_0"] = ((V, C // 32 * 34), ("U8",), "Q8_0 blocks of (vocab_size, dim)")
        else:
            expected["tok_embeddings.weight"] = ((V, C), FLOATS, "model_config's vocab_size, dim")
    if head == "none" and not config.tie_embeddings:
        expected["output.weight"] = ((V, C), FLOATS, "model_config's vocab_size, dim")

    for name, (shape, dtypes, source) in expected.items():
        if name not in tensors:
            raise refused(f"missing tensor {name} (the metadata implies shape {shape})")
        got, dtype = tensors[name]
        if got != shape:
            raise refused(f"{name} has shape {got}, but the metadata implies {shape} ({source})")
        if dtype not in dtypes:
            raise refused(f"{name} is {dtype}, not {' or '.join(dtypes)}")
    unused = sorted(set(tensors) - set(expected))
    if unused:
        why = " (model_config's attn_bias / mlp_bias are false)" if unused[0].endswith(".bias") else ""
        raise refused(f"tensor {unused[0]} {tensors[unused[0]][0]} is not one the metadata implies{why}")
    return CheckedFile(config, q, layer_configs, head)


def _layer_configs(q: dict, config: ModelConfig, refused) -> dict[str, QuantConfig]:
    """{"layers.{i}.{name}": QuantConfig} from ``quant_config.layer_configs`` ([bits, group_size] per layer; its
    bits and group_size are null where they vary), or its one bits and group_size for every layer (files written
    before mixed bits have no layer_configs)."""
    prefixes = [f"layers.{i}.{name}" for i in range(config.n_layers) for name in LAYERS]
    entries = q.get("layer_configs")
    if entries is None:
        try:
            return dict.fromkeys(prefixes, QuantConfig(q["bits"], q["group_size"], q["sym"], q.get("mse", False)))
        except KeyError as e:
            raise refused(f"quant_config has no {e} (and no layer_configs)") from None
        except ValueError as e:
            raise refused(f"quant_config.{e}") from None
    if not isinstance(entries, dict):
        raise refused(f"quant_config.layer_configs must map layer names to [bits, group_size], got {entries!r:.80}")
    other = [p for p in prefixes if p not in entries] or sorted(set(entries) - set(prefixes))
    if other:
        raise refused(f"quant_config.layer_configs {'lacks' if other[0] in prefixes else 'names'} {other[0]}, and "
                      f"model_config.n_layers is {config.n_layers}")
    out = {}
    for p in prefixes:
        entry = entries[p]
        if not (isinstance(entry, list) and len(entry) == 2):
            raise refused(f"quant_config.layer_configs[{p!r}] must be [bits, group_size], got {entry!r:.80}")
        try:
            out[p] = QuantConfig(entry[0], entry[1], q["sym"], q.get("mse", False))
        except ValueError as e:
            raise refused(f"quant_config.layer_configs[{p!r}]: {e}") from None
    return out


def _packed(prefix: str, out_features: int, in_features: int, config: QuantConfig) -> dict:
    """{name: (shape, dtypes, where the shape comes from)} of one ``QuantLinear``'s packed buffers (``pack.py``)."""
    k = codes_per_word(config.bits)
    G = -(-in_features // config.group_of_columns(in_features))
    layer = f"a ({out_features}, {in_features}) layer"
    codes = f"{config.bits}-bit codes, {k} per int32 word, of {layer}"
    return {f"{prefix}.qweight": ((-(-in_features // k), out_features), ("I32",), codes),
            f"{prefix}.qzeros": ((G, -(-out_features // k)), ("I32",), f"{G} groups' zero points as {codes}"),
            f"{prefix}.scales": ((G, out_features), FLOATS, f"group size {config.group_size} of {layer}: {G} groups"),
            f"{prefix}.g_idx": ((in_features,), ("I32",), f"one group per input column of {layer}")}


def check_spare_bits(path: str | Path, state: dict[str, torch.Tensor], checked: CheckedFile) -> None:
    """Refuse packed words whose unused top bits are set. Codes of b bits fill only ``k * b`` of a word's 32 bits
    (3 bits: 30, 7 bits: 28); what packed them left the rest zero. 7-bit and 8-bit codes both pack 4 to a word, so
    shapes cannot tell metadata saying 7 bits on 8-bit codes: these bits can.

    Raises:
        ModelFileError: naming the tensor and its bits.
    """
    layers = dict(checked.layer_configs)
    if checked.head != "none":
        layers["output"] = head_config(checked.head)
    for prefix, config in layers.items():
        used = codes_per_word(config.bits) * config.bits
        if used == 32:
            continue
        for name in (f"{prefix}.qweight", f"{prefix}.qzeros"):
            low, high = torch.aminmax(state[name])  # one pass; a word with a bit at or above ``used`` set is either
            if int(low) < 0 or int(high) >= 1 << used:  # negative (bit 31, int32's sign) or at least 2^used
                raise ModelFileError(f"{path}: {name} has bits set above its {used // config.bits} {config.bits}-bit "
                                     f"codes per word: it was not packed with {config.bits} bits as its metadata "
                                     f"(quant_config) says; {REWRITE}")
