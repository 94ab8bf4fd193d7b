"""Variable bitrate, as ExLlamaV2 does it: bits allotted to each linear layer by how much its
quantization hurts, under a budget of total bits (written from the description of turboderp's converter).

1. ``measure``: for every block, on float inputs, each linear layer is quantized with GPTQ under each
   (bits, group_size) option while the rest of the block stays float, and the relative error of the
   block's output ``||Y_hat - Y|| / ||Y||`` is recorded (blocks are independent: splittable by ``blocks``).
2. ``optimize``: one option per layer minimising ``sum err^power`` subject to ``sum bits <= bpw *
   weights``, a multiple-choice knapsack solved by dynamic programming over the budget (costs rounded
   up, so the answer always fits); ``optimize_naive`` (same signature) tries every combination.

``quantize_variable`` then quantizes with the chosen options through the ordinary GPTQ pipeline. Bits
are counted as ``QuantConfig.bits_per_weight`` counts them. ``quantize --bpw B`` runs the plan
(``bitrate_cli.py``); its benchmark is the lab's (``minillm.lab.bitrate``). docs/quant_methods.md has more.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..files import atomic_write, dumps_strict
from .gptq import Hessian, gptq_quantize
from .pipeline import LAYERS, LayerQuantizer, block_inputs, linear_of, quantize_block
from .qlinear import QuantLinear
from .recipe import BEST, Recipe
from .rtn import QuantConfig, rtn_quantize

# (bits, group_size): 2.28 .. 4.62 bits per weight (bits + (16 + bits) / group_size)
DEFAULT_OPTIONS = ((2, 64), (2, 32), (3, 64), (3, 32), (4, 64), (4, 32))


def option_bits(out_features: int, in_features: int, bits: int, group_size: int) -> int:
    """Total bits of one (out_features, in_features) layer with ``bits``-bit codes, counted as
    ``QuantConfig.bits_per_weight`` counts them (a float16 scale and a ``bits``-bit zero per group)."""
    return round(out_features * in_features * QuantConfig(bits, group_size).bits_per_weight(in_features))


def check_options(options) -> list[tuple[int, int]]:
    """The (bits, group_size) options as a list of tuples. Raises ValueError: none, a bad one, or a repeat."""
    opts = [tuple(o) for o in options]
    if not opts:
        raise ValueError("options: give at least one (bits, group_size)")
    for b, g in opts:
        QuantConfig(b, g)  # raises naming a bad field
    if len(set(opts)) != len(opts):
        raise ValueError(f"options: {opts} repeats an option")
    return opts


@torch.inference_mode()
def measure(model, calib: torch.Tensor, options=DEFAULT_OPTIONS, *, error_windows: int = 4,
            act_order: bool = BEST.act_order, percdamp: float = BEST.percdamp, mse: bool = BEST.mse, blocks=None,
            method: str = "gptq", progress: bool = True) -> dict:
    """The measurement pass: the block-output error of every (layer, option).

    Args:
        model: a Llama ``Decoder`` (float32); left unchanged.
        calib: (N, T) calibration ids; every window feeds the Hessians, the first ``error_windows``
            measure the errors.
        options: (bits, group_size) pairs to try on every layer.
        act_order, percdamp, mse: GPTQ's settings (default ``BEST``'s; plain GPTQ, each layer on float inputs).
        blocks: the block indices to measure (default: all); tables of disjoint blocks join with
            ``merge_tables``.
        method: "gptq", or "rtn" (round to nearest: no Hessian, the cheap variant of the same plan).
        progress: a progress bar over (block, layer) pairs.

    Returns:
        {"options": [[bits, group_size], ...], "layers": [{"name", "out_features", "in_features",
        "bits": [total bits per option], "errors": [||Y_hat - Y|| / ||Y|| per option]}], "setup": {...}}

    Raises:
        ValueError: bad options, calibration windows past the model's context, or not a llama model.
    """
    options = check_options(options)
    if method not in ("gptq", "rtn"):
        raise ValueError(f"method: variable bitrate quantizes with 'gptq' or 'rtn', not {method!r}")
    if model.config.arch != "llama":
        raise ValueError(f"model: variable bitrate supports the llama architecture, not {model.config.arch!r}")
    if calib.shape[1] > model.config.max_seq_len:
        raise ValueError(f"calib: windows of {calib.shape[1]} tokens do not fit the model's context of "
                         f"{model.config.max_seq_len}")
    if not 1 <= error_windows <= calib.shape[0]:
        raise ValueError(f"error_windows: must be in 1..{calib.shape[0]} (the calibration windows), got {error_windows}")
    n = len(model.layers)
    blocks = list(range(n)) if blocks is None else sorted(set(blocks))
    if any(not 0 <= i < n for i in blocks):
        raise ValueError(f"blocks: indices must be in 0..{n - 1}, got {blocks}")
    X, rope, mask = block_inputs(model, calib.to(model.device))
    layers = []
    bar = tqdm(total=len(blocks) * len(LAYERS), desc="measure", disable=not progress, leave=False)
    for i, block in enumerate(model.layers):
        if i > max(blocks):
            break
        if i not in blocks:
            X = block(X, i, rope, None, mask)
            continue
        ins = {}
        hooks = [linear_of(block, name)[0].register_forward_pre_hook(
            lambda m, args, name=name: ins.__setitem__(name, args[0].detach())) for name in LAYERS]
        try:
            Y = block(X, i, rope, None, mask)  # (N, T, C) float output
        finally:
            for h in hooks:
                h.remove()
        Xe, Ye = X[:error_windows], Y[:error_windows]
        norms = {"out_norm": Ye.norm().item(), "update_norm": (Ye - Xe).norm().item()}  # ||Y||, ||Y - X||
        for name in LAYERS:
            lin, parent, attr = linear_of(block, name)
            W = lin.weight.float()
            h = Hessian(W.shape[1], device=W.device)
            if method == "gptq":
                h.add_batch(ins[name])
            row = {"name": f"layers.{i}.{name}", "out_features": W.shape[0], "in_features": W.shape[1],
                   **norms, "bits": [], "errors": []}
            try:
                for bits, group in options:
                    config = QuantConfig(bits, group, mse=mse)
                    qw = (gptq_quantize(W, h.H, config, act_order=act_order, percdamp=percdamp) if method == "gptq"
                          else rtn_quantize(W, config))
                    setattr(parent, attr, QuantLinear(qw, lin.bias, fast=False))  # exact: dequantize + matmul
                    err = (block(Xe, i, rope, None, mask) - Ye).norm() / Ye.norm()
                    row["bits"].append(option_bits(W.shape[0], W.shape[1], bits, group))
                    row["errors"].append(err.item())
            finally:
                setattr(parent, attr, lin)
            layers.append(row)
            bar.update()
        X = Y
    bar.close()
    return {"options": [list(o) for o in options], "layers": layers,
            "setup": {"method": method, "calib_samples": calib.shape[0], "calib_seqlen": calib.shape[1], "error_windows": error_windows,
                      "act_order": act_order, "percdamp": percdamp, "mse": mse, "blocks": blocks,
                      "error": "||Y_hat - Y|| / ||Y|| of the block output, the other layers float, float inputs"}}


def merge_tables(tables: list[dict]) -> dict:
    """Join measurements of disjoint blocks (same options) into one table, layers in model order."""
    if not tables:
        raise ValueError("tables: give at least one measurement")
    opts = tables[0]["options"]
    if any(t["options"] != opts for t in tables):
        raise ValueError("tables: the measurements tried different options; measure them with the same ones")
    layers = [row for t in tables for row in t["layers"]]
    names = [r["name"] for r in layers]
    if len(set(names)) != len(names):
        raise ValueError("tables: a layer is measured twice; merge measurements of disjoint blocks")
    key = lambda r: (int(r["name"].split(".")[1]), LAYERS.index(r["name"].split(".", 2)[2]))
    setup = {**tables[0]["setup"], "blocks": sorted(b for t in tables for b in t["setup"]["blocks"])}
    return {"options": opts, "layers": sorted(layers, key=key), "setup": setup}


def _problem(table: dict, bpw: float):
    layers = table["layers"]
    if not layers:
        raise ValueError("table: has no layers")
    weights = sum(r["out_features"] * r["in_features"] for r in layers)
    budget = bpw * weights
    cheapest = sum(min(r["bits"]) for r in layers)
    if not math.isfinite(bpw) or cheapest > budget:
        raise ValueError(f"bpw: {bpw} is below what the cheapest options cost ({cheapest / weights:.3f} bits per "
                         "weight); raise --bpw or measure options with fewer bits or larger groups")
    return layers, weights, budget


RELATIVE_TO = ("update", "output")


def layer_errors(row: dict, relative_to: str = "update") -> list[float]:
    """A measured row's errors relative to the block's update ``||Y - X||`` ("update") or to its output
    ``||Y||`` ("output", what ``measure`` records). The residual stream of this model carries a few
    very large activations from block 11 on, so ``||Y||`` there is large and every layer after it looks
    harmless relative to it; relative to the block's own update it does not (docs/quantization.md)."""
    if relative_to not in RELATIVE_TO:
        raise ValueError(f"relative_to: one of {RELATIVE_TO}, got {relative_to!r}")
    if relative_to == "output":
        return row["errors"]
    return [e * row["out_norm"] / row["update_norm"] for e in row["errors"]]


