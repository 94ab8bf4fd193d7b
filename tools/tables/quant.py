"""docs/quantization.md's result tables, rebuilt from the JSON that the quantization benchmarks write.

Those commands write their own reports rather than ``minillm.lab.records`` records (notebooks 05, 05a and 05b
read the same files), so each report carries its provenance itself: ``command``, ``date`` and, where the
command records it, the machine's ``load``. ``tools.tables`` finds these builders through ``TABLES``.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import FIGURES, RecordError, _table, read_json

WRITERS = {"05_quant_table.json": "`python -m minillm bench quant --out figures/05_quant_table.json`",
           "05_kquants.json": "`python -m minillm.lab.kquants --out figures/05_kquants.json`",
           "05b_bitrate.json": "`python -m minillm bench quant --bpw 2.5,3,3.5,4,4.5 --out figures/05b_bitrate.json` "
                               "(its end-to-end rows: `python -m minillm.lab.bitrate_rows --result RESULT.json --out figures/05b_bitrate.json`)",
           "05_gptq_avenues.json": "`python -m minillm bench quant --avenues --out figures/05_gptq_avenues.json`"}
READS = {"quant_table": ["05_quant_table.json"], "kquants": ["05_kquants.json"], "bitrate": ["05b_bitrate.json"],
         "gptq_avenues": ["05_gptq_avenues.json"]}
METHODS = {"rtn": "RTN", "gptq": "GPTQ", "awq": "AWQ", "awq+gptq": "AWQ+GPTQ"}
TIE = 0.05  # perplexity points: GPTQ's results move by a few hundredths between machines


def read_report(name: str, folder: Path = FIGURES) -> dict:
    """The report ``folder/name`` as its command wrote it.

    Raises:
        FileNotFoundError: the JSON is not there (the error names the command that writes it).
        RecordError (a ValueError): it cannot be read (``minillm.lab.records.read_json``: not valid JSON, binary,
            NUL bytes, empty) or is not a JSON object; named with the command that rewrites it.
    """
    rep = read_json(folder / name, WRITERS[name])
    if not isinstance(rep, dict):
        raise RecordError(f"{folder / name}: holds {json.dumps(rep)[:40]}, not a report (a JSON object); rewrite it "
                          f"with {WRITERS[name]}")
    return rep


def _provenance(rep: dict, name: str) -> str:
    command = f"`{rep['command']}`" if rep.get("command") else "command not recorded"
    date = rep.get("date", "date not recorded")
    load = rep.get("load")
    load = f", load average {load:.1f}" if isinstance(load, (int, float)) else (f", load average {load}" if load else "")
    return f"{command}, {date}{load}"


def _group(g: int | None) -> str:
    return "-" if g is None else ("channel" if g <= 0 else str(g))


def recovery(rows: dict, ppl_float: float, bits: int, group: int, method: str = "gptq") -> float:
    """Share of RTN's perplexity increase ``method`` recovers at one setting: (RTN - method) / (RTN - float)."""
    rtn = rows[("rtn", bits, group)]["perplexity"]
    return (rtn - rows[(method, bits, group)]["perplexity"]) / (rtn - ppl_float)


