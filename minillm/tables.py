"""The README's and docs' result tables, rebuilt from the JSON that the benchmark commands and the
notebooks write (``figures/*.json``), so that a table never drifts from the run that produced it.

    python -m minillm.tables                 rewrite every table between its markers
    python -m minillm.tables --check         exit 1 (and name the table) where a file is out of date
    python -m minillm.tables record OUT -- CMD ...
                                             run ``python -m minillm CMD ... --json`` and keep its report
                                             in OUT with the command, the date and the machine's load

A table lives in a Markdown file between ``<!-- table:NAME -->`` and ``<!-- /table -->``; ``TABLES`` says
which builder fills it from which JSON. Each builder ends its table with the command and date that
produced the JSON, so a reader can tell what was measured when. A record is
``{"command", "date", "load", "report"}``: ``report`` is what the command printed with ``--json``, or
what a notebook measured (``record`` below).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from .files import atomic_write, dumps_strict

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "figures"


# ---------------------------------------------------------------------------------------------- records

def load_average() -> str:
    """The 1/5/15-minute load averages, as ``uptime`` prints them (``"n/a"`` where the OS has none)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def record(report: dict, path: str | os.PathLike, command: str) -> Path:
    """Write ``report`` to ``path`` as a record: the command that measured it, today's UTC date and the
    machine's load average beside it. Notebooks call this with their measurements."""
    rec = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "load": load_average(), "report": report}
    with atomic_write(path) as tmp:
        tmp.write_text(dumps_strict(rec, indent=1) + "\n", encoding="utf-8")
    return Path(path)


