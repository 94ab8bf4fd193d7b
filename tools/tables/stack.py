"""The stack's tables, from ``bench stack``'s record (figures/stack.json): the README's short table (each row's
output tokens/s and its gain over row 2) and docs/stack.md's full one (latency, memory, quality, bound,
concurrency; each technique alone and in the stack; the concurrency sweep). ``tools.tables`` rebuilds them."""

from __future__ import annotations

from pathlib import Path

from . import FIGURES, _source, _table, read_record

RECORD = "stack.json"


def _rows(s: dict) -> list[tuple[str, dict]]:
    return [(r.get("label", str(i)), r) for i, r in enumerate(s["rows"], 1)]


def _workload(s: dict) -> str:
    return (f"{s['num_requests']} chat requests at once sharing a system prompt ({s['copy_requests']} copy a passage "
            f"of Hamlet, the rest ask open questions), mean prompt {s['mean_prompt']:.0f} tokens, {s['new_tokens']} new "
            f"tokens each, greedy, EOS ignored; row 1 (no KV cache) on the first {s['naive_requests']} requests, "
            f"compared by its per-token rate; int4: {s['quant_recipe']}, int8 output layer")


def stack_short(folder: Path = FIGURES) -> str:
    """The README's table: each configuration's output tokens/s and its gain over row 2 and over row 1."""
    rec = read_record(RECORD, folder)
    s = rec["report"]
    first = s["rows"][0]["output_tokens_per_s"]
    rows = [[f"{i}. {'' if i in ('1', '6b') else '+ '}{r['name']}", f"{r['output_tokens_per_s']:.1f}", f"{r['over_row2']:.2f}x",
             f"{r['output_tokens_per_s'] / first:.1f}x", f"{r['greedy_equal_share']:.0%}"] for i, r in _rows(s)]
    lines = _table(["configuration (each adds one technique)", "output tokens/s", "over row 2", "over row 1",
                    "greedy tokens equal float's"], ["l", "r", "r", "r", "r"], rows)
    return "\n".join(lines + ["", f"{_workload(s)}; {s['machine']}; {_source(rec)}. Details: "
                              "[docs/stack.md](docs/stack.md)."])


def stack_full(folder: Path = FIGURES) -> str:
    """docs/stack.md's table: every column of every row, the gains alone and in the stack, the sweep."""
    rec = read_record(RECORD, folder)
    s = rec["report"]
    rows = []
    for i, r in _rows(s):
        conc = r.get("max_concurrency_at_tpot_slo")
        rows.append([f"{i}. {r['name']}", f"{r['output_tokens_per_s']:.1f}", f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}",
                     f"{r['tpot_p50_s']:.3f} / {r['tpot_p99_s']:.3f}", f"{r['weight_bytes'] / 1e6:.0f}",
                     f"{r['peak_kv_bytes'] / 1e6:.1f}", f"{r['kl']:.3f} / {r['top1_agreement']:.3f}",
                     f"{r['greedy_equal_share']:.0%}",
                     f"{r['bound_tokens_per_s']:.{0 if r['bound_tokens_per_s'] >= 10 else 1}f}", "-" if conc is None else str(conc)])
    lines = _table(["configuration", "output tok/s", "TTFT p50 / p99 (s)", "TPOT p50 / p99 (s)", "weights MB",
                    "peak KV MB", "KL / top-1", "= float", "bound tok/s", "max concurrency"],
                   ["l", "r", "l", "l", "r", "r", "l", "r", "r", "r"], rows)
    lines += ["", _workload(s) + f". Quality: KL(float || row) in nats/token and top-1 agreement on {s['quality_protocol']}; "
              "= float: the share of greedy tokens equal to row 2's before each request's first difference; bound: the "
              f"output tokens/s that the bytes of one decode step at the row's mean rows per step allow at "
              f"{s['bandwidth_GB_per_s']:.1f} GB/s (measured here); max concurrency: the largest of the sweep below whose "
              f"TPOT p99 is at most 0.1 s.", ""]
    gains = [[name, "-" if g["alone"] is None else f"{g['alone']:.2f}x", "-" if g["in_stack"] is None else f"{g['in_stack']:.2f}x"]
             for name, g in s["gains"].items()]
    lines += _table(["technique", "gain alone (over row 2; KV cache: over row 1)", "gain in the stack (over the row above)"],
                    ["l", "r", "r"], gains)
    sweep = [[name] + [f"{v['output_tokens_per_s']:.0f} ({v['tpot_p99_s']:.3f})" for v in x.values()]
             for name, x in s["sweep"].items()]
    conc = list(next(iter(s["sweep"].values())))
    lines += ["", *_table(["engine row"] + [f"c = {c}: tok/s (TPOT p99 s)" for c in conc], ["l"] + ["r"] * len(conc), sweep)]
    lines += ["", f"The sweep: c requests of the same mix, {s['sweep_tokens']} new tokens each, `max_num_seqs` c. int4 engine "
              "over float engine: " + ", ".join(f"{x:.2f}x at {c}" for c, x in s["int4_over_float_engine"].items())
              + f". Full stack: {s['full_stack_over_row2']:.1f}x row 2, {s['full_stack_over_row1']:.1f}x row 1.", "",
              f"{s['machine']}; {_source(rec)}."]
    return "\n".join(lines)


TABLES = {"stack_short": stack_short, "stack_full": stack_full}
FILES = {"docs/stack.md": ["stack_full"]}
READS = {"stack_short": [RECORD], "stack_full": [RECORD]}