def quant_table(folder: Path = FIGURES) -> str:
    """Every method at every (bits, group size) of ``bench quant``: size, perplexity, KL, decode speed; the goals."""
    rep = read_report("05_quant_table.json", folder)
    f, s = rep["float"], rep["setup"]
    rows = {(r["method"], r["bits"], r["group_size"]): r for r in rep["rows"]}
    out = [["float (dequantized Q4_1)", "32", "-", "32", f"{f['bytes'] / 1e6:.1f}", "100%", f"{f['perplexity']:.2f}", "0",
            f"{f['decode_tokens_per_s']:.1f}"]]
    for r in rep["rows"]:
        out.append([METHODS.get(r["method"], r["method"]), str(r["bits"]), _group(r["group_size"]),
                    f"{r['bits_per_weight']:.2f}", f"{r['bytes'] / 1e6:.1f}", f"{r['size_vs_float32']:.1%}",
                    f"{r['perplexity']:.2f}", f"{r['kl']:.3f}", f"{r['decode_tokens_per_s']:.1f}"])
    lines = _table(["method", "bits", "group", "bpw", "MB", "of float32", "perplexity", "KL", "decode tok/s"],
                   ["l", "r", "r", "r", "r", "r", "r", "r", "r"], out)
    g = s["gptq"]
    lines += ["", f"{rep['machine']}; perplexity on {s['eval_text']} ({s['eval_tokens']:,} tokens scored, windows of "
              f"{s['seqlen']}), KL(float || quantized) in nats/token on the same positions; calibration "
              f"{s['calib_samples']} x {s['calib_seqlen']} tokens of {s['calib_text']}; GPTQ: act-order {g['act_order']}, "
              f"dampening {g['percdamp']:g} of the mean diagonal, range search {g['mse']}; AWQ: grid {s['awq']['grid']}, "
              f"clip search for {s['awq']['clip']}; decode: {s['decode']}. MB is the saved file; bpw = {s['bits_per_weight']}."]
    settings = sorted({(b, gs) for m, b, gs in rows if m == "rtn"}, key=lambda x: (-x[0], x[1] if x[1] > 0 else 999))
    label = lambda b, gs: f"{b}-bit {'per channel' if gs <= 0 else f'group {gs}'}"  # noqa: E731
    goals = []
    rec4 = {gs: recovery(rows, f["perplexity"], 4, gs) for b, gs in settings if b == 4}
    rec3 = {gs: recovery(rows, f["perplexity"], 3, gs) for b, gs in settings if b == 3}
    goals.append("GPTQ recovers " + ", ".join(f"{v:.0%} ({label(4, gs)})" for gs, v in rec4.items())
                 + " of RTN's perplexity increase and "
                 + ", ".join(f"{v:.0%} ({label(3, gs)})" for gs, v in rec3.items()))
    awq = {bg: rows[("rtn", *bg)]["perplexity"] - rows[("awq", *bg)]["perplexity"] for bg in settings}
    goals.append(f"AWQ below RTN in {sum(m >= TIE for m in awq.values())} of {len(awq)} settings")
    if any(m == "awq+gptq" for m, _, _ in rows):
        for gs in sorted(gs for b, gs in settings if b == 3):
            others = min(r["perplexity"] for (m, b, g2), r in rows.items() if b == 3 and g2 == gs and m != "awq+gptq")
            margin = others - rows[("awq+gptq", 3, gs)]["perplexity"]
            verdict = "best" if margin >= TIE else ("a tie with the best (within " f"{TIE})" if margin > -TIE else "not best")
            goals.append(f"AWQ+GPTQ at {label(3, gs)}: {verdict}, margin {margin:+.2f}")
    size4 = max(r["size_vs_float32"] for r in rep["rows"] if r["bits"] == 4)
    goals.append(f"the largest 4-bit file is {size4:.1%} of float32")
    lines += ["", "Measured: " + "; ".join(goals) + "."]
    lines += ["", _provenance(rep, "05_quant_table.json") + "."]
    return "\n".join(lines)