def table_power(table: dict, power: float | None = None) -> float:
    """``power`` if given, else the measurement's own (``setup["power"]``), else 2."""
    return float(table.get("setup", {}).get("power", 2.0) if power is None else power)


def table_errors(table: dict, relative_to: str = "update") -> list[list[float]]:
    """Every layer's errors as the optimizer weighs them: an end-to-end measurement's costs as they are
    (``setup["end_to_end"]``, written by ``sensitivity.measure_logits``), a block measurement's relative
    to ``relative_to`` (``layer_errors``)."""
    if table.get("setup", {}).get("end_to_end"):
        return [r["errors"] for r in table["layers"]]
    return [layer_errors(r, relative_to) for r in table["layers"]]


def _result(table: dict, picks: list[int], weights: int, power: float, bpw: float, relative_to: str) -> dict:
    layers, opts = table["layers"], table["options"]
    total = sum(r["bits"][k] for r, k in zip(layers, picks))
    errs = table_errors(table, relative_to)
    if table.get("setup", {}).get("end_to_end"):
        relative_to = "kl"  # the record says what was weighed: KL costs, not block errors
    return {"target_bpw": bpw, "bpw": total / weights, "total_bits": total, "power": power, "relative_to": relative_to,
            "objective": sum(e[k] ** power for e, k in zip(errs, picks)),
            "choice": {r["name"]: list(opts[k]) for r, k in zip(layers, picks)},
            "errors": {r["name"]: e[k] for r, e, k in zip(layers, errs, picks)}}


