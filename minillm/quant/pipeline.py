"""Quantize a whole ``Decoder``: calibration text, the block-by-block loop, save and load.

The loop follows GPTQ's sequential scheme (paper Sec. 4, "Step 3"; AWQ's code does the same):
the calibration tokens are embedded once, then for each block in order

1. (AWQ) the float block runs on its inputs X; scales are searched for q/k/v, gate/up and down and
   folded in (``awq.py``);
2. its linear layers are quantized **in execution order** (qkv, o, gate/up, down), each calibrated on
   inputs computed with the layers before it already quantized (AWQ: clip search first, except before
   a GPTQ with range search; GPTQ: the
   Hessian of those inputs; RTN needs no inputs);
3. the quantized block's outputs become the next block's X.

So every layer sees the activations the quantized model will really give it. The token embedding and
the (tied) output layer stay unquantized, as in GPTQ and AWQ. Calibration uses a play disjoint from the
evaluation play (``minillm.data``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..files import atomic_write
from ..model import Linear
from .awq import fold_scales, search_clip, search_scales
from .gptq import Hessian, gptq_quantize
from .qlinear import QuantLinear, from_state
from .rtn import QuantConfig, rtn_quantize

METHODS = ("rtn", "gptq", "awq", "awq+gptq")
LAYERS = ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")  # execution order within a block


def calibration_tokens(tokenizer, nsamples: int = 16, seqlen: int = 512, seed: int = 0, play: str | None = None
                       ) -> torch.Tensor:
    """(nsamples, seqlen) int64 windows starting at seeded random offsets in the calibration play
    (GPTQ samples random 2048-token windows of C4 the same way).

    Raises:
        ValueError: the play has fewer than seqlen + 1 tokens.
    """
    from ..data import CALIBRATION_PLAY, play_text

    ids = tokenizer.encode(play_text(play or CALIBRATION_PLAY))
    if len(ids) <= seqlen:
        raise ValueError(f"seqlen: the calibration play has {len(ids)} tokens, need more than {seqlen}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seqlen, (nsamples,), generator=g).tolist()
    return torch.tensor([ids[s:s + seqlen] for s in starts])


def _module(block, name):
    parent, attr = name.split(".")
    return getattr(getattr(block, parent), attr), getattr(block, parent), attr


class _Stop(Exception):
    pass


def capture_input(module, fn):
    """Run ``fn()`` up to ``module`` and return the input it was about to see (its first argument);
    ``module`` itself and whatever follows it do not run."""
    seen = []

    def hook(m, args):
        seen.append(args[0].detach())
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        fn()
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen:
        raise RuntimeError(f"{module} was not reached")
    return seen[0]


def _subsample(x: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] <= n:
        return x
    return x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:n]]


@torch.inference_mode()
def quantize_model(model, method: str, config: QuantConfig, calib: torch.Tensor | None = None, *,
                   act_order: bool = False, static_groups: bool = False, blocksize: int = 128,
                   percdamp: float = 0.01, awq_grid: int = 20, awq_clip: bool | None = None, awq_tokens: int = 4096,
                   fast: bool = True, progress: bool = True) -> dict:
    """Quantize every linear layer of ``model``'s blocks in place (Linear -> ``QuantLinear``).

    Args:
        model: a Llama-architecture ``Decoder`` (float32).
        method: "rtn", "gptq", "awq" (AWQ scales + clip, then RTN) or "awq+gptq" (AWQ scales, the clip
            only as ``awq_clip`` says, then GPTQ).
        config: bits / group_size / sym.
        calib: (N, T) calibration token ids (``calibration_tokens``); required except for "rtn".
        act_order, static_groups, blocksize, percdamp: GPTQ's options (``gptq.gptq_quantize``).
        awq_grid: alpha grid size; awq_tokens: tokens sampled for AWQ's searches.
        awq_clip: run AWQ's clip search (Lin et al. 2024, Sec. 3.3). Default: yes, except for
            "awq+gptq" with ``config.mse``: there clipping would replace the float weights GPTQ then
            reproduces (the clipped-away part is an error GPTQ's feedback never sees) while GPTQ's
            range search already shrinks each group's range on the error-updated columns. Measured on
            this model, 3-bit group 32, 32 x 512 calibration, with the range search: perplexity 38.1
            with the clip, 36.6 without. Without the range search GPTQ keeps min / max and the clip
            is needed (3-bit group 64, a small run: 44.8 with it, 56.6 without).
        fast: let each ``QuantLinear`` use the int4 kernel when it can.
        progress: progress bar over blocks.

    Returns:
        {"method", "bits", "group_size", "layers": [{"name", "rel_error", "alpha"?}], ...} where
        rel_error = ||W_hat X - W X|| / ||W X|| on the layer's calibration inputs (NaN for RTN when
        no calibration is given).

    Raises:
        ValueError: unknown method, missing calibration, or an architecture other than Llama with AWQ.
    """
    from tqdm.auto import tqdm

    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not one of {METHODS}")
    awq, gptq = method.startswith("awq"), method.endswith("gptq")
    if awq_clip is None:
        awq_clip = not (gptq and config.mse)
    if (awq or gptq) and calib is None:
        raise ValueError(f"calib: {method} needs calibration tokens (see calibration_tokens)")
    if model.config.arch != "llama":
        raise ValueError(f"model: quantization supports the llama architecture, not {model.config.arch!r}")
    model._compiled_decode = None  # a compiled decode (minillm.compiled) froze the float weights
    report = {"method": method, "bits": config.bits, "group_size": config.group_size, "sym": config.sym,
              "mse": config.mse, "act_order": act_order, "static_groups": static_groups,
              "awq_clip": awq and awq_clip, "layers": []}
    X = None
    if calib is not None:
        calib = calib.to(model.device)
        report.update(calib_samples=calib.shape[0], calib_seqlen=calib.shape[1])
        T = calib.shape[1]
        pos = torch.arange(T, device=model.device)
        rope = (model.rope_cos[pos], model.rope_sin[pos])
        mask = pos[None, :] <= pos[:, None]  # (T, T) causal
        X = model.embed(calib).float()  # (N, T, C)
    for i, block in enumerate(tqdm(model.layers, desc=f"quantize ({method})", disable=not progress, leave=False)):
        if awq:
            report["layers"] += awq_scale_block(model, block, i, X, rope, mask, config, awq_grid, awq_tokens)
        if X is None:  # RTN without calibration: no inputs needed
            for name in LAYERS:
                lin, parent, attr = _module(block, name)
                setattr(parent, attr, QuantLinear(rtn_quantize(lin.weight, config), lin.bias, fast))
                report["layers"].append({"name": f"layers.{i}.{name}", "rel_error": float("nan")})
            continue
        # execution order: each layer is calibrated on inputs computed with the layers before it
        # already quantized; one pass through the block (its pieces run once each)
        def quantize(name, x):
            lin, parent, attr = _module(block, name)
            W_float = lin.weight.float()  # (O, I), reassembled from the shards once
            W = W_float
            if awq and awq_clip:
                rows = None
                if name == "attn.wqkv":  # q and k rows are not clipped (AWQ)
                    c = model.config
                    rows = slice((c.n_heads + c.n_kv_heads) * c.head_dim, W.shape[0])
                W = search_clip(W, _subsample(x, min(awq_tokens, 512)), config, rows)
            if gptq:
                h = Hessian(W.shape[1], device=W.device)
                h.add_batch(x)
                qw = gptq_quantize(W, h.H, config, blocksize=blocksize, percdamp=percdamp, act_order=act_order,
                                   static_groups=static_groups)
            else:
                qw = rtn_quantize(W, config)
            x2 = _subsample(x, 4096)
            ref = x2 @ W_float.t()
            rel = ((x2 @ qw.dequantize().t() - ref).norm() / ref.norm()).item()
            report["layers"].append({"name": f"layers.{i}.{name}", "rel_error": rel})
            new = QuantLinear(qw, lin.bias, fast)
            setattr(parent, attr, new)
            return new

        a = block.attn_norm(X)  # (N, T, C): input of q/k/v
        quantize("attn.wqkv", a)
        o_in = capture_input(block.attn.wo, lambda: block.attn(a, i, rope, None, mask))  # (N, T, H*D)
        X = X + quantize("attn.wo", o_in)(o_in)
        m = block.ffn_norm(X)
        quantize("mlp.w_gate_up", m)
        d_in = capture_input(block.mlp.w_down, lambda: block.mlp(m))  # (N, T, F)
        X = X + quantize("mlp.w_down", d_in)(d_in)
    return report


def awq_scale_block(model, block, i, X, rope, mask, config, n_grid, n_tokens) -> list[dict]:
    """Search and fold AWQ scales for one float block; returns the chosen alphas."""
    c = model.config
    ins = {}
    hooks = [_module(block, n)[0].register_forward_pre_hook(
        lambda m, args, n=n: ins.__setitem__(n, _subsample(args[0].detach(), n_tokens))) for n in LAYERS]
    try:
        block(X, i, rope, None, mask)
    finally:
        for h in hooks:
            h.remove()
    out = []
    F_ = c.ffn_dim
    groups = [("attn.wqkv", block.attn_norm.weight, block.attn.wqkv),
              ("mlp.w_gate_up", block.ffn_norm.weight, block.mlp.w_gate_up),
              ("mlp.w_down", None, block.mlp.w_down)]
    if c.n_heads == c.n_kv_heads:
        groups.insert(1, ("attn.wo", None, block.attn.wo))
    for name, prev, lin in groups:
        W = lin.weight.float()
        s, alpha, _ = search_scales(ins[name], [W], config, n_grid)
        if name == "mlp.w_down":  # fold 1/s into the up rows (second half) of the fused gate/up layer
            gu = block.mlp.w_gate_up
            Wgu = gu.weight.float()
            fold_scales(Wgu[F_:], [], s)
            _set_weight(gu, Wgu)
        elif name == "attn.wo":  # into the v rows of the fused qkv layer (only when H == Hkv)
            qkv = block.attn.wqkv
            Wqkv = qkv.weight.float()
            fold_scales(Wqkv[2 * c.n_heads * c.head_dim:], [], s)
            _set_weight(qkv, Wqkv)
        else:
            fold_scales(prev.data, [], s)
        W = W * s[None, :]
        _set_weight(lin, W)
        out.append({"name": f"layers.{i}.{name}", "awq_alpha": alpha})
    return out


def _set_weight(lin: Linear, W: torch.Tensor) -> None:
    """Replace a float ``Linear``'s weight (O, I), keeping its shard layout."""
    new = Linear(W.to(lin.weight_shards.dtype), None, lin.n_shards)
    lin.weight_shards.data = new.weight_shards.data