def record_command(out: str | os.PathLike, argv: list[str]) -> Path:
    """Run ``python -m minillm ARGV --json`` and record its report in ``out``.

    Raises:
        RuntimeError: the command failed (its exit status and the end of its error output are named).
    """
    argv = [a for a in argv if a != "--json"] + ["--json"]
    proc = subprocess.run([sys.executable, "-m", "minillm", *argv], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m minillm {' '.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return record(json.loads(proc.stdout), out, "python -m minillm " + " ".join(argv))


def read_record(name: str, folder: Path = FIGURES) -> dict:
    """The record ``folder/name``.

    Raises:
        FileNotFoundError: the JSON is not there (the error names the command or notebook that writes it).
        ValueError: it is not valid JSON, or not a record (the error names what rewrites it).
    """
    path = folder / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found; {WRITERS.get(name, 'its benchmark')} writes it")
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); rewrite it with {WRITERS.get(name)}") from None
    if not isinstance(rec, dict) or not {"command", "date", "report"} <= set(rec):
        raise ValueError(f"{path}: not a record (needs command, date, report); rewrite it with {WRITERS.get(name)}")
    return rec


def _source(rec: dict) -> str:
    load = f", load average {rec['load']} (1/5/15 min) when it finished" if rec.get("load") else ""
    return f"`{rec['command']}`, {rec['date']}{load}"


def _table(header: list[str], align: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


MET = {True: "met", False: "**not met**", None: "not measured"}
TRACE_NAMES = {"sharegpt": "ShareGPT", "alpaca": "Alpaca"}


def _trace(name: str) -> str:
    return TRACE_NAMES.get(name, name)


def _first_equal(n: int, total: int, of: str) -> str:
    return f"all {total} greedy tokens equal {of}" if n == total else f"first {n}/{total} greedy tokens equal {of}"


# ---------------------------------------------------------------------------------------------- builders

def headline(folder: Path = FIGURES) -> str:
    """The README's table: each technique against its baseline, each pair from one run: the tour, ``bench
    decode`` (transformers), ``bench decode --peer llamacpp`` (llama.cpp) and ``serve-bench`` (the engine)."""
    tour, bench = read_record("tour.json", folder), read_record("bench_decode.json", folder)
    peer, serve = read_record("bench_decode_llamacpp.json", folder), read_record("serve_bench.json", folder)
    rows = []

    def row(technique, baseline, base, tps, speedup, check, run):
        rows.append([technique, baseline, f"{base:.1f}", f"{tps:.1f}", f"{speedup:.2f}x", check, run])

    for r in tour["report"]["rows"]:
        row(r["technique"], r["baseline"], r["baseline_tokens_per_s"], r["tokens_per_s"], r["speedup"], r["check"],
            "tour")
    res = bench["report"]["results"]
    if "transformers (same GGUF)" in res:
        ours, hf = res["ours cached (contiguous KV)"], res["transformers (same GGUF)"]
        row("KV cache (contiguous)", "transformers on the same GGUF weights", hf["decode_tokens_per_s"],
            ours["decode_tokens_per_s"], res["cached_over_transformers"],
            "greedy tokens identical" if hf["same_tokens_as_cached"] else "tokens differ", "bench decode")
    p = peer["report"]
    best, cpp = p["results"][p["best_ours"]], p["results"]["llama.cpp (same GGUF)"]
    row(p["best_ours"].removeprefix("ours "), "llama.cpp's Q4_1 on the same GGUF", cpp["decode_tokens_per_s"],
        best["decode_tokens_per_s"], p["best_over_llamacpp"],
        _first_equal(best["tokens_equal_to_float"], p["new_tokens"], "float32's")
        + f" (llama.cpp: first {cpp['tokens_equal_to_float']})", "bench decode --peer llamacpp")
    s = serve["report"]
    modes, n = s["modes"], s["num_requests"]
    engine = modes["engine"]
    for name, baseline in (("sequential", "one request at a time"), ("static", f"static batches of {s['max_num_seqs']}"),
                           ("transformers", "transformers' continuous batching")):
        if name in modes:
            row(f"paged engine, continuous batching, {n} requests", baseline, modes[name]["output_tokens_per_s"],
                engine["output_tokens_per_s"], engine["output_tokens_per_s"] / modes[name]["output_tokens_per_s"],
                f"{engine['same_tokens_as_sequential']}/{n} requests' greedy tokens equal one at a time's"
                + ("" if name == "sequential" else f" ({name}: {modes[name]['same_tokens_as_sequential']}/{n})"),
                "serve-bench")
    t, b = tour["report"], bench["report"]
    lines = _table(["technique", "its baseline", "baseline tokens/s", "tokens/s", "speedup", "check", "run"],
                   ["l", "l", "r", "r", "r", "l", "l"], rows)
    # sessions run on different CPUs: one machine line when every run shares it, else each run names its own
    one_machine = len({r["machine"] for r in (t, b, p, s)}) == 1
    where = (lambda r: "") if one_machine else (lambda r: f"{r['machine']}; ")
    lines += ["", (f"{t['machine']}, " if one_machine else "") + f"{t['dtype']}, greedy. Each row's two numbers come "
              "from one run (the runs below" + ("" if one_machine else ", each on the machine it names")
              + "); the machine's bandwidth moves from minute to minute, so compare within a row.", "",
              f"* tour: batch 1, {t['prompt_tokens']}-token prompt, {t['new_tokens']} new tokens; {where(t)}"
              f"{_source(tour)}",
              f"* bench decode: batch 1, {b['prompt_tokens']}-token prompt, {b['new_tokens']} new tokens, median of "
              f"{b['repeats']}; {where(b)}{_source(bench)}",
              f"* bench decode --peer llamacpp: {p['threads']} threads each, {p['new_tokens']} new tokens, the median "
              f"of {p['repeats']} interleaved repeats; speedup = median of the per-repeat ratios; {where(p)}"
              f"{_source(peer)}",
              f"* serve-bench: {n} requests at once, {_trace(s['trace'])}-like lengths x {s['scale']}, output tokens/s "
              f"over the wall time; {where(s)}{_source(serve)}"]
    return "\n".join(lines)


def kv_cache(folder: Path = FIGURES) -> str:
    """docs/kv_cache.md's table, from notebook 02's record."""
    rec = read_record("02_kv_cache.json", folder)
    r = rec["report"]
    steps, first, last = r["step_ms"], str(min(r["positions"])), str(max(r["positions"]))
    step = "; ".join(f"{path} {steps[path][first]:.1f} → {steps[path][last]:.1f} ms" for path in steps)
    total = ", ".join(f"{path} {s:.1f} s" for path, s in r["total_s"].items())
    kib = r["kv_kib_per_token"]
    rows = [[f"step time, position {first} → {last}", step],
            [f"{r['new_tokens']} new tokens after a {r['prompt_tokens']}-token prompt (sums of the step-time fits)",
             f"{total}: static cache **{r['total_s']['none'] / r['total_s']['contiguous']:.1f}x** faster than recomputing"],
            ["KV bytes per token", f"float32 {kib['float32']:.1f} KiB, float16 {kib['float16']:.1f} KiB, int8 + scales "
             f"{kib['int8']:.1f} KiB ({100 * kib['int8'] / kib['float16']:.0f}% of float16); with 9 KV heads instead of 3: "
             f"{kib['mha_float32']:.1f} KiB in float32"],
            [f"int8 KV step time at position {r['int8_step']['position']}",
             f"float32 cache {r['int8_step']['float32_ms']:.1f} ms, int8 cache {r['int8_step']['int8_ms']:.1f} ms "
             f"({r['int8_step']['int8_ms'] / r['int8_step']['float32_ms']:.2f}x)"],
            [f"int8 KV perplexity ({r['perplexity']['play']}, {r['perplexity']['tokens']:,} tokens, "
             f"{r['perplexity']['seqlen']}-token windows)",
             f"{r['perplexity']['float32']:.2f} → {r['perplexity']['int8']:.2f} "
             f"({100 * (r['perplexity']['int8'] / r['perplexity']['float32'] - 1):+.2f}%)"]]
    lines = _table(["notebook 02", "this run"], ["l", "l"], rows)
    lines += ["", f"{r['machine']}, float32, batch 1, greedy; {_source(rec)}."]
    return "\n".join(lines)


def roofline(folder: Path = FIGURES) -> str:
    """docs/roofline.md's tables, from notebook 01's record: predicted vs measured per forward with the
    ceilings that bounded them, the linear layouts against their read ceiling, float16 / bfloat16, and
    compiled decode against its bound."""
    rec = read_record("01_roofline.json", folder)
    r = rec["report"]

    def forward(row, label):
        return [label, f"{row['intensity']:.1f}", row["bound"], f"{row['predicted_tokens_per_s']:.1f}",
                f"{row['measured_tokens_per_s']:.1f}", f"{row['measured_over_predicted']:.2f}"]

    head = ["FLOP/byte", "bound", "predicted tokens/s", "measured tokens/s", "measured / predicted time"]
    rows = [forward(row, f"{row['kind']} " + (f"B={row['batch_size']}" if row["kind"] == "decode" else f"T={row['tokens']}"))
            for row in r["rows"]]
    c = r["ceilings"]
    lines = _table(["forward (float32)", *head], ["l", "r", "l", "r", "r", "r"], rows)
    lines += ["", f"Ceilings measured right before these rows: streaming read {c['read_GB_per_s']:.1f} GB/s, "
              f"copy {c['copy_GB_per_s']:.1f} GB/s (the roofline's bandwidth is the larger, "
              f"{max(c['read_GB_per_s'], c['copy_GB_per_s']):.1f} GB/s), float32 matmul "
              f"{c['matmul_float32_GFLOP_per_s']:.0f} GFLOP/s."]
    layouts = r.get("linear_layouts_GB_per_s")
    if layouts:
        sizes = list(layouts)
        names = list(layouts[sizes[0]])
        lines += ["", *_table(["the model's linear weights, read as", *(f"{s} row{'s' * (s != '1')}, GB/s" for s in sizes)],
                              ["l", *"r" * len(sizes)],
                              [[name, *(f"{layouts[s][name]:.1f}" for s in sizes)] for name in names]),
                  "", f"Ceiling (the larger of a streaming copy and read) measured right before these rows: "
                  f"{r['linear_layouts_read_GB_per_s']:.1f} GB/s. "
                  + "Fastest: " + "; ".join(f"at {s} row{'s' * (s != '1')} `{max(layouts[s], key=layouts[s].get)}`"
                              for s in sizes) + "."
                  + "".join(f" Above the ceiling at {s} row{'s' * (s != '1')}: {', '.join(f'`{k}`' for k in above)}."
                            for s in sizes
                            if (above := [k for k, v in layouts[s].items() if v > r["linear_layouts_read_GB_per_s"]]))]
    half = r.get("half")
    if half:
        base = half.get("float32", {}).get("measured_tokens_per_s")
        vs = [f"{dtype} decode {row['measured_tokens_per_s'] / base:.2f}x float32's tokens/s ({row['bound']}-bound at "
              f"these ceilings)" for dtype, row in half.items() if dtype != "float32" and base]
        lines += ["", *_table(["decode B=1", *head], ["l", "r", "l", "r", "r", "r"],
                              [forward(row, dtype) for dtype, row in half.items()]),
                  "", "With their own ceilings, measured right before these rows." + (" " + "; ".join(vs) + "." if vs else "")]
    comp = r.get("compiled")
    if comp:
        bound = comp["bound_tokens_per_s"]
        lines += ["", *_table(["batch-1 decode, float32", "tokens/s", "share of the bound"], ["l", "r", "r"], [
            ["bound (model bytes / the ceiling)", f"{bound:.1f}", "100%"],
            ["plain read of the model's own weight tensors", f"{comp['weight_read_tokens_per_s']:.1f}",
             f"{comp['weight_read_tokens_per_s'] / bound:.0%}"],
            ["compiled (`compile_decode`)", f"{comp['compiled_tokens_per_s']:.1f}",
             f"{comp['compiled_tokens_per_s'] / bound:.0%}"],
            ["eager", f"{comp['eager_tokens_per_s']:.1f}", f"{comp['eager_tokens_per_s'] / bound:.0%}"]]),
            "", f"The notebook's median compiled-decode round, with its own ceiling (the larger of copy and read) "
            f"measured right before it: {comp['read_GB_per_s']:.1f} GB/s."]
        share = comp["compiled_tokens_per_s"] / bound
        eager = next(row for row in r["rows"] if row["kind"] == "decode" and row["batch_size"] == 1)
        lines += ["", f"Goals: batch-1 decode within 25% of the prediction: eager {eager['measured_over_predicted']:.2f}x "
                  f"the predicted time ({MET[eager['measured_over_predicted'] <= 1.25]}), compiled {1 / share:.2f}x "
                  f"({MET[1 / share <= 1.25]}); at least 75% of the bound: compiled {share:.0%} ({MET[share >= 0.75]})."]
    lines += ["", f"{r['machine']}, batch 1 unless stated; {_source(rec)}."]
    return "\n".join(lines)


def decode(folder: Path = FIGURES) -> str:
    """docs/decode.md's table: batch-1 decode tokens/s of each path, from ``bench decode``'s record."""
    rec = read_record("bench_decode.json", folder)
    b = rec["report"]
    rows = [[name, f"{r['decode_tokens_per_s']:.1f}", f"{r['prefill_s']:.3f}", f"{r['achieved_GB_per_s']:.1f}",
             "yes" if r["same_tokens_as_cached"] else "**no**"]
            for name, r in b["results"].items() if isinstance(r, dict)]
    lines = _table(["path", "decode tokens/s", "prefill s", "achieved GB/s", "same greedy tokens as contiguous"],
                   ["l", "r", "r", "r", "l"], rows)
    ratio = b["results"].get("cached_over_transformers")
    lines += ["", f"{b['prompt_tokens']}-token prompt, {b['new_tokens']} new tokens, median of {b['repeats']} runs after a "
              f"warm-up; achieved GB/s = the weights one step reads ({b['weight_bytes'] / 1e6:.1f} MB) x tokens/s."
              + (f" Contiguous cache / transformers: **{ratio:.2f}x** (goal 1.5x: {MET[ratio >= 1.5]})." if ratio else ""),
              "", f"{b['machine']}, {b['dtype']}, batch {b['batch_size']}, greedy; {_source(rec)}."]
    return "\n".join(lines)


def decode_llamacpp(folder: Path = FIGURES) -> str:
    """docs/decode.md's table of minillm's 4-bit paths beside llama.cpp, from ``bench decode --peer llamacpp``."""
    rec = read_record("bench_decode_llamacpp.json", folder)
    p = rec["report"]
    res, n = p["results"], p["new_tokens"]
    rows = [[name, f"{r['decode_tokens_per_s']:.1f}", ", ".join(f"{x:.1f}" for x in r["runs"]),
             f"{r['bytes_per_token'] / 1e6:.1f}", f"{r['achieved_GB_per_s']:.1f}", f"{r['share_of_bound']:.0%}",
             f"{r['tokens_equal_to_float']}/{n}"] for name, r in res.items()]
    lines = _table(["path", "tokens/s (median)", "each repeat", "MB read per token", "GB/s", "of the bound",
                    "first greedy tokens = float32's"], ["l", "r", "l", "r", "r", "r", "r"], rows)
    bw = p["bandwidth"]
    per = ", ".join(f"{x:.2f}" for x in p["best_over_llamacpp_per_repeat"])
    ahead = sum(x >= 1 for x in p["best_over_llamacpp_per_repeat"])
    lines += ["", f"Best 4-bit path ({p['best_ours']}) / llama.cpp: **{p['best_over_llamacpp']:.2f}x**, the median of "
              f"the per-repeat ratios ({per}: ahead in {ahead} of {len(p['best_over_llamacpp_per_repeat'])}). "
              f"Goal: at least as fast as llama.cpp in the same run: {MET[p['best_over_llamacpp'] >= 1]}. "
              f"The bound: {bw['ceiling'] / 1e9:.1f} GB/s (streaming 512 MB: {bw['before'] / 1e9:.1f} before the decode "
              f"runs, {bw['after'] / 1e9:.1f} after)."]
    tps = {name: r["decode_tokens_per_s"] for name, r in res.items()}
    fp, body = "ours float32 (cached, eager)", "ours int4 (RTN g64), float head"
    head = next((k for k in res if k.startswith("ours int4") and k not in (body,) and not k.endswith(", compiled")), None)
    comp = next((k for k in res if k.endswith(", compiled")), None)
    steps = []
    if fp in tps and body in tps:
        steps.append(f"the 4-bit blocks {tps[body] / tps[fp]:.2f}x the float32 step")
    if head and body in tps:
        steps.append(f"quantizing the output layer ({head.split(', ')[-1]}) {tps[head] / tps[body]:.2f}x eager")
    if comp:
        eager = comp.removesuffix(", compiled")
        steps.append(f"compiling {tps[comp] / tps[eager]:.2f}x its eager twin (whose greedy tokens it keeps for the first "
                     f"{res[comp]['tokens_equal_to_eager']})")
    if steps:
        lines += ["", "What each step bought in this run: " + "; ".join(steps) + "."]
    lines += ["", f"{p['machine']}, {p['threads']} threads for both, batch 1, {p['prompt_tokens']}-token prompt, {n} new "
              f"tokens, greedy, {p['repeats']} interleaved repeats after a warm-up each; {_source(rec)}."]
    return "\n".join(lines)


SERVE_MODES = {"engine": "the engine (continuous batching)", "static": "static batches (`generate_batch`, {b} at a time)",
               "sequential": "one at a time (`generate_cached`)",
               "transformers": "transformers' continuous batching (paged\\|sdpa)"}


def serve_bench(folder: Path = FIGURES) -> str:
    """docs/paged.md's continuous-batching table, memory, sharing and goals, from ``serve-bench``'s record."""
    rec = read_record("serve_bench.json", folder)
    s = rec["report"]
    n = s["num_requests"]
    rows = [[SERVE_MODES.get(name, name).format(b=s["max_num_seqs"]), f"{m['output_tokens_per_s']:.1f}",
             f"{m['total_tokens_per_s']:.1f}", f"{m['ttft_p50_s']:.2f} / {m['ttft_p99_s']:.2f}",
             f"{m['tpot_p50_s']:.3f} / {m['tpot_p99_s']:.3f}", f"{m['wall_s']:.1f}", f"{m['same_tokens_as_sequential']}/{n}"]
            for name, m in s["modes"].items()]
    lines = _table(["mode", "output tokens/s", "total tokens/s", "TTFT p50 / p99 (s)", "TPOT p50 / p99 (s)", "wall s",
                    "same greedy tokens as one at a time"], ["l", "r", "r", "l", "l", "r", "l"], rows)
    e = s["modes"]["engine"]
    lines += ["", f"{n} requests with {_trace(s['trace'])}-like lengths x {s['scale']} (mean prompt "
              f"{s['mean_prompt']:.0f}, output {s['mean_output']:.0f} tokens), all arriving at once, greedy, EOS ignored; "
              f"block size {s['block_size']}, `max_num_seqs` {s['max_num_seqs']}, {s['max_num_batched_tokens']} tokens per step.", "",
              f"The engine's KV memory: peak {e['peak_blocks']} and mean {e['mean_blocks']:.1f} of {e['num_blocks']} "
              "blocks, "
              f"{e['preemptions']} preemptions, prefix hit rate {e['prefix_hit_rate']:.1%}, {e['steps']} steps; "
              f"{e['kv_utilization']:.1%} of the slots of used blocks hold tokens (the lab predicts "
              f"{e['lab_kv_utilization']:.1%} for these lengths)."]
    if "memory" in s:
        x = s["memory"]
        lines[-1] += (f" At the trace's full lengths ({x['num_requests']} requests, mean {x['mean_prompt']:.0f} / "
                      f"{x['mean_output']:.0f} tokens, a tiny random model): {x['kv_utilization']:.1%} (lab "
                      f"{x['lab_kv_utilization']:.1%}; the paper: {s['paper']['kv_utilization']:.1%}).")
    if "linear_s" in e:
        lines += ["", f"The engine's steps in the linear layers alone (each step's token count through the blocks' "
                  f"layers and its sampled rows through the output layer, timed apart): {e['linear_s']:.1f} of its "
                  f"{e['wall_s']:.1f} s; were the rest of each step free, {e['linear_only_tokens_per_s']:.0f} output "
                  "tokens/s."]
    if "sharing" in s:
        x = s["sharing"]
        lines += ["", f"Sharing saves {x['parallel_sampling']:.1%} of KV blocks for n = {x['width']} parallel samples "
                  f"(paper: {s['paper']['parallel_sampling_saved']}) and {x['beam_search']:.1%} for beam width "
                  f"{x['width']} (paper: {s['paper']['beam_search_saved']}), on the first {x['num_requests']} requests."]
    words = {"engine_vs_sequential": "engine / one at a time", "engine_vs_static": "engine / static batches",
             "engine_vs_transformers": "engine / transformers", "kv_utilization": "kv_utilization at full lengths",
             "kv_vs_lab_points": "kv_utilization's distance from the lab's prediction"}
    units = {"kv_utilization": ("{:.1%}", "{:.0%}"), "kv_vs_lab_points": ("{:.2f} points", "at most {} points")}
    goals = []
    for k, g in s["goals"].items():
        value, goal = units.get(k, ("{:.2f}x", "{}x"))
        goals.append(f"{words.get(k, k)}: not measured" if g["measured"] is None else
                     f"{words.get(k, k)} {value.format(g['measured'])} (goal {goal.format(g['goal'])}: {MET[g['held']]})")
    lines += ["", "Goals: " + "; ".join(goals) + ".", "", f"{s['machine']}, {s['dtype']}; {_source(rec)}."]
    return "\n".join(lines)


def paged_decode(folder: Path = FIGURES) -> str:
    """docs/paged.md's batch-1 line: the paged KV cache against the contiguous one, from ``bench decode``."""
    rec = read_record("bench_decode.json", folder)
    b = rec["report"]
    res = b["results"]
    cont, paged = res["ours cached (contiguous KV)"], res["ours paged KV (block_size 16)"]
    slower = 1 - paged["decode_tokens_per_s"] / cont["decode_tokens_per_s"]
    lines = _table(["batch-1 decode", "tokens/s", "same greedy tokens"], ["l", "r", "l"], [
        ["contiguous KV cache (`generate_cached`)", f"{cont['decode_tokens_per_s']:.1f}", "-"],
        ["paged KV cache, block size 16 (`minillm.paged.generate_paged`)", f"{paged['decode_tokens_per_s']:.1f}",
         "yes" if paged["same_tokens_as_cached"] else "**no**"]])
    lines += ["", f"Paged is {abs(slower):.1%} {'slower' if slower >= 0 else 'faster'} (goal: at most 10% slower: "
              f"{MET[slower <= 0.10]}). {b['prompt_tokens']}-token prompt, {b['new_tokens']} new tokens, median of "
              f"{b['repeats']}; {b['machine']}; {_source(rec)}."]
    return "\n".join(lines)


def fragmentation(folder: Path = FIGURES) -> str:
    """docs/paged.md's fragmentation table, from the lab's record (``fragmentation --json``)."""
    rec = read_record("fragmentation.json", folder)
    f = rec["report"]
    traces = f["traces"]
    names = {"max": 'reserve max_seq_len ("Orca Max")', "pow2": 'reserve the next power of two ("Pow2")',
             "oracle": 'reserve the final length ("Oracle")', "paged_16": "paging, block size 16"}

    def cells(scheme, bold=False):
        return [f"**{t['schemes'][scheme]:.1%}**" if bold else f"{t['schemes'][scheme]:.1%}" for t in traces.values()]

    rows = [[label, *cells(s, s == "paged_16"), f"{f['paper'][s]:.1%}" if s in f["paper"] else "",
             f"{f['paper_without_external'][s]:.1%}" if s in f["paper_without_external"] else ""]
            for s, label in names.items()]
    others = [bs for bs in f["block_sizes"] if bs != 16 and f"paged_{bs}" in next(iter(traces.values()))["schemes"]]
    rows.append(["paging, block size " + " / ".join(map(str, others)),
                 *(" / ".join(f"{100 * t['schemes'][f'paged_{bs}']:.1f}" for bs in others) + "%" for t in traces.values()),
                 "", ""])
    lines = _table(["scheme", *(f"{_trace(name)}-like" for name in traces), "paper, Fig. 2",
                    "paper without external fragmentation"],
                   ["l", *"r" * len(traces), "r", "r"], rows)
    lines += [""] + [f"{_trace(name)}-like: {t['num_requests']:,} requests, mean prompt {t['mean_prompt']:.1f}, "
                     f"mean output {t['mean_output']:.1f} tokens ({t['distribution']})." for name, t in traces.items()]
    if "sharegpt" in traces:
        waste = 1 - traces["sharegpt"]["schemes"]["paged_16"]
        gap = [abs(traces["sharegpt"]["schemes"][s] - x) for s, x in f["paper_without_external"].items()]
        lines += ["", f"Paging wastes {waste:.1%} at block size 16 on the ShareGPT-like trace (goal: under 4%: "
                  f"{MET[waste < 0.04]})."]
        if gap:
            lines[-1] += (f" The reservation rows on that trace lie within {100 * max(gap):.1f} points of the paper's "
                          "without external fragmentation.")
    lines += ["", f"The measure: {f['measure']}; {_source(rec)}."]
    return "\n".join(lines)


def speculative(folder: Path = FIGURES) -> str:
    """docs/speculative.md's tables, from notebook 04's record: the seven workloads at gamma 4, predicted
    and measured, and the gamma sweep's best gamma."""
    rec = read_record("04_speculative.json", folder)
    r = rec["report"]
    rows = [[w["workload"], str(w["new_tokens"]), f"{w['plain_tokens_per_s']:.1f}", f"{w['spec_tokens_per_s']:.1f}",
             f"{w['alpha']:.2f}", f"{w['passes_without_draft']:.0%}", f"{w['tokens_per_target_pass']:.2f}",
             f"{w['leviathan_speedup']:.2f}x", f"{w['leviathan_speedup_with_verify_cost']:.2f}x",
             f"{w['predicted_speedup_alpha']:.2f}x", f"{w['predicted_speedup']:.2f}x",
             f"**{w['measured_speedup']:.2f}x**" if w["measured_speedup"] >= 2 else f"{w['measured_speedup']:.2f}x",
             "yes" if w["same_tokens"] else "**no**"] for w in r["rows"]]
    lines = _table(["workload", "tokens", "plain tok/s", "spec tok/s", "alpha", "passes without a draft", "tokens / pass",
                    "Leviathan", "+ verify cost", "+ each pass's k", "predicted", "measured", "same greedy tokens"],
                   ["l", *"r" * 11, "l"], rows)
    v = r["verify_steps"]
    errors = [w["measured_speedup"] / w["predicted_speedup"] - 1 for w in r["rows"]]
    lines += ["", f"gamma {r['num_speculative_tokens']}, {r['proposer']} drafts (c = 0), up to {r['new_tokens']} new tokens "
              f"(stop at EOS), each path timed once per workload. One verify measurement serves every prediction: "
              + ", ".join(f"verify({k}) = {v[k]:.2f}" for k in ("5", "17", "33") if k in v)
              + f" decode steps. Measured / predicted: {100 * min(errors):+.0f}% to {100 * max(errors):+.0f}%."]
    sweep = r.get("sweep")
    if sweep:
        srows = []
        for name, best in sweep["best"].items():
            mine = {str(x["gamma"]): x for x in sweep["rows"] if x["workload"] == name}
            last = str(sweep["gammas"][-1])
            bp, bm = mine[str(best["predicted"])], mine[str(best["measured"])]
            tokens = next((str(w["new_tokens"]) for w in r["rows"] if w["workload"] == name), "")
            srows.append([name, tokens, f"{best['predicted']} ({bp['predicted_speedup']:.2f}x)",
                          f"{best['measured']} ({bm['measured_speedup']:.2f}x)",
                          f"{bp['tokens_per_target_pass']:.2f}", f"{mine[last]['predicted_speedup']:.2f}x / "
                          f"{mine[last]['measured_speedup']:.2f}x, {mine[last]['tokens_per_target_pass']:.2f}"])
        lines += ["", *_table(["workload", "answer tokens", "best gamma, predicted", "best gamma, measured",
                               "tokens / pass at the predicted best",
                               f"at gamma {sweep['gammas'][-1]}: predicted / measured, tokens / pass"],
                              ["l", "r", "r", "r", "r", "r"], srows),
                  "", f"The sweep: gamma {', '.join(map(str, sweep['gammas']))}, median of {sweep['repeats']} runs, the "
                  f"same verify measurement."]
    lines += ["", f"{r['machine']}, {r['dtype']}, batch 1, greedy; {_source(rec)}."]
    return "\n".join(lines)


# which builder fills which table, and which files hold it (each checked by tests/test_tables.py)
TABLES = {"headline": headline, "kv_cache": kv_cache, "roofline": roofline, "decode": decode,
          "decode_llamacpp": decode_llamacpp, "serve_bench": serve_bench, "paged_decode": paged_decode,
          "fragmentation": fragmentation, "speculative": speculative}
FILES = {"README.md": ["headline"], "docs/kv_cache.md": ["kv_cache"], "docs/roofline.md": ["roofline"],
         "docs/decode.md": ["decode", "decode_llamacpp"], "docs/paged.md": ["fragmentation", "paged_decode", "serve_bench"],
         "docs/speculative.md": ["speculative"]}
WRITERS = {name: f"`python -m minillm.tables record figures/{name} -- {cmd}`" for name, cmd in (
    ("tour.json", "tour"), ("bench_decode.json", "bench decode"),
    ("bench_decode_llamacpp.json", "bench decode --peer llamacpp"), ("serve_bench.json", "serve-bench --peer"),
    ("fragmentation.json", "fragmentation"))}
# the records each table reads (what to re-record when one is stale)
READS = {"headline": ["tour.json", "bench_decode.json", "bench_decode_llamacpp.json", "serve_bench.json"],
         "kv_cache": ["02_kv_cache.json"], "roofline": ["01_roofline.json"], "decode": ["bench_decode.json"],
         "decode_llamacpp": ["bench_decode_llamacpp.json"], "serve_bench": ["serve_bench.json"],
         "paged_decode": ["bench_decode.json"], "fragmentation": ["fragmentation.json"],
         "speculative": ["04_speculative.json"]}
WRITERS.update({"02_kv_cache.json": "notebooks/02_kv_cache.ipynb", "01_roofline.json": "notebooks/01_roofline.ipynb",
                "04_speculative.json": "notebooks/04_speculative_decoding.ipynb"})

MARKER = re.compile(r"(<!-- table:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def rebuild_text(text: str, folder: Path = FIGURES, where: str = "") -> str:
    """``text`` with every marked table rebuilt from the JSON in ``folder``.

    Raises:
        KeyError: a marker names a table that ``TABLES`` does not know.
        ValueError: a record lacks a key its table needs (written by another version of its command).
    """
    from . import tables_quant  # its builders read the reports of the quantization commands

    builders, reads = {**TABLES, **tables_quant.TABLES}, {**READS, **tables_quant.READS}
    writers = {**WRITERS, **tables_quant.WRITERS}

    def fill(m: re.Match) -> str:
        name = m["name"]
        if name not in builders:
            raise KeyError(f"{where}: <!-- table:{name} --> names no table; known: {', '.join(builders)}")
        try:
            table = builders[name](folder)
        except KeyError as e:
            raise ValueError(f"{where}: table {name}: a record it reads lacks the key {e}; re-record it with the "
                             f"command that writes it ({'; '.join(writers[r] for r in reads[name])})") from None
        return m.group(1) + table + "\n" + m.group(4)
    return MARKER.sub(fill, text)


def rebuild(root: Path = ROOT, folder: Path | None = None, check: bool = False) -> list[str]:
    """Rebuild the tables in ``FILES`` under ``root``; returns the files that changed (with ``check``,
    the files that would change, untouched)."""
    from . import tables_quant  # docs/quantization.md, from the quantization commands' reports

    folder = folder or root / "figures"
    changed = []
    for rel in {**FILES, **tables_quant.FILES}:
        path = root / rel
        old = path.read_text(encoding="utf-8")
        new = rebuild_text(old, folder, rel)
        if new != old:
            changed.append(rel)
            if not check:
                with atomic_write(path) as tmp:
                    tmp.write_text(new, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        if len(argv) < 4 or argv[2] != "--":
            print("usage: python -m minillm.tables record OUT.json -- COMMAND [ARGS...]", file=sys.stderr)
            return 2
        print(record_command(argv[1], argv[3:]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m minillm.tables", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is out of date")
    args = parser.parse_args(argv)
    changed = rebuild(check=args.check)
    for rel in changed:
        print(f"{rel}: {'out of date' if args.check else 'rebuilt'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