def kquants(folder: Path = FIGURES) -> str:
    """Our Q4_K_M file beside llama.cpp's and the shipped Q4_1: size, perplexity, KL; the byte comparison."""
    rep = read_report("05_kquants.json", folder)
    rows = [[r["label"], f"{r['bytes'] / 1e6:.1f}", f"{r['bits_per_weight']:.3f}", f"{r['perplexity']:.3f}",
             f"{r['kl']:.4f}", f"{r['top1_agreement']:.3f}"] for r in rep["rows"]]
    lines = _table(["file", "MB", "bits/weight", "perplexity", "KL", "top-1 agreement"], ["l", "r", "r", "r", "r", "r"], rows)
    first = rep["rows"][0]
    lines += ["", f"{rep['text'].capitalize()}, the first {rep['max_tokens']:,} tokens in windows of {rep['seqlen']} "
              f"({first['tokens']:,} scored), KL from the shipped model; bits per weight = tensor data bits / parameters."]
    b = rep.get("blocks")
    if b:
        total = sum(b["bytes"].values())
        differ = sum(b["bytes_differing"].values())
        lines += ["", f"Our file against llama.cpp's own quantization of the same weights (llama-cpp-python "
                  f"{rep.get('llama_cpp_version', '?')}): {b['tensors']} tensors, same names {b['same_names']}, same shapes "
                  f"{b['same_shapes']}, {len(b['type_mismatches'])} type mismatches, **{differ:,} of {total:,} tensor bytes "
                  f"differ**."]
    lines += ["", _provenance(rep, "05_kquants.json") + "."]
    return "\n".join(lines)


def bitrate(folder: Path = FIGURES) -> str:
    """Variable bitrate at each budget beside the best uniform setting of no more bits per weight."""
    rep = read_report("05b_bitrate.json", folder)
    s, g = rep["setup"], rep["goals"]
    variable = {v["target_bpw"]: v for v in rep["variable"]}
    rows = []
    for b in g["budgets"]:
        v = variable[b["target_bpw"]]
        u = ("none of no more bpw" if b["uniform"] is None else
             f"{b['uniform']}: {b['uniform_bpw']:.3f}, {b['uniform_ppl']:,.2f}")
        better = "-" if b["better"] is None else ("yes" if b["better"] else "**no**")
        rows.append([f"{b['target_bpw']}", f"{b['variable_bpw']:.3f}, {b['variable_ppl']:,.2f}, {v['kl']:.3f}", u, better])
    quantizer = rep["variable"][0].get("quantizer", "gptq").upper() if rep["variable"] else "?"
    relative = rep["variable"][0].get("relative_to", "output") if rep["variable"] else "?"
    end_to_end = rep["measurement"].get("setup", {}).get("end_to_end", False)
    measured = "KL measurement" if end_to_end else f"errors relative to the block {relative}"
    lines = _table(["budget", f"variable ({quantizer}, {measured}): bpw, perplexity, KL",
                    "best uniform of no more bpw: bpw, perplexity", "variable better"], ["r", "l", "l", "l"], rows)
    uniform = ", ".join(f"{u['method'].upper()} {u['bits']}-bit g{u['group_size']} {u['bpw']:.3f} bpw {u['perplexity']:,.2f}"
                        for u in sorted(rep["uniform"], key=lambda u: u["bpw"]))
    lines += ["", f"Uniform rows measured: {uniform}. Perplexity on {s['eval_text']} ({s['eval_tokens']:,} tokens scored, "
              f"windows of {s['seqlen']}; float {rep['float']['perplexity']:.2f}), KL from the float model; the measurement "
              f"quantized each layer with {rep['measurement']['setup']['method'].upper()}."]
    second = rep.get("variable_relative_to_update") or []
    if second:
        lines += ["", "Errors relative to the block's update instead (`relative_to=\"update\"`): " + "; ".join(
            f"budget {v['target_bpw']}: {v['bpw']:.3f} bpw, perplexity {v['perplexity']:,.2f}" for v in second) + "."]
    lines += ["", f"Against the best uniform setting of no more bits per weight, with the "
              f"{'end-to-end' if end_to_end else 'block-output'} measurement: {_goal(g)}."]
    lines += ["", f"{rep.get('run', _provenance(rep, '05b_bitrate.json'))}."]
    if rep.get("variable_kl"):
        m = rep["measurement_kl"]["setup"]
        lines += ["", "Measured end to end instead (`sensitivity.measure_logits`: each option's KL on the logits, one layer "
                  f"quantized with {m['method'].upper()} at a time, {m['calib_samples']} x {m['calib_seqlen']} calibration "
                  f"tokens; the optimizer sums the costs, power {m['power']:g}), scored the same way:", "",
                  *_kl_rows(rep["goals_kl"], rep["variable_kl"], "RTN"), "",
                  f"With the end-to-end measurement: {_goal(rep['goals_kl'])}. Measurement: {m['date']}, load "
                  f"{m['load']}, {m['duration_s'] / 60:.0f} min."]
    if rep.get("variable_kl_gptq"):
        g = rep["goals_kl_gptq"]
        lines += ["", "The same allocations quantized with GPTQ (the defaults, with the range search) instead, against "
                  "the best uniform row of every method:", "", *_kl_rows(g, rep["variable_kl_gptq"], "GPTQ"), "",
                  f"GPTQ's allocations: {_goal(g)}."]
        if rep.get("gptq_rows_run"):
            lines += ["", f"{rep['gptq_rows_run']}."]
    return "\n".join(lines)


