"""The variable-bitrate command ``quantize --bpw B``, registered by ``minillm.quant.cli``: measure (or read a
measurement), optimize, quantize, save. The technique itself is ``minillm.quant.bitrate``; its end-to-end
measurement ``minillm.quant.sensitivity``. ``bench quant --bpw LIST`` (the benchmark against uniform
settings, its figures) is the lab's ``minillm.lab.bitrate``, which reads or writes measurements as
``load_or_measure`` does."""

from __future__ import annotations

import json
import math
import os

import torch

from .bitrate import (DEFAULT_OPTIONS, format_choice, format_measurement, measure, model_bpw, optimize, quantize_variable,
                      save_result)
from .head import quantize_output
from .pipeline import LAYERS, calibration_tokens, linear_of
from .recipe import Recipe
from .sensitivity import measure_logits

#: the measurement passes of a --bpw command: "kl" (``sensitivity.measure_logits``: each layer's KL cost on the
#: model's output, RTN, 2 windows; the default, because in notebook 05b its allocations beat uniform RTN at
#: every budget where the block-output errors' did not) or "block" (``bitrate.measure``: each block's output
#: error with the command's quantizer, plain GPTQ for gptq)
MEASURES = ("kl", "block")


def measure_help(quantizer_flag: str) -> str:
    return (f"with --bpw: kl (default: each layer's KL cost on the model's output, one layer rounded by RTN at a "
            f"time, on 2 windows, whatever {quantizer_flag} says) or block (ExLlamaV2's: each block's output error "
            f"with the {quantizer_flag} quantizer; for gptq plain GPTQ, each layer on float inputs)")


def add_quantize_args(p) -> None:
    p.add_argument("--bpw", type=float, default=None,
                   help="variable bitrate (--quant gptq or rtn): measure every layer under each option of "
                   f"{', '.join(f'{b}-bit g{g}' for b, g in DEFAULT_OPTIONS)}, then choose one option per layer "
                   "for this average of bits per weight (codes + float16 scales + zeros); replaces --bits/--group-size")
    p.add_argument("--measurement", default=None,
                   help="with --bpw: a measurement JSON to read (it is written there when the file does not exist)")
    p.add_argument("--measure", choices=MEASURES, default=None, help=measure_help("--quant"))


def measure_pass(model, calib: torch.Tensor, method: str, how: str = "kl", options=DEFAULT_OPTIONS,
                 progress: bool = True) -> dict:
    """The measurement a --bpw command runs (``MEASURES``): "kl", ``sensitivity.measure_logits`` on the
    first 2 windows of ``calib``; "block", ``bitrate.measure`` with ``method``'s quantizer (GPTQ on 16 windows,
    its errors on 4; RTN on 2).

    Raises:
        ValueError: an unknown ``how``.
    """
    if how not in MEASURES:
        raise ValueError(f"measure: {how!r} is not one of {MEASURES}")
    if how == "kl":
        return measure_logits(model, calib[:2], options, progress=progress)
    n = 16 if method == "gptq" else 2  # RTN needs no Hessian: only the windows the errors are measured on
    return measure(model, calib[:n], options, error_windows=min(4 if method == "gptq" else 2, calib.shape[0]),
                   mse=method == "gptq", method=method, progress=progress)


def check_table(table: dict, model) -> None:
    """A measurement read from a file must describe this model's layers (names and shapes)."""
    want = {f"layers.{i}.{n}": (linear_of(b, n)[0].out_features, linear_of(b, n)[0].in_features)
            for i, b in enumerate(model.layers) for n in LAYERS}
    try:
        got = {r["name"]: (r["out_features"], r["in_features"]) for r in table["layers"]}
        opts = [tuple(o) for o in table["options"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"measurement: not a measurement table (missing {e}); write one with --measurement") from None
    if got != want:
        raise ValueError("measurement: its layers are not this model's (another model, or only some blocks "
                         "measured); measure this model, or give its own measurement")
    if not opts or any(len(r["errors"]) != len(opts) or len(r["bits"]) != len(opts) for r in table["layers"]):
        raise ValueError("measurement: every layer needs one error and one cost per option")
    if not table.get("setup", {}).get("end_to_end") and any("update_norm" not in r for r in table["layers"]):
        raise ValueError("measurement: it has no block norms (out_norm, update_norm), which measure records; "
                         "measure again")


def load_or_measure(args, model, calib, method: str, progress: bool) -> dict:
    if args.measurement and os.path.exists(args.measurement):
        try:
            with open(args.measurement, encoding="utf-8") as f:
                table = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"measurement: cannot read {args.measurement!r} as JSON ({e})") from None
        table = table.get("measurement", table)  # a bench result holds its measurement
        check_table(table, model)
        kind = "kl" if table["setup"].get("end_to_end") else "block"
        if args.measure is not None and args.measure != kind:
            raise ValueError(f"measurement: {args.measurement!r} holds a {kind} measurement, not --measure {args.measure}; "
                             "drop --measure or give another file")
        if not table["setup"].get("end_to_end") and table["setup"].get("method", "gptq") != method:
            raise ValueError(f"measurement: {args.measurement!r} was measured with {table['setup'].get('method')}, "
                             f"not {method}; measure again (another file) or pick that method")
        return table
    table = measure_pass(model, calib, method, args.measure or "kl", progress=progress)
    if args.measurement:
        save_result(table, args.measurement)
    return table


def cmd_quantize_bpw(args, recipe: Recipe, load, check_output_path, save_quantized, src: str) -> dict:
    """``quantize --quant gptq --bpw B``: measure (or read --measurement), optimize, quantize with ``recipe``
    (the command's, whose bits and group size each layer's choice replaces), save. Returns the command's
    report; prints the measured errors, the choice and the achieved bpw."""
    if args.quant not in ("gptq", "rtn"):
        raise ValueError(f"bpw: variable bitrate quantizes with GPTQ or RTN; use --quant gptq or --quant rtn "
                         f"(got --quant {args.quant})")
    if not math.isfinite(args.bpw) or args.bpw <= 0:
        raise ValueError(f"bpw: expected a positive number of bits per weight, got {args.bpw}")
    unsupported = [flag for flag, on in (("--static-groups", args.static_groups), ("--sym", args.sym)) if on]
    if unsupported:
        raise ValueError(f"bpw: variable bitrate quantizes asymmetric codes with dynamic groups; drop {', '.join(unsupported)}")
    model, tokenizer = load(args)
    calib = calibration_tokens(tokenizer, args.calib_samples, args.calib_seqlen)
    table = load_or_measure(args, model, calib, args.quant, progress=not args.json)
    result = optimize(table, args.bpw)
    report = quantize_variable(model, result["choice"], calib, recipe, progress=not args.json)
    report["quant_head"] = recipe.quant_head
    if recipe.quant_head != "none":
        report["head"] = quantize_output(model, recipe.quant_head, True)
    out = save_quantized(model, args.out, report, tokenizer_source=src)
    if not args.json:
        print(format_measurement(table))
        print(format_choice(result))
    return {"out": str(out), "format": "safetensors", "bytes": os.path.getsize(out), "float32_bytes": 4 * model.config.n_params,
            "method": args.quant, "bits": None, "group_size": None, "target_bpw": args.bpw, "bpw": model_bpw(model),
            "objective": result["objective"], "layer_configs": report["layer_configs"],
            "measured_errors": {r["name"]: dict(zip([f"{b}b_g{g}" for b, g in table["options"]], r["errors"]))
                                for r in table["layers"]}}