def optimize(table: dict, bpw: float, *, power: float | None = None, resolution: int = 4000,
             relative_to: str = "update") -> dict:
    """One option per layer minimising ``sum err^power`` with total bits <= ``bpw`` x weights, err being
    each layer's measured block error relative to ``relative_to`` (``layer_errors``).

    Dynamic programming over the budget in units of ``max(1, budget / resolution)`` bits (O(layers x
    options x resolution)); the answer is read back from the largest unit budget whose true total fits,
    so it always fits, and is optimal when costs are whole units.

    Args:
        table: a measurement (``measure``, ``merge_tables`` or ``sensitivity.measure_logits``).
        bpw: the budget, in bits per weight.
        power: the exponent; None: the table's own (``setup["power"]``: 1 for the end-to-end KL costs of
            ``sensitivity.measure_logits``, which add), else 2 (block errors as independent noises, which
            add in power).
        resolution: the most units the budget is cut into.
        relative_to: "update" or "output" (``layer_errors``); end-to-end costs are taken as they are.

    Returns:
        {"target_bpw", "bpw" (achieved), "total_bits", "objective", "power", "choice": {layer name:
        [bits, group_size]}, "errors": {layer name: measured error of its choice}}

    Raises:
        ValueError: the budget is below the cheapest options.
    """
    layers, weights, budget = _problem(table, bpw)
    power = table_power(table, power)
    errs = table_errors(table, relative_to)
    unit = max(1.0, budget / resolution)
    B = int(math.floor(budget / unit + 1e-9))
    INF = float("inf")
    best = torch.zeros(B + 1, dtype=torch.float64)  # best[b]: least objective of the layers so far in <= b units
    picks = []
    for r, row_errs in zip(layers, errs):
        costs = [round(c / unit) for c in r["bits"]]
        new = torch.full((B + 1,), INF, dtype=torch.float64)
        arg = torch.full((B + 1,), -1, dtype=torch.int64)
        for k, (c, e) in enumerate(zip(costs, row_errs)):
            if c > B:
                continue
            cand = torch.full((B + 1,), INF, dtype=torch.float64)
            cand[c:] = best[:B + 1 - c] + e ** power
            better = cand < new  # strict: the first option (the listed order) wins ties
            new = torch.where(better, cand, new)
            arg = torch.where(better, torch.full_like(arg, k), arg)
        best = new
        picks.append(arg)
    for top in range(B, -1, -1):  # rounding can overshoot by < layers / 2 units: step down until it fits
        if not math.isfinite(best[top]):
            continue
        b, chosen = top, []
        for r, arg in zip(reversed(layers), reversed(picks)):
            k = int(arg[b])
            chosen.append(k)
            b -= round(r["bits"][k] / unit)
        chosen = chosen[::-1]
        if sum(r["bits"][k] for r, k in zip(layers, chosen)) <= budget:
            return _result(table, chosen, weights, power, bpw, relative_to)
    raise ValueError(f"bpw: no choice of options fits {bpw} bits per weight; raise --bpw")


