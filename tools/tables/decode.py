"""The decode tables: docs/kv_cache.md (notebook 02), docs/roofline.md (notebook 01), docs/decode.md
(``bench decode``, ``bench decode --peer llamacpp``) and docs/speculative.md (notebook 04), each from its record
(``tools.tables`` says how tables are rebuilt)."""

from __future__ import annotations

from pathlib import Path

from . import FIGURES, _source, _table, read_record


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
    own = [bw for row in r["rows"] for bw in row.get("bandwidths_GB_per_s", [])]
    if own:  # interleaved: each forward timed right after its own bandwidth measurement, in rounds
        lines += ["", f"Each row: the median over {len(r['rows'][0]['bandwidths_GB_per_s'])} rounds of measured / "
                  f"predicted time, every forward timed right after a bandwidth measurement of its own (those ceilings: "
                  f"{min(own):.1f}-{max(own):.1f} GB/s); float32 matmul {c['matmul_float32_GFLOP_per_s']:.0f} GFLOP/s."]
    else:
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
        lines += ["", f"Batch-1 decode against its prediction: eager {eager['measured_over_predicted']:.2f}x the predicted "
                  f"time, compiled {1 / share:.2f}x, so the compiled step reaches {share:.0%} of the bound."]
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
              + (f" Contiguous cache / transformers: **{ratio:.2f}x**." if ratio else ""),
              "", f"{b['machine']}, {b['dtype']}, batch {b['batch_size']}, greedy; {_source(rec)}."]
    return "\n".join(lines)


def decode_llamacpp(folder: Path = FIGURES, name: str = "bench_decode_llamacpp.json") -> str:
    """docs/decode.md's table of minillm's 4-bit paths beside llama.cpp, from ``bench decode --peer llamacpp``."""
    rec = read_record(name, folder)
    p = rec["report"]
    res, n = p["results"], p["new_tokens"]
    rows = [[name, f"{r['decode_tokens_per_s']:.1f}", ", ".join(f"{x:.1f}" for x in r["runs"]),
             f"{r['bytes_per_token'] / 1e6:.1f}", f"{r['achieved_GB_per_s']:.1f}", f"{r['share_of_bound']:.0%}",
             f"{r['tokens_equal_to_float']}/{n}", ", ".join(r.get("kernels") or []) or "-"] for name, r in res.items()]
    lines = _table(["path", "tokens/s (median)", "each repeat", "MB read per token", "GB/s", "of the bound",
                    "first greedy tokens = float32's", "quantized layers' kernels"], ["l", "r", "l", "r", "r", "r", "r", "l"],
                   rows)
    bw = p["bandwidth"]
    per = ", ".join(f"{x:.2f}" for x in p["best_over_llamacpp_per_repeat"])
    ahead = sum(x >= 1 for x in p["best_over_llamacpp_per_repeat"])
    lines += ["", f"Best 4-bit path ({p['best_ours']}) / llama.cpp: **{p['best_over_llamacpp']:.2f}x**, the median of "
              f"the per-repeat ratios ({per}: ahead in {ahead} of {len(p['best_over_llamacpp_per_repeat'])}). "
              f"The bound: {bw['ceiling'] / 1e9:.1f} GB/s (streaming 512 MB: {bw['before'] / 1e9:.1f} before the decode "
              f"runs, {bw['after'] / 1e9:.1f} after)."]
    tps = {name: r["decode_tokens_per_s"] for name, r in res.items()}
    fp, body = "ours float32 (cached, eager)", "ours int4 (RTN g64), float head"
    head = next((k for k in res if k.startswith("ours int4") and k not in (body,) and not k.endswith(", compiled")
                 and not k.endswith(", int8 activations")), None)
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
    a8 = next((k for k in res if k.endswith(", int8 activations")), None)
    if a8 and a8.removesuffix(", int8 activations") in tps:
        base = a8.removesuffix(", int8 activations")
        steps.append(f"int8 activations {tps[a8] / tps[base]:.2f}x eager"
                     + (f", {tps[a8 + ', compiled'] / tps[base + ', compiled']:.2f}x compiled"
                        if a8 + ", compiled" in tps and base + ", compiled" in tps else ""))
    if steps:
        lines += ["", "What each step bought in this run: " + "; ".join(steps) + "."]
    build = f"; llama.cpp built for {p['llamacpp_build']}" if p.get("llamacpp_build") else ""
    lines += ["", f"{p['machine']}{build}, {p['threads']} threads for both, batch 1, {p['prompt_tokens']}-token prompt, {n} new "
              f"tokens, greedy, {p['repeats']} interleaved repeats after a warm-up each; {_source(rec)}."]
    return "\n".join(lines)


def decode_llamacpp_avx2(folder: Path = FIGURES) -> str:
    """The same table for the run capped at AVX2 (``ATEN_CPU_CAPABILITY=avx2``, llama.cpp built without AVX-512)."""
    return decode_llamacpp(folder, "bench_decode_llamacpp_avx2.json")


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


TABLES = {"kv_cache": kv_cache, "roofline": roofline, "decode": decode, "decode_llamacpp": decode_llamacpp,
          "decode_llamacpp_avx2": decode_llamacpp_avx2, "speculative": speculative}
FILES = {"docs/kv_cache.md": ["kv_cache"], "docs/roofline.md": ["roofline"],
         "docs/decode.md": ["decode", "decode_llamacpp", "decode_llamacpp_avx2"], "docs/speculative.md": ["speculative"]}
READS = {"kv_cache": ["02_kv_cache.json"], "roofline": ["01_roofline.json"], "decode": ["bench_decode.json"],
         "decode_llamacpp": ["bench_decode_llamacpp.json"], "decode_llamacpp_avx2": ["bench_decode_llamacpp_avx2.json"],
         "speculative": ["04_speculative.json"]}