def _kl_rows(goals: dict, variable: list[dict], quantizer: str) -> list[str]:
    kl = {v["target_bpw"]: v for v in variable}
    rows = [[f"{b['target_bpw']}", f"{b['variable_bpw']:.3f}, {b['variable_ppl']:,.2f}, {kl[b['target_bpw']]['kl']:.3f}",
             "none of no more bpw" if b["uniform"] is None else f"{b['uniform']}: {b['uniform_bpw']:.3f}, {b['uniform_ppl']:,.2f}",
             "-" if b["better"] is None else ("yes" if b["better"] else "**no**")] for b in goals["budgets"]]
    return _table(["budget", f"variable ({quantizer}, KL measurement): bpw, perplexity, KL",
                   "best uniform of no more bpw: bpw, perplexity", "variable better"], ["r", "l", "l", "l"], rows)


def _goal(g: dict) -> str:
    against = ", ".join(m.upper() for m in g.get("against", ["rtn"]))
    return (f"variable bitrate strictly better at {g['strictly_better']} of {len(g['budgets'])} budgets, never worse: "
            f"{'yes' if g['never_worse'] else 'no'} (against uniform {against})")


def gptq_avenues(folder: Path = FIGURES) -> str:
    """Each GPTQ avenue's perplexity and recovery on one protocol, in one run, and what the defaults recover."""
    rep = read_report("05_gptq_avenues.json", folder)
    s, fl, rtn = rep["setup"], rep["float"]["perplexity"], rep["rtn"]["perplexity"]
    rows = [[f"`{r['name']}`", r["change"], f"{r['perplexity']:.2f}", f"{r['recovery']:.1%}", r.get("measured", "-")]
            for r in rep["rows"]]
    lines = _table(["avenue", "what changes from the defaults", "perplexity", "recovery", "measured"],
                   ["l", "l", "r", "r", "l"], rows)
    lines += ["", f"GPTQ {s['bits']}-bit group {s['group_size']} on {s['eval_text']} (the first {s['max_tokens']:,} tokens, "
              f"windows of {s['seqlen']}): float {fl:.3f}, RTN {rtn:.3f}; recovery = (RTN - avenue) / (RTN - float); "
              f"calibration from {s['calib_text']}; {rep['machine']}."]
    default = next((r for r in rep["rows"] if r["name"] == "default"), None)
    if default is not None:
        lines += ["", f"The defaults recover {default['recovery']:.1%} of RTN's perplexity increase."]
    if rep.get("note"):
        lines += ["", f"{rep['note'][0].upper()}{rep['note'][1:]}."]
    lines += ["", _provenance(rep, "05_gptq_avenues.json") + "."]
    return "\n".join(lines)


TABLES = {"quant_table": quant_table, "kquants": kquants, "bitrate": bitrate, "gptq_avenues": gptq_avenues}
FILES = {"docs/quantization.md": ["quant_table", "gptq_avenues", "kquants", "bitrate"]}