# ---------------------------------------------------------------------------------------------
# Save / load with safetensors (no pickle)


def save_quantized(model, path: str | Path, report: dict, tokenizer_source: str | None = None) -> Path:
    """Write ``model`` (quantized by ``quantize_model``) to one ``.safetensors`` file.

    The file holds the packed ``QuantLinear`` buffers (``layers.{i}.attn.wqkv.qweight`` / ``qzeros``
    / ``scales`` / ``g_idx``), the norms, and the token embedding: as GGUF Q8_0 blocks (uint8
    ``tok_embeddings.q8_0``) when that is lossless (the embedded model's embedding *is* Q8_0: 30 MB
    instead of 113 MB), else in float32;
    the metadata holds the model config, the quantization config and ``tokenizer_source`` (the GGUF
    the tokenizer comes from).

    The file is written beside ``path`` and renamed into place when complete (``minillm.files``).

    Returns the path. Raises ValueError for a model with float linear layers left, or ``path`` resolving
    to ``tokenizer_source``.
    """
    from dataclasses import asdict

    from safetensors.torch import save_file

    from ..gguf_blocks import dequantize_q8_0
    from .gguf_quant import quantize_q8_0

    state = {}
    for i, block in enumerate(model.layers):
        for name in LAYERS:
            lin = _module(block, name)[0]
            if not isinstance(lin, QuantLinear):
                raise ValueError(f"model: layers.{i}.{name} is not quantized; run quantize_model first")
            for key, t in lin.state_dict().items():
                state[f"layers.{i}.{name}.{key}"] = t.contiguous()
        state[f"layers.{i}.attn_norm.weight"] = block.attn_norm.weight.detach().float()
        state[f"layers.{i}.ffn_norm.weight"] = block.ffn_norm.weight.detach().float()
    state["norm.weight"] = model.norm.weight.detach().float()
    emb = model.embedding_weight().float().contiguous()
    q8 = quantize_q8_0(emb) if emb.shape[1] % 32 == 0 else None
    if q8 is not None and torch.equal(dequantize_q8_0(q8.reshape(-1, 34)).reshape(emb.shape), emb):
        state["tok_embeddings.q8_0"] = torch.from_numpy(q8)  # lossless: the embedding was Q8_0 already
    else:
        state["tok_embeddings.weight"] = emb
    if not model.config.tie_embeddings:
        state["output.weight"] = model.output.weight.detach().float()
    meta = {"format": "minillm-quantized-1", "model_config": json.dumps(asdict(model.config)),
            "quant_config": json.dumps({**{k: report[k] for k in ("method", "bits", "group_size", "sym", "mse",
                                                                  "act_order", "static_groups")},
                                        "awq_clip": report.get("awq_clip")}),
            "tokenizer_source": tokenizer_source or ""}
    path = Path(path)
    with atomic_write(path, sources=[tokenizer_source] if tokenizer_source else ()) as tmp:
        save_file(state, str(tmp), metadata=meta)
    return path


