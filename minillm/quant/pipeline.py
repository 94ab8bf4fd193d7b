"""Quantize a whole ``Decoder`` as a ``Recipe`` says (``recipe.py``): calibration text and the block-by-block loop.

The loop follows GPTQ's sequential scheme (paper Sec. 4, "Step 3"; AWQ's code does the same): the
calibration tokens are embedded once, then for each block in order

1. (AWQ) the float block runs on its inputs X; scales for q/k/v, gate/up and down are searched, folded in (``awq.py``);
2. its linear layers are quantized **in execution order** (qkv, o, gate/up, down), each calibrated on inputs computed
   with the layers before it already quantized ("true sequential"; with ``Recipe.true_sequential=False`` all four
   calibrate on one pass of the float block, as in the paper);
3. the quantized block's outputs become the next block's X.

So every layer sees the activations the quantized model will give it. With ``v2`` (GPTQv2) a float copy of the
activations runs beside them and each layer is fitted to the float model's outputs. The embedding and the (tied)
output layer stay unquantized, as in GPTQ and AWQ; the calibration text is a play disjoint from the evaluation play
(``minillm.data``).
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..data import CALIBRATION_PLAY, play_text
from ..model import Linear
from .awq import fold_scales, search_clip, search_scales
from .gptq import Hessian, asymmetric_target, gptq_quantize
from .head import quantize_output
from .qlinear import QuantLinear, warn_slow_layers
from .recipe import Recipe
from .rtn import QuantConfig, rtn_quantize

CALIB_SAMPLES = 32  # calibration windows of 512 tokens (the measured best; the paper: 128 of 2048)
AWQ_GRID = 20  # AWQ's grid of alphas for s = mean|x|^alpha (Lin et al. 2024)
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


@torch.inference_mode()
def quantize_model(model, recipe: Recipe, calib: torch.Tensor | None = None, *, fast: bool = True,
                   progress: bool = True) -> dict:
    """Quantize every linear layer of ``model``'s blocks in place (Linear -> ``QuantLinear``) as ``recipe``
    says (``recipe.PAPER``, ``recipe.BEST`` or any ``Recipe``).

    Args:
        model: a Llama-architecture ``Decoder`` (float32).
        recipe: the method, the grid and every option: ``recipe.PAPER``, ``recipe.BEST``, or
            ``Recipe.of(method, config=QuantConfig(...), **options)``, the method's measured best (GPTQ:
            ``BEST``; AWQ+GPTQ: ``AWQ_GPTQ``) with the options given.
        calib: (N, T) calibration token ids (``calibration_tokens``); required except for "rtn".
        fast: let each ``QuantLinear`` use the int4 kernel when it can (a warning names the layers
            whose layout it cannot run).
        progress: progress bar over blocks.

    Returns:
        {**recipe.report() (the options as they ran), "layers": [{"name", "rel_error", "awq_alpha"?}],
        "calib_samples", "calib_seqlen", "quant_head", "head"?} where rel_error = ||W_hat X - W X|| / ||W X||
        on the layer's calibration inputs (NaN for RTN when no calibration is given).

    Raises:
        TypeError: ``recipe`` is not a ``Recipe`` (a method name or a ``QuantConfig``, say); the message
            shows the ``Recipe.of`` call that means it.
        ValueError: missing calibration, calibration windows longer than the model's context, or an
            architecture other than Llama; all before any layer changes. (A bad recipe is refused when
            the ``Recipe`` is built.)
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(_recipe_hint(recipe, calib))
    _check_inputs(model, recipe, calib)
    model.drop_compiled_step()  # a compiled decode froze the weights as they were
    quantizer = LayerQuantizer(model, recipe, fast)
    report = {**recipe.report(), "layers": quantizer.layers}
    blocks = tqdm(model.layers, desc=f"quantize ({recipe.method})", disable=not progress, leave=False)
    if calib is None:  # RTN without calibration: no inputs needed
        for i, block in enumerate(blocks):
            for name in LAYERS:
                quantizer.rtn(block, i, name)
    else:
        report.update(calib_samples=calib.shape[0], calib_seqlen=calib.shape[1])
        X, rope, mask = block_inputs(model, calib.to(model.device))
        X_float = X.clone() if recipe.v2 else None  # GPTQv2: the float model's activations, beside
        for i, block in enumerate(blocks):
            if recipe.awq:
                report["layers"] += awq_scale_block(model, block, i, X, rope, mask, recipe.config, AWQ_GRID,
                                                    recipe.awq_tokens)
            X, X_float = quantize_block(quantizer, block, i, X, rope, mask, X_float)
    report["quant_head"] = recipe.quant_head
    if recipe.quant_head != "none":
        report["head"] = quantize_output(model, recipe.quant_head, fast)
    warn_slow_layers(model, recipe.config)
    return report


