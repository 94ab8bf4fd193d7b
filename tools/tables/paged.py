"""docs/paged.md's tables: the fragmentation lab, paged against contiguous decode (``bench decode``) and
``serve-bench``, each from its record (``tools.tables`` says how tables are rebuilt)."""

from __future__ import annotations

from pathlib import Path

from . import FIGURES, _source, _table, _trace, read_record


SERVE_MODES = {"engine": "the engine (continuous batching)",
               "engine+spec": "the engine + prompt-lookup speculation (`ngram`, draft length `auto`)", "static": "static batches (`generate_batch`, {b} at a time)",
               "sequential": "one at a time (`generate_cached`)",
               "transformers": "transformers' continuous batching (paged\\|sdpa)"}


def serve_bench(folder: Path = FIGURES) -> str:
    """docs/paged.md's continuous-batching table, memory, sharing and ratios, from ``serve-bench``'s record."""
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
    if "engine+spec" in s["modes"]:
        x = s["modes"]["engine+spec"]
        lines += ["", f"With speculation (vLLM's `speculative_config={x['speculative_config']}`) the engine took "
                  f"{x['steps']} steps against {e['steps']}; {x['acceptance_rate']:.0%} of its "
                  f"{x['num_draft_tokens']} draft tokens were accepted."]
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
             "engine_vs_transformers": "engine / transformers",
             "engine_spec_vs_transformers": "engine with speculation / transformers", "kv_utilization": "kv_utilization at full lengths",
             "kv_vs_lab_points": "kv_utilization's distance from the lab's prediction"}
    units = {"kv_utilization": ("{:.1%}", "{:.0%}"), "kv_vs_lab_points": ("{:.2f} points", "at most {} points")}
    # the record's goals stay in the JSON; the doc shows what was measured
    ratios = [f"{words.get(k, k)}: not measured" if g["measured"] is None else
              f"{words.get(k, k)} {units.get(k, ('{:.2f}x',))[0].format(g['measured'])}" for k, g in s["goals"].items()]
    lines += ["", "Measured: " + "; ".join(ratios) + ".", "", f"{s['machine']}, {s['dtype']}; {_source(rec)}."]
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
    lines += ["", f"Paged is {abs(slower):.1%} {'slower' if slower >= 0 else 'faster'} than the contiguous one. "
              f"{b['prompt_tokens']}-token prompt, {b['new_tokens']} new tokens, median of "
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
        lines += ["", f"Paging wastes {waste:.1%} at block size 16 on the ShareGPT-like trace."]
        if gap:
            lines[-1] += (f" The reservation rows on that trace lie within {100 * max(gap):.1f} points of the paper's "
                          "without external fragmentation.")
    lines += ["", f"The measure: {f['measure']}; {_source(rec)}."]
    return "\n".join(lines)

TABLES = {"serve_bench": serve_bench, "paged_decode": paged_decode, "fragmentation": fragmentation}
FILES = {"docs/paged.md": ["fragmentation", "paged_decode", "serve_bench"]}
READS = {"serve_bench": ["serve_bench.json"], "paged_decode": ["bench_decode.json"], "fragmentation": ["fragmentation.json"]}