def optimize_naive(table: dict, bpw: float, *, power: float | None = None, resolution: int = 4000,
                   relative_to: str = "update") -> dict:
    """The baseline of ``optimize`` (same signature): every combination of options, the least
    objective whose true total bits fit (``resolution`` is ignored). Refuses more than 10^6 combinations."""
    layers, weights, budget = _problem(table, bpw)
    n = math.prod(len(r["bits"]) for r in layers)
    if n > 10**6:
        raise ValueError(f"table: {n} combinations are too many to try; use optimize")
    power = table_power(table, power)
    errs = table_errors(table, relative_to)
    best, picks = float("inf"), None
    for combo in itertools.product(*(range(len(r["bits"])) for r in layers)):
        if sum(r["bits"][k] for r, k in zip(layers, combo)) > budget:
            continue
        obj = sum(e[k] ** power for e, k in zip(errs, combo))
        if obj < best:
            best, picks = obj, combo
    return _result(table, list(picks), weights, power, bpw, relative_to)


class _PerLayerQuantizer(LayerQuantizer):
    """``LayerQuantizer`` with one ``QuantConfig`` per layer name (``layers.{i}.{name}``)."""

    def __init__(self, model, configs: dict[str, QuantConfig], recipe: Recipe, fast: bool):
        super().__init__(model, recipe, fast)
        self.configs = configs

    def __call__(self, block, i: int, name: str, x: torch.Tensor, x_float: torch.Tensor | None = None) -> QuantLinear:
        self.config = self.configs[f"layers.{i}.{name}"]
        return super().__call__(block, i, name, x, x_float)