def _recipe_hint(recipe, calib) -> str:
    """quantize_model's TypeError for a recipe that is not a ``Recipe``: the ``Recipe.of`` call to pass instead."""
    method = recipe if isinstance(recipe, str) else "rtn"
    config = next((c for c in (recipe, calib) if isinstance(c, QuantConfig)), None)
    grid = "QuantConfig(4, 32)" if config is None else repr(config)
    return (f"quantize_model: recipe must be a Recipe, got {type(recipe).__name__} {recipe!r}; pass a Recipe: "
            f"quantize_model(model, Recipe.of({method!r}, config={grid}), calib) (or recipe.PAPER / recipe.BEST)")


def _check_inputs(model, recipe: Recipe, calib: torch.Tensor | None) -> None:
    if (recipe.awq or recipe.gptq) and calib is None:
        raise ValueError(f"calib: {recipe.method} needs calibration tokens (see calibration_tokens)")
    if model.config.arch != "llama":
        raise ValueError(f"model: quantization supports the llama architecture, not {model.config.arch!r}")
    if calib is not None and calib.shape[1] > model.config.max_seq_len:
        raise ValueError(f"calib_seqlen: calibration windows of {calib.shape[1]} tokens do not fit the model's "
                         f"context of {model.config.max_seq_len} tokens; use {model.config.max_seq_len} or less")


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
    if not quantizer.recipe.true_sequential:
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
    """Replaces one linear layer of a block by its ``QuantLinear``, quantized as ``recipe`` says (AWQ's
    clip search, then GPTQ or RTN) on that layer's calibration inputs, and records its error in ``layers``."""

    def __init__(self, model, recipe: Recipe, fast: bool = True):
        self.model_config, self.recipe, self.config, self.fast = model.config, recipe, recipe.config, fast
        self.layers: list[dict] = []
        self.cls = model.quant_linear_class or QuantLinear  # the speed layer's, on an accelerated model

    def rtn(self, block, i: int, name: str) -> None:
        """Round to nearest, without calibration inputs (its error is not measured: NaN)."""
        lin, parent, attr = linear_of(block, name)
        setattr(parent, attr, self.cls(rtn_quantize(lin.weight, self.config), lin.bias, self.fast))
        self.layers.append({"name": f"layers.{i}.{name}", "rel_error": float("nan")})

    def __call__(self, block, i: int, name: str, x: torch.Tensor, x_float: torch.Tensor | None = None) -> QuantLinear:
        r = self.recipe
        lin, parent, attr = linear_of(block, name)
        W_float = lin.weight.float()  # (O, I), reassembled from the shards once
        W = W_float
        if r.clip:
            rows = None
            if name == "attn.wqkv":  # q and k rows are not clipped (AWQ)
                c = self.model_config
                rows = slice((c.n_heads + c.n_kv_heads) * c.head_dim, W.shape[0])
            W = search_clip(W, _subsample(x, min(r.awq_tokens, 512)), self.config, rows)
        if r.gptq:
            h = Hessian(W.shape[1], device=W.device)
            h.add_batch(x, x_float if r.v2 else None)
            if r.v2:
                W = asymmetric_target(W, h.H, h.dXXT, r.v2_percdamp, r.v2_alpha)
            qw = gptq_quantize(W, h.H, self.config, percdamp=r.percdamp, act_order=r.act_order,
                               static_groups=r.static_groups)
        else:
            qw = rtn_quantize(W, self.config)
        x2 = _subsample(x, 4096)
        ref = x2 @ W_float.t()
        rel = ((x2 @ qw.dequantize().t() - ref).norm() / ref.norm()).item()
        self.layers.append({"name": f"layers.{i}.{name}", "rel_error": rel})
        new = self.cls(qw, lin.bias, self.fast)
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
    """Replace a float linear layer's weight (O, I) (``load_weight``: the speed layer's keeps its layout)."""
    lin.load_weight(W)