def load_quantized(path: str | Path, fast: bool = True, n_shards: int | None = None):
    """Load a file written by ``save_quantized``: returns (Decoder with QuantLinear layers, metadata dict).

    Raises:
        ModelFileError: not a minillm quantized file, or missing tensors.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    from ..gguf_blocks import dequantize_q8_0
    from ..loading import ModelFileError
    from ..model import Decoder, ModelConfig

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
    config = ModelConfig(**json.loads(meta["model_config"]))
    q = json.loads(meta["quant_config"])
    qconfig = QuantConfig(q["bits"], q["group_size"], q["sym"], q.get("mse", False))
    try:
        if "tok_embeddings.q8_0" in state:
            emb = dequantize_q8_0(state.pop("tok_embeddings.q8_0").numpy().reshape(-1, 34))
            emb = emb.reshape(config.vocab_size, config.dim)
        else:
            emb = state["tok_embeddings.weight"]
        float_state = {"tok_embeddings.weight": emb, "norm.weight": state["norm.weight"]}
        if "output.weight" in state:
            float_state["output.weight"] = state["output.weight"]
        C, D = config.dim, config.head_dim
        for i in range(config.n_layers):
            p = f"layers.{i}"
            float_state[f"{p}.attn_norm.weight"] = state[f"{p}.attn_norm.weight"]
            float_state[f"{p}.ffn_norm.weight"] = state[f"{p}.ffn_norm.weight"]
            # placeholders of the right shapes: replaced by QuantLinear below
            for n, shape in (("attn.wq", (config.n_heads * D, C)), ("attn.wk", (config.n_kv_heads * D, C)),
                             ("attn.wv", (config.n_kv_heads * D, C)), ("attn.wo", (C, config.n_heads * D)),
                             ("mlp.w_gate", (config.ffn_dim, C)), ("mlp.w_up", (config.ffn_dim, C)),
                             ("mlp.w_down", (C, config.ffn_dim))):
                float_state[f"{p}.{n}.weight"] = torch.zeros(shape)
        model = Decoder(config, float_state, n_shards=n_shards or torch.get_num_threads())
        for i, block in enumerate(model.layers):
            for name in LAYERS:
                lin, parent, attr = _module(block, name)
                setattr(parent, attr, from_state(state, f"layers.{i}.{name}", qconfig, lin.out_features,
                                                 lin.in_features, fast))
    except KeyError as e:
        raise ModelFileError(f"{path}: missing tensor {e}") from None
    return model.eval(), {**meta, "quant_config": q}