@torch.inference_mode()
def quantize_variable(model, choice: dict[str, list[int]], calib: torch.Tensor | None, recipe: Recipe = BEST, *,
                      fast: bool = True, progress: bool = True) -> dict:
    """Quantize ``model`` in place as ``recipe`` says (GPTQ, default ``BEST``, or ``Recipe("rtn")``: round to
    nearest, which needs no ``calib``), each layer with its own (bits, group_size) from ``choice``
    (``optimize(...)["choice"]``) in place of the recipe's, through the pipeline's block loop
    (``pipeline.quantize_block``). RTN keeps min / max ranges here (the recipe's mse is GPTQ's).

    Returns:
        The report ``save_quantized`` needs: the recipe's options (``Recipe.report``) with bits /
        group_size None, "layer_configs" {name: [bits, group_size]}, "layers" [{"name", "rel_error"}]
        (each layer's output error on its calibration inputs).

    Raises:
        ValueError: ``choice`` misses a layer of the model or names one it does not have; a method other
            than gptq or rtn, or a recipe variable bitrate does not run (symmetric codes, static groups).
    """
    names = [f"layers.{i}.{n}" for i in range(len(model.layers)) for n in LAYERS]
    if set(choice) != set(names):
        missing, extra = sorted(set(names) - set(choice)), sorted(set(choice) - set(names))
        raise ValueError(f"choice: must name every linear layer of the model once (missing {missing[:3]}, "
                         f"unknown {extra[:3]}); measure the whole model")
    if recipe.method not in ("gptq", "rtn"):
        raise ValueError(f"method: variable bitrate quantizes with 'gptq' or 'rtn', not {recipe.method!r}")
    if recipe.sym or recipe.static_groups:
        raise ValueError("recipe: variable bitrate quantizes asymmetric codes with dynamic groups; drop sym and static_groups")
    gptq = recipe.gptq
    configs = {n: QuantConfig(int(choice[n][0]), int(choice[n][1]), mse=recipe.mse and gptq) for n in names}
    model.drop_compiled_step()  # a compiled decode froze the weights as they were
    quantizer = _PerLayerQuantizer(model, configs, recipe, fast)
    if not gptq:  # no calibration inputs needed (errors not measured: NaN)
        for i, block in enumerate(tqdm(model.layers, desc="quantize (variable)", disable=not progress, leave=False)):
            for name in LAYERS:
                quantizer.config = configs[f"layers.{i}.{name}"]
                quantizer.rtn(block, i, name)
    else:
        X, rope, mask = block_inputs(model, calib.to(model.device))
        X_float = X.clone() if recipe.v2 else None
        for i, block in enumerate(tqdm(model.layers, desc="quantize (variable)", disable=not progress, leave=False)):
            X, X_float = quantize_block(quantizer, block, i, X, rope, mask, X_float)
    return {**recipe.report(), "bits": None, "group_size": None, "mse": recipe.mse and gptq,
            "true_sequential": recipe.true_sequential if gptq else None,
            "calib_samples": None if calib is None else calib.shape[0],
            "calib_seqlen": None if calib is None else calib.shape[1],
            "layer_configs": {n: list(choice[n]) for n in names}, "layers": quantizer.layers}


def model_bpw(model) -> float:
    """Bits per weight of a quantized model's block linear layers, counted as ``option_bits`` does."""
    total = weights = 0
    for block in model.layers:
        for name in LAYERS:
            lin = linear_of(block, name)[0]
            if not isinstance(lin, QuantLinear):
                raise ValueError("model: has float linear layers; quantize it first")
            total += option_bits(lin.out_features, lin.in_features, lin.config.bits, lin.config.group_size)
            weights += lin.out_features * lin.in_features
    return total / weights


# ---- what quantize --bpw prints and keeps -----------------------------------------------------------

def format_measurement(table: dict) -> str:
    """The measured block-output error of every layer under every option, one row per layer."""
    opts = [f"{b}b g{g}" for b, g in table["options"]]
    lines = [f"{'layer':24s} " + " ".join(f"{o:>8s}" for o in opts)]
    for r in table["layers"]:
        lines.append(f"{r['name']:24s} " + " ".join(f"{e:8.5f}" for e in r["errors"]))
    return "\n".join(lines)


def format_choice(result: dict) -> str:
    """The chosen (bits, group) of every layer, one line per block, and the achieved bits per weight."""
    blocks: dict[int, list[str]] = {}
    for name, (b, g) in result["choice"].items():
        blocks.setdefault(int(name.split(".")[1]), []).append(f"{name.split('.', 2)[2]}={b}b/g{g}")
    lines = [f"block {i:2d}: " + " ".join(v) for i, v in sorted(blocks.items())]
    bpw = result.get("bpw")
    lines.append(f"target {result['target_bpw']} bits per weight; achieved {bpw:.4f} (codes + float16 scales + zeros)")
    return "\n".join(lines)


def option_bpw(bits: int, group_size: int, in_features: int = 576) -> float:
    """Bits per weight of one option on a layer with ``in_features`` inputs."""
    return QuantConfig(bits, group_size).bits_per_weight(in_features)


def save_result(result: dict, path) -> Path:
    """Write a result (or a measurement table) as strict JSON, replacing ``path`` only when complete."""
    path = Path(path)
    with atomic_write(path) as tmp:
        tmp.write_text(dumps_strict(result, indent=1))
    return path
