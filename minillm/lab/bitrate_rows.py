"""Notebook 05b's end-to-end rows, added to a ``bench quant --bpw`` result (``minillm.lab.bitrate``): the KL
measurement of ``minillm.quant.sensitivity.measure_logits``, for every budget the allocation it gives
quantized (RTN, or GPTQ with its range search) and scored like the result's other rows, uniform rows the
result lacks, and the goal against them.

    python -m minillm.lab.bitrate_rows --result RESULT.json --out figures/05b_bitrate.json [--method gptq]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

from tqdm.auto import tqdm

from ..files import atomic_write, check_output_path, dumps_strict
from ..loading import load_model
from ..quant.bitrate import optimize
from ..quant.pipeline import calibration_tokens
from ..quant.rtn import QuantConfig
from ..quant.sensitivity import measure_logits
from .bitrate import UNIFORM_METHODS, eval_setup, goals, parse_budgets, uniform_row, variable_row
from .records import load_average


def bitrate_rows(model, tokenizer, result: dict, budgets, *, options=None, calib_samples: int = 2,
                 calib_seqlen: int = 512, method: str = "rtn", uniform=(), save=None, progress: bool = True) -> dict:
    """notebook 05b's end-to-end rows, added to a ``bench quant --bpw`` ``result``: the KL measurement
    (``measure_logits``, RTN; the result's own ``measurement_kl`` when it has one with these options), for
    every budget the allocation it gives quantized with ``method`` ("rtn", or "gptq" with its range search)
    and scored as the result's other rows (``eval_setup`` with the result's protocol), the uniform
    rows of every method in ``uniform`` at every option that the result lacks and some budget affords, and the goal
    (RTN's allocations against uniform RTN, GPTQ's against every uniform row of the result). Returns the result with ``measurement_kl``, ``variable_kl`` (RTN) or
    ``variable_kl_gptq``, and ``goals_kl`` or ``goals_kl_gptq``; ``save(result)`` is called after every row.

    Raises:
        ValueError: a method other than rtn / gptq, or a uniform method not in ``UNIFORM_METHODS``.
    """
    if method not in ("rtn", "gptq"):
        raise ValueError(f"method: the allocations are quantized with rtn or gptq, not {method!r}")
    bad = [m for m in uniform if m not in UNIFORM_METHODS]
    if bad:
        raise ValueError(f"uniform: {bad} are not among {UNIFORM_METHODS}")
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
    setup = eval_setup(model, tokenizer, max_tokens=s["max_tokens"], seqlen=s["seqlen"],
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
            rows.append(variable_row(model, setup, table, arg, method=method, mse=method == "gptq"))
        else:
            result["uniform"].append(uniform_row(model, setup, kind, *arg))
            bench = result["variable"][0].get("quantizer") if result["variable"] else None
            result["goals"] = goals(result, ("rtn",) if bench == "rtn" else None)  # the bench's own rows, again
        result[f"variable_kl{suffix}"] = rows
        # RTN's allocations against uniform RTN (the same quantizer); GPTQ's against every uniform method
        result[f"goals_kl{suffix}"] = goals({**result, "variable": rows}, ("rtn",) if method == "rtn" else None)
        if save is not None:
            save(result)
    return result


def main(argv=None) -> int:
    """Add end-to-end variable-bitrate rows to a ``bench quant --bpw`` result: the KL measurement
    (``measure_logits``), each budget's allocation quantized with --method and scored like the result's
    rows, and uniform rows of the --uniform methods; written to --out after every row."""
    p = argparse.ArgumentParser(prog="python -m minillm.lab.bitrate_rows", description=main.__doc__.split("\n\n")[0])
    p.add_argument("--result", required=True, help="a bench quant --bpw result (JSON) to add the end-to-end rows to")
    p.add_argument("--out", required=True, help="where to write the result with them (not --result itself)")
    p.add_argument("--budgets", default="2.5,3,3.5,4,4.5", help="bits per weight, comma-separated (default 2.5,3,3.5,4,4.5)")
    p.add_argument("--method", choices=("rtn", "gptq"), default="rtn",
                   help="how the allocations are quantized (default rtn; gptq: the defaults, with the range search)")
    p.add_argument("--uniform", default="", help=f"methods ({', '.join(UNIFORM_METHODS)}) whose uniform rows to add at "
                   "every option the result lacks and some budget affords, comma-separated (default: none)")
    args = p.parse_args(argv)
    try:  # everything that can be refused is refused before the model loads
        budgets = parse_budgets(args.budgets)
        uniform = [m.strip() for m in args.uniform.split(",") if m.strip()]
        bad = [m for m in uniform if m not in UNIFORM_METHODS]
        if bad:
            raise ValueError(f"uniform: {bad} are not among {', '.join(UNIFORM_METHODS)}")
        check_output_path(args.out, "--out", sources=[args.result], suffix=".json")
        try:
            with open(args.result, encoding="utf-8") as f:
                result = json.load(f)
            for b in budgets:  # a budget below the cheapest options fails now, not after the measurement
                optimize(result["measurement"], b)
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
