"""Quantize a whole ``Decoder``: calibration text, the block-by-block loop, save and load.

The loop follows GPTQ's sequential scheme (paper Sec. 4, "Step 3"; AWQ's code does the same):
the calibration tokens are embedded once, then for each block in order

1. (AWQ) the float block runs on its inputs X; scales are searched for q/k/v, gate/up and down and
   folded in (``awq.py``);
2. its linear layers are quantized **in execution order** (qkv, o, gate/up, down), each calibrated on
   inputs computed with the layers before it already quantized ("true sequential", an option of the
   GPTQ reference code; ``true_sequential=False`` calibrates all four on one pass of the float block,
   as the paper did) (AWQ: clip search first, except before a GPTQ with range search; GPTQ: the
   Hessian of those inputs; RTN needs no inputs);
3. the quantized block's outputs become the next block's X.

So every layer sees the activations the quantized model will really give it. With ``v2`` (GPTQv2's
asymmetric calibration, ``gptq.asymmetric_target``) a float copy of the activations runs beside them
through the float blocks, and each layer is fitted to the float model's outputs. The token embedding and
the (tied) output layer stay unquantized, as in GPTQ and AWQ. Calibration uses a play disjoint from the
evaluation play (``minillm.data``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from tqdm.auto import tqdm

from ..data import CALIBRATION_PLAY, play_text
from ..model import Linear
from .awq import fold_scales, search_clip, search_scales
from .gptq import Hessian, asymmetric_target, gptq_quantize
from .head import head_config, quantize_output
from .qlinear import QuantLinear, warn_slow_layers
from .rtn import QuantConfig, rtn_quantize

METHODS = ("rtn", "gptq", "awq", "awq+gptq")

# GPTQ's settings: the measured best (the defaults of quantize_model and of the commands) and the paper's.
# docs/quantization.md measures each on Hamlet ("GPTQ avenues"; figures/05_gptq_avenues.json).
GPTQ_DEFAULTS = {"act_order": True, "mse": True, "percdamp": 0.001, "true_sequential": True, "v2": True,
                 "v2_percdamp": 0.3}
GPTQ_PAPER = {"act_order": False, "mse": False, "percdamp": 0.01, "true_sequential": False, "v2": False,
              "v2_percdamp": None}
# AWQ+GPTQ: GPTQ's defaults without asymmetric calibration, which is not measured after AWQ's scaling
AWQ_GPTQ_DEFAULTS = {**GPTQ_DEFAULTS, "v2": False, "v2_percdamp": None}
CALIB_SAMPLES = 32  # calibration windows of 512 tokens (the measured best; the paper: 128 of 2048)
LAYERS = ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")  # execution order within a block


def calibration_tokens(tokenizer, nsamples: int = CALIB_SAMPLES, seqlen: int = 512, seed: int = 0, play: str | None = None
                       ) -> torch.Tensor:
    """(nsamples, seqlen) int64 windows starting at seeded random offsets in the calibration play
    (GPTQ samples random 2048-token windows of C4 the same way).

    Raises:
        ValueError: the play has fewer than seqlen + 1 tokens.
    """
    ids = tokenizer.encode(play_text(play or CALIBRATION_PLAY))
    if len(ids) <= seqlen:
        raise ValueError(f"seqlen: the calibration play has {len(ids)} tokens, need more than {seqlen}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seqlen, (nsamples,), generator=g).tolist()
    return torch.tensor([ids[s:s + seqlen] for s in starts])


def linear_of(block, name: str):
    """(the Linear at ``name`` (e.g. "attn.wqkv") in ``block``, its parent module, its attribute name)."""
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


def resolve_v2(method: str, v2: bool | None, v2_percdamp: float | None) -> tuple[bool, float | None]:
    """GPTQv2's options for ``method`` as they will run: v2 (None: on for "gptq", off for "awq+gptq", see
    ``AWQ_GPTQ_DEFAULTS``) and its dampening (None with v2 on: ``GPTQ_DEFAULTS["v2_percdamp"]``; None
    with it off). The one check of both, called before any work (the commands call it before loading).

    Raises:
        ValueError: v2 for a method without GPTQ, a dampening outside [0, 1), or one with v2 off.
    """
    gptq = method.endswith("gptq")
    v2 = (GPTQ_DEFAULTS["v2"] if method == "gptq" else False) if v2 is None else v2
    if v2 and not gptq:
        raise ValueError(f"v2: asymmetric calibration is a GPTQ option; {method} does not use it")
    if v2_percdamp is not None and not 0 <= v2_percdamp < 1:
        raise ValueError(f"v2_percdamp: must be in [0, 1) (a fraction of the mean diagonal of H; --v2-percdamp), "
                         f"got {v2_percdamp}")
    if v2_percdamp is not None and not v2:
        raise ValueError(f"v2_percdamp: dampens GPTQv2's correction, which is off for {method} here; turn on v2 "
                         "(--v2) or drop --v2-percdamp")
    return v2, (GPTQ_DEFAULTS["v2_percdamp"] if v2 and v2_percdamp is None else v2_percdamp)


@torch.inference_mode()
def quantize_model(model, method: str, config: QuantConfig, calib: torch.Tensor | None = None, *,
                   act_order: bool | None = None, static_groups: bool = False, blocksize: int = 128,
                   percdamp: float | None = None, true_sequential: bool | None = None, v2: bool | None = None,
                   v2_alpha: float = 1.0, v2_percdamp: float | None = None, awq_grid: int = 20,
                   awq_clip: bool | None = None, awq_tokens: int = 4096, fast: bool = True, progress: bool = True,
                   quant_head: str = "none") -> dict:
    """Quantize every linear layer of ``model``'s blocks in place (Linear -> ``QuantLinear``).

    Every option left at None takes the measured best for the method (``GPTQ_DEFAULTS``; the paper's
    settings are ``GPTQ_PAPER``).

    Args:
        model: a Llama-architecture ``Decoder`` (float32).
        method: "rtn", "gptq", "awq" (AWQ scales + clip, then RTN) or "awq+gptq" (AWQ scales, the clip
            only as ``awq_clip`` says, then GPTQ).
        config: bits / group_size / sym / mse (``config.mse`` None: on for GPTQ and AWQ+GPTQ, off for
            RTN and AWQ).
        calib: (N, T) calibration token ids (``calibration_tokens``); required except for "rtn".
        act_order, static_groups, blocksize, percdamp: GPTQ's options (``gptq.gptq_quantize``).
        true_sequential: calibrate each layer of a block on the outputs of the block's layers before it,
            already quantized (else all four on one pass of the float block, as the paper).
        v2, v2_alpha, v2_percdamp: GPTQ with asymmetric calibration (``gptq.asymmetric_target``): fit
            each layer to the float model's outputs on the float model's inputs; alpha scales the
            correction, v2_percdamp dampens its solve (a ridge toward the float weight; None:
            ``GPTQ_DEFAULTS["v2_percdamp"]``). On by default for "gptq"; off for "awq+gptq"
            (``AWQ_GPTQ_DEFAULTS``: not measured after AWQ's scaling).
        awq_grid: alpha grid size; awq_tokens: tokens sampled for AWQ's searches.
        awq_clip: run AWQ's clip search (Lin et al. 2024, Sec. 3.3). Default: yes, except for
            "awq+gptq" with ``config.mse``: there clipping would replace the float weights GPTQ then
            reproduces (the clipped-away part is an error GPTQ's feedback never sees) while GPTQ's
            range search already shrinks each group's range on the error-updated columns
            (measured in docs/quantization.md).
        fast: let each ``QuantLinear`` use the int4 kernel when it can (a warning names the layers
            whose layout it cannot run).
        progress: progress bar over blocks.
        quant_head: "none" (the output layer stays float, as in GPTQ and AWQ), "int8" or "int4": the
            output layer (and a tied embedding) quantized by round to nearest (``head.quantize_output``).

    Returns:
        {"method", "bits", "group_size", "act_order", ... (the options that ran), "layers": [{"name",
        "rel_error", "alpha"?}]} where rel_error = ||W_hat X - W X|| / ||W X|| on the layer's
        calibration inputs (NaN for RTN when no calibration is given).

    Raises:
        ValueError: unknown method, missing calibration, calibration windows longer than the model's
            context, v2 without GPTQ, or an architecture other than Llama.
    """
    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not one of {METHODS}")
    head_config(quant_head)  # an unknown kind is refused before the work
    awq, gptq = method.startswith("awq"), method.endswith("gptq")
    best = (GPTQ_DEFAULTS if method == "gptq" else AWQ_GPTQ_DEFAULTS if gptq
            else {**GPTQ_PAPER, "true_sequential": GPTQ_DEFAULTS["true_sequential"]})
    act_order = best["act_order"] if act_order is None else act_order
    percdamp = best["percdamp"] if percdamp is None else percdamp
    true_sequential = best["true_sequential"] if true_sequential is None else true_sequential
    v2, v2_percdamp = resolve_v2(method, v2, v2_percdamp)
    if config.mse is None:
        config = replace(config, mse=best["mse"])
    if awq_clip is None:
        awq_clip = not (gptq and config.mse)
    if (awq or gptq) and calib is None:
        raise ValueError(f"calib: {method} needs calibration tokens (see calibration_tokens)")
    if model.config.arch != "llama":
        raise ValueError(f"model: quantization supports the llama architecture, not {model.config.arch!r}")
    if calib is not None and calib.shape[1] > model.config.max_seq_len:
        raise ValueError(f"calib_seqlen: calibration windows of {calib.shape[1]} tokens do not fit the model's "
                         f"context of {model.config.max_seq_len} tokens; use {model.config.max_seq_len} or less")
    model._compiled_decode = None  # a compiled decode (minillm.compiled) froze the float weights
    quantizer = LayerQuantizer(model, config, awq=awq, gptq=gptq, awq_clip=awq and awq_clip, act_order=act_order,
                               static_groups=static_groups, blocksize=blocksize, percdamp=percdamp,
                               true_sequential=true_sequential, v2=v2, v2_alpha=v2_alpha, v2_percdamp=v2_percdamp,
                               awq_tokens=awq_tokens, fast=fast)
    report = {"method": method, "bits": config.bits, "group_size": config.group_size, "sym": config.sym,
              "mse": config.mse, "act_order": gptq and act_order, "static_groups": gptq and static_groups,
              "percdamp": percdamp if gptq else None, "true_sequential": true_sequential, "v2": v2,
              "v2_alpha": v2_alpha if v2 else None,
              "v2_percdamp": v2_percdamp if v2 else None,
              "awq_clip": awq and awq_clip, "layers": quantizer.layers}
    if calib is None:  # RTN without calibration: no inputs needed
        for i, block in enumerate(tqdm(model.layers, desc=f"quantize ({method})", disable=not progress, leave=False)):
            for name in LAYERS:
                quantizer.rtn(block, i, name)
    else:
        report.update(calib_samples=calib.shape[0], calib_seqlen=calib.shape[1])
        X, rope, mask = block_inputs(model, calib.to(model.device))
        X_float = X.clone() if v2 else None
        for i, block in enumerate(tqdm(model.layers, desc=f"quantize ({method})", disable=not progress, leave=False)):
            if awq:
                report["layers"] += awq_scale_block(model, block, i, X, rope, mask, config, awq_grid, awq_tokens)
            X, X_float = quantize_block(quantizer, block, i, X, rope, mask, X_float)
    report["quant_head"] = quant_head
    if quant_head != "none":
        report["head"] = quantize_output(model, quant_head, fast)
    warn_slow_layers(model, config)
    return report


def block_inputs(model, calib: torch.Tensor):
    """The first block's input for calibration ids (N, T): (X (N, T, C) float32, rope (cos, sin), causal mask)."""
    pos = torch.arange(calib.shape[1], device=model.device)
    mask = pos[None, :] <= pos[:, None]  # (T, T) causal
    return model.embed(calib).float(), (model.rope_cos[pos], model.rope_sin[pos]), mask


def layer_inputs(block, i: int, X: torch.Tensor, rope, mask) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One pass of ``block`` as it is now: ({layer name: its input (N, T, I)}, the block's output (N, T, C))."""
    ins = {}
    hooks = [linear_of(block, n)[0].register_forward_pre_hook(lambda m, args, n=n: ins.__setitem__(n, args[0].detach()))
             for n in LAYERS]
    try:
        out = block(X, i, rope, None, mask)
    finally:
        for h in hooks:
            h.remove()
    return ins, out


def quantize_block(quantizer: LayerQuantizer, block, i: int, X: torch.Tensor, rope, mask,
                   X_float: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize one block's layers in execution order on the quantized model's block input X (N, T, C)
    (true sequential: each on inputs computed with the layers before it already quantized; else all on
    one pass of the float block). ``X_float``: the float model's block input (v2), or None.

    Returns (the quantized block's output: the next block's X, the float block's output or None).
    """
    float_ins = None
    if X_float is not None:  # the float model's inputs of every layer, before any layer is replaced
        float_ins, X_float = layer_inputs(block, i, X_float, rope, mask)
    f = (lambda name: float_ins[name]) if float_ins else (lambda name: None)
    if not quantizer.true_sequential:
        ins, _ = layer_inputs(block, i, X, rope, mask)
        for name in LAYERS:
            quantizer(block, i, name, ins[name], f(name))
        return block(X, i, rope, None, mask), X_float
    a = block.attn_norm(X)  # (N, T, C): input of q/k/v
    quantizer(block, i, "attn.wqkv", a, f("attn.wqkv"))
    o_in = capture_input(block.attn.wo, lambda: block.attn(a, i, rope, None, mask))  # (N, T, H*D)
    X = X + quantizer(block, i, "attn.wo", o_in, f("attn.wo"))(o_in)
    m = block.ffn_norm(X)
    quantizer(block, i, "mlp.w_gate_up", m, f("mlp.w_gate_up"))
    d_in = capture_input(block.mlp.w_down, lambda: block.mlp(m))  # (N, T, F)
    return X + quantizer(block, i, "mlp.w_down", d_in, f("mlp.w_down"))(d_in), X_float


class LayerQuantizer:
    """Replaces one linear layer of a block by its ``QuantLinear``, quantized by the method's settings
    (AWQ's clip search, then GPTQ or RTN) on that layer's calibration inputs, and records its error
    in ``layers``."""

    def __init__(self, model, config: QuantConfig, *, awq: bool, gptq: bool, awq_clip: bool, act_order: bool,
                 static_groups: bool, blocksize: int, percdamp: float, true_sequential: bool = True,
                 v2: bool = False, v2_alpha: float = 1.0, v2_percdamp: float | None = None, awq_tokens: int,
                 fast: bool):
        self.model_config, self.config = model.config, config
        self.awq, self.gptq, self.awq_clip = awq, gptq, awq_clip
        self.gptq_options = {"blocksize": blocksize, "percdamp": percdamp, "act_order": act_order,
                             "static_groups": static_groups}
        self.true_sequential, self.v2, self.v2_alpha = true_sequential, v2, v2_alpha
        self.v2_percdamp = GPTQ_DEFAULTS["v2_percdamp"] if v2_percdamp is None else v2_percdamp
        self.awq_tokens, self.fast = awq_tokens, fast
        self.layers: list[dict] = []

    def rtn(self, block, i: int, name: str) -> None:
        """Round to nearest, without calibration inputs (its error is not measured: NaN)."""
        lin, parent, attr = linear_of(block, name)
        setattr(parent, attr, QuantLinear(rtn_quantize(lin.weight, self.config), lin.bias, self.fast))
        self.layers.append({"name": f"layers.{i}.{name}", "rel_error": float("nan")})

    def __call__(self, block, i: int, name: str, x: torch.Tensor, x_float: torch.Tensor | None = None) -> QuantLinear:
        lin, parent, attr = linear_of(block, name)
        W_float = lin.weight.float()  # (O, I), reassembled from the shards once
        W = W_float
        if self.awq_clip:
            rows = None
            if name == "attn.wqkv":  # q and k rows are not clipped (AWQ)
                c = self.model_config
                rows = slice((c.n_heads + c.n_kv_heads) * c.head_dim, W.shape[0])
            W = search_clip(W, _subsample(x, min(self.awq_tokens, 512)), self.config, rows)
        if self.gptq:
            h = Hessian(W.shape[1], device=W.device)
            h.add_batch(x, x_float if self.v2 else None)
            if self.v2:
                W = asymmetric_target(W, h.H, h.dXXT, self.v2_percdamp, self.v2_alpha)
            qw = gptq_quantize(W, h.H, self.config, **self.gptq_options)
        else:
            qw = rtn_quantize(W, self.config)
        x2 = _subsample(x, 4096)
        ref = x2 @ W_float.t()
        rel = ((x2 @ qw.dequantize().t() - ref).norm() / ref.norm()).item()
        self.layers.append({"name": f"layers.{i}.{name}", "rel_error": rel})
        new = QuantLinear(qw, lin.bias, self.fast)
        setattr(parent, attr, new)
        return new


def awq_scale_block(model, block, i, X, rope, mask, config, n_grid, n_tokens) -> list[dict]:
    """Search and fold AWQ scales for one float block; returns the chosen alphas."""
    c = model.config
    ins = {}
    hooks = [linear_of(block, n)[0].register_forward_pre_hook(
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
