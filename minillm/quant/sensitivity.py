"""End-to-end sensitivity of each linear layer to quantization: the measurement pass of variable bitrate
scored on the model's output instead of the block's.

``bitrate.measure`` scores an option by the error it leaves in its own block's output, which misses what
the error does downstream (the blocks after it can amplify or absorb it; notebook 05b measures how much
that matters). ``measure_logits`` quantizes one layer at a time, leaves every
other layer float, runs the rest of the model and records KL(float || quantized) of the next-token
distributions on calibration windows, in nats per token. For small perturbations these KL costs add up
across layers, so ``bitrate.optimize`` minimises their plain sum (power 1) under the bit budget.

The blocks before the quantized layer are float, so their output is computed once and each option only
reruns the model from the layer's block onward: ``measure_logits_naive`` (same signature) reruns the whole
model on a quantized copy, the baseline the tests compare it with.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import time

import torch
from tqdm.auto import tqdm

from ..files import atomic_write, check_output_path, dumps_strict
from ..loading import load_model
from ..tables import load_average
from . import bitrate
from .bitrate import check_options, option_bits
from .pipeline import LAYERS, block_inputs, calibration_tokens, linear_of
from .qlinear import QuantLinear
from .rtn import QuantConfig, rtn_quantize

ERROR = "KL(float || quantized) of the next-token distributions, nats/token, one layer quantized, the rest float"


def _kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> float:
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()


def _tail(model, i: int, h: torch.Tensor, rope, mask) -> torch.Tensor:
    """Log-probabilities after running blocks ``i``.. of ``model`` on their input ``h``."""
    for j in range(i, len(model.layers)):
        h = model.layers[j](h, j, rope, None, mask)
    return torch.log_softmax(model.output(model.norm(h)).float(), dim=-1)


def _check(model, calib: torch.Tensor, options):
    options = check_options(options)
    if model.config.arch != "llama":
        raise ValueError(f"model: the sensitivity measurement supports the llama architecture, not {model.config.arch!r}")
    if calib.ndim != 2 or calib.shape[1] > model.config.max_seq_len:
        raise ValueError(f"calib: need (windows, tokens) ids with windows that fit the model's context of "
                         f"{model.config.max_seq_len}, got shape {tuple(calib.shape)}")
    return options


def _row(name: str, W: torch.Tensor, options, kls: list[float]) -> dict:
    return {"name": name, "out_features": W.shape[0], "in_features": W.shape[1],
            "bits": [option_bits(W.shape[0], W.shape[1], b, g) for b, g in options], "errors": kls}


def _table(options, layers: list[dict], calib: torch.Tensor) -> dict:
    return {"options": [list(o) for o in options], "layers": layers,
            "setup": {"method": "rtn", "error": ERROR, "end_to_end": True, "power": 1.0, "calib_samples": calib.shape[0],
                      "calib_seqlen": calib.shape[1]}}


@torch.no_grad()
def measure_logits(model, calib: torch.Tensor, options, *, progress: bool = True) -> dict:
    """Each (layer, option)'s KL cost on ``calib`` (N, T) ids, every layer quantized alone with round to
    nearest (``QuantConfig(bits, group_size)``; exact dequantize-and-matmul, so the cost is the rounding's).

    Returns a measurement table in ``bitrate.measure``'s layout (``options``, ``layers`` with ``name``,
    ``out_features``, ``in_features``, ``bits`` and ``errors`` = KL per option, ``setup`` with
    ``error`` = ``ERROR``); ``bitrate.optimize`` reads it.

    Raises:
        ValueError: bad options, windows past the context, or not a llama model.
    """
    options = _check(model, calib, options)
    X, rope, mask = block_inputs(model, calib.to(model.device))
    inputs = []
    for i, block in enumerate(model.layers):
        inputs.append(X)
        X = block(X, i, rope, None, mask)
    ref = _tail(model, len(model.layers), X, rope, mask)
    layers = []
    for i, block in enumerate(tqdm(model.layers, desc="measure (KL)", disable=not progress, leave=False)):
        for name in LAYERS:
            lin, parent, attr = linear_of(block, name)
            W = lin.weight.float()
            kls = []
            try:
                for bits, group in options:
                    setattr(parent, attr, QuantLinear(rtn_quantize(W, QuantConfig(bits, group)), lin.bias, fast=False))
                    kls.append(_kl(ref, _tail(model, i, inputs[i], rope, mask)))
            finally:
                setattr(parent, attr, lin)
            layers.append(_row(f"layers.{i}.{name}", W, options, kls))
    return _table(options, layers, calib)


@torch.no_grad()
def measure_logits_naive(model, calib: torch.Tensor, options, *, progress: bool = True) -> dict:
    """``measure_logits`` the direct way: for every (layer, option), a copy of the model with that layer
    quantized, run from the embedding to the logits."""
    options = _check(model, calib, options)
    X, rope, mask = block_inputs(model, calib.to(model.device))
    ref = _tail(model, 0, X, rope, mask)
    layers = []
    for i in tqdm(range(len(model.layers)), desc="measure (KL, naive)", disable=not progress, leave=False):
        for name in LAYERS:
            W = linear_of(model.layers[i], name)[0].weight.float()
            kls = []
            for bits, group in options:
                q = copy.deepcopy(model)
                lin, parent, attr = linear_of(q.layers[i], name)
                setattr(parent, attr, QuantLinear(rtn_quantize(W, QuantConfig(bits, group)), lin.bias, fast=False))
                kls.append(_kl(ref, _tail(q, 0, X, rope, mask)))
            layers.append(_row(f"layers.{i}.{name}", W, options, kls))
    return _table(options, layers, calib)


def bitrate_rows(model, tokenizer, result: dict, budgets, *, options=None, calib_samples: int = 2,
                 calib_seqlen: int = 512, method: str = "rtn", uniform=(), save=None, progress: bool = True) -> dict:
    """notebook 05b's end-to-end rows, added to a ``bench quant --bpw`` ``result``: the KL measurement
    (``measure_logits``, RTN; the result's own ``measurement_kl`` when it has one with these options), for
    every budget the allocation it gives quantized with ``method`` ("rtn", or "gptq" with its range search)
    and scored as the result's other rows (``bitrate.eval_setup`` with the result's protocol), the uniform
    rows of every method in ``uniform`` at every option that the result lacks and some budget affords, and the goal
    (RTN's allocations against uniform RTN, GPTQ's against every uniform row of the result). Returns the result with ``measurement_kl``, ``variable_kl`` (RTN) or
    ``variable_kl_gptq``, and ``goals_kl`` or ``goals_kl_gptq``; ``save(result)`` is called after every row.

    Raises:
        ValueError: a method other than rtn / gptq, or a uniform method not in ``bitrate.UNIFORM_METHODS``.
    """
    if method not in ("rtn", "gptq"):
        raise ValueError(f"method: the allocations are quantized with rtn or gptq, not {method!r}")
    bad = [m for m in uniform if m not in bitrate.UNIFORM_METHODS]
    if bad:
        raise ValueError(f"uniform: {bad} are not among {bitrate.UNIFORM_METHODS}")
    options = options or [tuple(o) for o in result["measurement"]["options"]]
    s = result["setup"]
    result = {**result, "uniform": list(result["uniform"])}
    # an end-to-end measurement already in the result (added before, or the bench's own with --measure kl)
    # is reused when it has these options and calibration
    table = result.get("measurement_kl") or (result["measurement"] if result["measurement"].get("setup", {}).get("end_to_end")
                                             else None)
    if table is None or [tuple(o) for o in table["options"]] != [tuple(o) for o in options] or (
            table["setup"].get("calib_samples"), table["setup"].get("calib_seqlen")) != (calib_samples, calib_seqlen):
        t0 = time.perf_counter()
        table = measure_logits(model, calibration_tokens(tokenizer, calib_samples, calib_seqlen), options,
                               progress=progress)
        table["setup"].update(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                              duration_s=time.perf_counter() - t0, load=load_average())
        result["measurement_kl"] = table
    setup = bitrate.eval_setup(model, tokenizer, max_tokens=s["max_tokens"], seqlen=s["seqlen"],
                               calib_samples=s["calib_samples"], calib_seqlen=s["calib_seqlen"])
    suffix = "" if method == "rtn" else f"_{method}"
    have = {(r["method"], r["bits"], r["group_size"]) for r in result["uniform"]}
    # a uniform option above every budget is never the comparison (its bpw at the model's narrowest input)
    narrowest = min(r["in_features"] for r in table["layers"])
    fits = [o for o in options if QuantConfig(*o).bits_per_weight(narrowest) <= max(budgets) + 1e-9]
    jobs = [("variable", b) for b in budgets] + [(m, o) for m in uniform for o in fits if (m, *o) not in have]
    rows = []
    for kind, arg in tqdm(jobs, desc=f"end-to-end rows ({method})", disable=not progress):
        if kind == "variable":
            rows.append(bitrate.variable_row(model, setup, table, arg, method=method, mse=method == "gptq"))
        else:
            result["uniform"].append(bitrate.uniform_row(model, setup, kind, *arg))
            bench = result["variable"][0].get("quantizer") if result["variable"] else None
            result["goals"] = bitrate.goals(result, ("rtn",) if bench == "rtn" else None)  # the bench's own rows, again
        result[f"variable_kl{suffix}"] = rows
        # RTN's allocations against uniform RTN (the same quantizer); GPTQ's against every uniform method
        result[f"goals_kl{suffix}"] = bitrate.goals({**result, "variable": rows}, ("rtn",) if method == "rtn" else None)
        if save is not None:
            save(result)
    return result


def main(argv=None) -> int:
    """Add end-to-end variable-bitrate rows to a ``bench quant --bpw`` result: the KL measurement
    (``measure_logits``), each budget's allocation quantized with --method and scored like the result's
    rows, and uniform rows of the --uniform methods; written to --out after every row."""
    p = argparse.ArgumentParser(prog="python -m minillm.quant.sensitivity", description=main.__doc__.split("\n\n")[0])
    p.add_argument("--result", required=True, help="a bench quant --bpw result (JSON) to add the end-to-end rows to")
    p.add_argument("--out", required=True, help="where to write the result with them (not --result itself)")
    p.add_argument("--budgets", default="2.5,3,3.5,4,4.5", help="bits per weight, comma-separated (default 2.5,3,3.5,4,4.5)")
    p.add_argument("--method", choices=("rtn", "gptq"), default="rtn",
                   help="how the allocations are quantized (default rtn; gptq: the defaults, with the range search)")
    p.add_argument("--uniform", default="", help=f"methods ({', '.join(bitrate.UNIFORM_METHODS)}) whose uniform rows to add at "
                   "every option the result lacks and some budget affords, comma-separated (default: none)")
    args = p.parse_args(argv)
    try:  # everything that can be refused is refused before the model loads
        budgets = bitrate.parse_budgets(args.budgets)
        uniform = [m.strip() for m in args.uniform.split(",") if m.strip()]
        bad = [m for m in uniform if m not in bitrate.UNIFORM_METHODS]
        if bad:
            raise ValueError(f"uniform: {bad} are not among {', '.join(bitrate.UNIFORM_METHODS)}")
        check_output_path(args.out, "--out", sources=[args.result], suffix=".json")
        try:
            with open(args.result, encoding="utf-8") as f:
                result = json.load(f)
            for b in budgets:  # a budget below the cheapest options fails now, not after the measurement
                bitrate.optimize(result["measurement"], b)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"result: cannot read {args.result!r} as a bench quant --bpw result ({e!r})") from None
    except ValueError as e:
        p.error(str(e))
    model, tokenizer = load_model()

    def save(res):
        with atomic_write(args.out) as tmp:
            tmp.write_text(dumps_strict(res, indent=1) + "\n", encoding="utf-8")

    out = bitrate_rows(model, tokenizer, result, budgets, method=args.method, uniform=uniform, save=save)
    save(out)
    key = "goals_kl" if args.method == "rtn" else f"goals_kl_{args.method}"
    print(f"wrote {args.out}: goal {'met' if out[key]['met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
