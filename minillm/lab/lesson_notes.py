"""The lessons' notes: the Markdown a lesson shows after it measures, built from what it measured.

A lesson's own cells run the model and draw; the sentences that put its numbers into words (and the verdicts
that depend on them: "pays", "within sampling noise", "stays flat") live in helpers, one function per note,
so that a student reads inference in the notebook and a teacher reads the wording in one place. Each function
takes the measurements as the lesson holds them and returns a Markdown string. Here: 00, 02, 03, 03a and 05a;
the roofline's (01, 01a) are in ``roofline_notes``, speculative decoding's (04, 04a) in ``spec_notes``.

* 00: ``quickstart_record``, ``quickstart_summary``; 02: ``kv_cache_summary``; 03: ``paged_record``,
  ``paged_summary``;
* 03a: ``online_table``, ``online_summary``;
* 05a: ``layout_inversions``, ``kquants_summary``.
"""

from __future__ import annotations

import statistics

from .lessons import protocol, quality


# ---------------------------------------------------------------- 00, 02, 03


def quickstart_record(machine: str, P: int, N: int, weight_mb: float, naive, cached) -> dict:
    """Notebook 00's record (``figures/00_quickstart.json``'s report): the protocol, the two paths' token-forwards,
    their decode tokens/s and step times in ms (``naive``, ``cached``: their ``GenerationResult``)."""
    return {"machine": machine, "prompt_tokens": P, "new_tokens": N, "weight_mb": weight_mb,
            "naive_token_forwards": N * P + N * (N - 1) // 2, "cached_token_forwards": P + N - 1,
            "naive_tokens_per_s": naive.decode_tokens_per_s, "cached_tokens_per_s": cached.decode_tokens_per_s,
            "speedup": cached.decode_tokens_per_s / naive.decode_tokens_per_s,
            "cached_step_ms": {"median": 1e3 * statistics.median(cached.step_s[1:]), "first": 1e3 * cached.step_s[1],
                               "last": 1e3 * cached.step_s[-1]},
            "naive_step_ms": {"first": 1e3 * naive.step_s[1], "last": 1e3 * naive.step_s[-1]},
            "same_tokens": naive.tokens == cached.tokens}


def quickstart_summary(rec: dict) -> str:
    """Notebook 00's closing note from its record (``quickstart_record``)."""
    P, N, naive_tokens, cached_tokens = (rec[k] for k in ("prompt_tokens", "new_tokens", "naive_token_forwards",
                                                          "cached_token_forwards"))
    step, naive_step = rec["cached_step_ms"], rec["naive_step_ms"]
    same = (f"Both paths gave the same {N} greedy tokens: the cache changes the cost, never the result."
            if rec["same_tokens"] else f"The two paths' {N} greedy tokens differ: float rounding flipped a near-tie somewhere.")
    return f"""On this run ({rec['machine']}, float32, batch 1, greedy, a {P}-token prompt and {N} new tokens):

* **{rec['weight_mb']:.1f} MB** of float32 weights are read for every decoded token, whatever the path.
* Recomputing runs **{naive_tokens:,}** token-forwards for {N} tokens, the KV cache **{cached_tokens}**:
  {naive_tokens / cached_tokens:.1f}x fewer.
* Measured: naive **{rec['naive_tokens_per_s']:.1f} tokens/s**, cached **{rec['cached_tokens_per_s']:.1f} tokens/s**:
  the cache is **{rec['speedup']:.1f}x** faster here, much less than the {naive_tokens / cached_tokens:.1f}x fewer FLOPs,
  because a cached step spends its time reading weights, not computing.
* A cached decode step took **{step['median']:.1f} ms** (median; {step['first']:.1f} ms at the
  first position, {step['last']:.1f} ms at the last); the naive step grew from {naive_step['first']:.1f} to
  {naive_step['last']:.1f} ms, {naive_step['last'] / step['median']:.1f} cached steps at the last position.

{same}"""


def kv_cache_summary(rec: dict) -> str:
    """Notebook 02's closing note from its record (``figures/02_kv_cache.json``'s report): memory per token,
    step time against position and its fits, and the int8 cache's perplexity relative to the float32 cache
    on the same protocol, to one decimal (the second moves from one CPU to another)."""
    kib, steps, fits, tot = rec["kv_kib_per_token"], rec["step_ms"], rec["fits_s"], rec["total_s"]
    first, last = (str(p) for p in (rec["positions"][0], rec["positions"][-1]))
    i8, ppl = rec["int8_step"], rec["perplexity"]
    ratio = i8["int8_ms"] / i8["float32_ms"]
    verdict = ("buys memory (more tokens per GiB) and costs time at this length" if ratio > 1.05 else
               "buys memory and a little time at this length" if ratio < 0.95 else
               "buys memory at about the same speed at this length")
    n, p0 = rec["new_tokens"], rec["prompt_tokens"]
    return f"""On this run ({rec['machine']}, float32, batch 1):

* The cache holds **{kib['float32']:.1f} KiB per token** in float32 ({kib['mha_float32']:.1f} KiB with one KV head per
  query head); the formula {'matches the real tensors byte for byte' if rec['formula_ok'] else 'DIFFERS from the real tensors'}.
* Recomputing, a step went from **{steps['none'][first]:.1f} to {steps['none'][last]:.1f} ms** between positions {first}
  and {last}; with the static cache, **{steps['contiguous'][first]:.1f} to {steps['contiguous'][last]:.1f} ms**.
* Summed over {n} new tokens after a {p0}-token prompt, the fits give **{tot['none']:.1f} s** recomputing against
  **{tot['contiguous']:.1f} s** with the static cache: **{tot['none'] / tot['contiguous']:.1f}x**.
* The int8 cache takes **{kib['int8']:.1f} KiB per token** ({kib['int8'] / kib['float16']:.0%} of float16); its perplexity
  is {ppl['int8']:.1f} against {ppl['float32']:.1f}, **{quality(ppl['int8'], ppl['float32'])}**
  ({protocol(ppl['play'], ppl['tokens'], ppl['seqlen'])}). Its decode step at position ~{i8['position']} took
  **{i8['int8_ms']:.1f} ms** against {i8['float32_ms']:.1f} ms ({ratio:.2f}x), where the float32 cache is
  {i8['kv_share']:.0%} of the bytes a step reads.

Recomputing, each step's work grows with the position, so the total over N tokens grows as N squared; with the
static cache a step changes by **{1e6 * fits['contiguous'][0]:.1f} µs per position** on top of
**{1e3 * fits['contiguous'][1]:.1f} ms** of weight reads (its fit), so at these lengths the total is nearly
linear in N. int8 {verdict}."""


def paged_record(machine: str, measured: dict, bench: dict) -> dict:
    """Notebook 03's record (``figures/03_paged_attention.json``'s report): what its cells measured (``measured``:
    the lab's shares, the prefix hit, the timeline, the fused read, throughput by concurrency) and the small
    serve-bench's rates and memory (``bench``: ``serve_bench``'s report)."""
    m = bench["modes"]
    keep = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "wall_s")
    return {"machine": machine, **{k: v for k, v in measured.items() if k != "throughput"},
            "throughput": {str(c): v for c, v in measured["throughput"].items()},  # JSON keys are strings
            "serve_bench": {"num_requests": bench["num_requests"], "scale": bench["scale"],
                            "mean_prompt": bench["mean_prompt"], "mean_output": bench["mean_output"],
                            "modes": {mode: {k: m[mode][k] for k in keep}
                                      for mode in ("engine", "static", "sequential")},
                            "kv_utilization": bench["memory"]["kv_utilization"],
                            "lab_kv_utilization": bench["memory"]["lab_kv_utilization"]}}


def paged_summary(rec: dict) -> str:
    """Notebook 03's closing note from its record (``paged_record``): the fragmentation lab, the prefix-cache hit,
    the scheduler's timeline, the fused read, the throughput against concurrency and the small serve-bench."""
    m, lab = rec["serve_bench"]["modes"], rec["lab_sharegpt"]
    speedup_seq = m["engine"]["output_tokens_per_s"] / m["sequential"]["output_tokens_per_s"]
    speedup_static = m["engine"]["output_tokens_per_s"] / m["static"]["output_tokens_per_s"]
    tp = {int(c): v for c, v in rec["throughput"].items()}
    best = max(tp, key=tp.get)
    return f"""
## What we measured

* **Fragmentation (lab, 10,000 ShareGPT-like requests):** paging with 16-token blocks keeps
  {100 * lab['paged_16']:.1f}% of reserved KV memory holding tokens, against
  {100 * lab['max']:.1f}% when each request reserves the maximum length (paper, Fig. 2: 96.3% vs 20.4%);
  the engine itself, at the trace's full lengths, keeps {100 * rec['serve_bench']['kv_utilization']:.1f}% of its used
  KV slots holding tokens (the lab predicts {100 * rec['serve_bench']['lab_kv_utilization']:.1f}%).
* **Prefix cache:** the second chat request took {rec['prefix_cached']} of its {rec['prefix_prompt']}
  prompt tokens from the first's blocks, with the same answer as alone.
* **Scheduler:** {rec['timeline_steps']} steps and {rec['timeline_preemptions']} preemptions in a 20-block
  pool; every request equal to `generate_cached` alone: {rec['timeline_same']}.
* **Reading the pool:** attention straight from the blocks (the fused kernel) took one decode step's layer
  {rec['fused_attention_speedup']:.1f}x faster than gathering the keys first, with the same output.
* **Concurrency:** {tp[1]:.1f} output tokens/s one request at a time, {tp[best]:.1f} at {best} concurrent requests
  ({tp[best] / tp[1]:.1f}x): one weight read per step serves every running row.
* **serve-bench ({rec['serve_bench']['num_requests']} requests):** the engine ran {m['engine']['output_tokens_per_s']:.1f} output tokens/s,
  {speedup_seq:.1f}x one request at a time and {speedup_static:.2f}x static batches.
"""


# ---------------------------------------------------------------- 03a


def online_table(report: dict, scale: float, duration: float) -> str:
    """Notebook 03a's table of ``online_bench``'s report: one row per mode and rate."""
    def row(mode, r):
        return (f"| {mode} | {r['rate']:g} | {r['num_requests']} | {r['answered_in_full']} | {r['ttft_mean_s']:.2f} / "
                f"{r['ttft_p99_s']:.2f} | {r['tpot_mean_s']:.3f} | {r['itl_p50_s']:.3f} / {r['itl_p99_s']:.3f} | "
                f"{r['e2el_mean_s']:.1f} / {r['e2el_p99_s']:.1f} | {r['normalized_latency_s']:.3f} | {r['goodput']:.2f} | "
                f"{r['output_tokens_per_s']:.1f} |")

    modes = report["modes"]
    return "\n".join(
        ["| mode | rate (req/s) | requests | answered in full | TTFT mean / p99 (s) | TPOT mean (s) | ITL p50 / p99 (s) "
         "| E2E mean / p99 (s) | normalised latency (s/token) | goodput (req/s) | output tokens/s |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        + [row(mode, r) for mode in modes for r in modes[mode]]
        + ["", f"{report['machine']}, {report['dtype']}, ShareGPT-like lengths x {scale:g}, Poisson arrivals, rate x "
           f"{duration:g} s requests per rate and at least {report['min_requests']}, greedy; goodput: requests "
           f"meeting TTFT <= {report['ttft_slo_s']:g} s and TPOT <= {report['tpot_slo_s']:g} s per second of the window "
           "they arrive in (requests / rate)."])


def online_summary(report: dict) -> str:
    """Notebook 03a's closing note: latency at the lowest and highest rate, and the rate each mode
    sustains below the knee (``report["knee"]``)."""
    modes, knee = report["modes"], report["knee"]
    lo, hi = {m: rows[0] for m, rows in modes.items()}, {m: rows[-1] for m, rows in modes.items()}

    def sustained(mode):
        k = knee[mode]
        return (f"at least {k['rate']:g} requests/s (its curve stayed under the knee)" if k["at_least"]
                else f"{k['rate']:.2f} requests/s")

    ratio = (knee["engine"]["rate"] / knee["static"]["rate"]
             if knee["static"]["rate"] > 0 and not knee["static"]["at_least"] else None)
    versus = "" if ratio is None else \
        f", {'at least ' if knee['engine']['at_least'] else ''}{ratio:.1f}x static batching's rate"
    return f"""
## What we measured

* **At {report['rates'][0]:g} requests/s:** normalised latency {lo['engine']['normalized_latency_s']:.3f} s/token for the
  engine, {lo['static']['normalized_latency_s']:.3f} s/token for static batching.
* **At {report['rates'][-1]:g} requests/s:** {hi['engine']['normalized_latency_s']:.3f} s/token for the engine,
  {hi['static']['normalized_latency_s']:.3f} s/token for static batching ({hi['static']['normalized_latency_s'] / hi['engine']['normalized_latency_s']:.1f}x).
  Time to first token: {hi['engine']['ttft_mean_s']:.2f} s against {hi['static']['ttft_mean_s']:.2f} s on average
  (p99 {hi['engine']['ttft_p99_s']:.2f} s against {hi['static']['ttft_p99_s']:.2f} s); time per output token after it:
  {hi['engine']['tpot_mean_s']:.3f} s against {hi['static']['tpot_mean_s']:.3f} s. Goodput: {hi['engine']['goodput']:.2f}
  against {hi['static']['goodput']:.2f} requests/s.
* **At the knee** ({knee['threshold_s']:.3f} s/token): static batching sustained {sustained('static')}, the engine
  {sustained('engine')}{versus}; the paper's Fig. 12: 2-4x the rate at the same normalised latency.

The lesson: throughput with every request queued at once hides what a person waiting sees. Static batching
waits for the longest request of each batch and makes new arrivals wait for the whole batch, so its latency
turns up at a low request rate; continuous batching admits requests at every step and releases each one as
it ends, so the first token comes within a step and latency stays flat up to a higher rate. Paging is what
lets it admit them: memory is taken block by block as sequences grow, not reserved for each request's
maximum length.
"""


# ---------------------------------------------------------------- 05a


def layout_inversions(errors: dict[str, tuple[float, float, float]]) -> str:
    """Notebook 05a: the block layouts that spend fewer bits per weight yet err less on Gaussian weights
    (``errors``: {layout: (bits per weight, error on the shipped tensor, error on Gaussian weights)})."""
    by_bits = sorted(errors, key=lambda k: errors[k][0])
    inversions = [(a, b) for i, a in enumerate(by_bits) for b in by_bits[i + 1:]
                  if errors[a][0] < errors[b][0] and errors[a][2] < errors[b][2]]
    if not inversions:
        return "On the Gaussian weights, every layout with more bits per weight errs less."
    return "On the Gaussian weights, layouts that spend fewer bits yet err less: " + "; ".join(
        f"{a} ({errors[a][0]:.2f} bits, {errors[a][2]:.4f}) below {b} ({errors[b][0]:.2f} bits, {errors[b][2]:.4f})"
        for a, b in inversions) + "."


def kquants_summary(errors: dict, block_bytes: dict[str, int], same_as_gguf: bool, counts: dict[str, int],
                    recipe_bpw: float, kq: dict, blocks: dict) -> str:
    """Notebook 05a's closing note: what K and M mean on this model, the byte comparison with llama.cpp, and
    the perplexities of ``figures/05_kquants.json`` (``kq``), each against the shipped model on its protocol.
    ``block_bytes``: bytes of one Q4_K (256 weights) and one Q4_1 (32 weights) block."""
    rows = {r["label"]: r for r in kq["rows"]}
    shipped, ours = rows["shipped Q4_1"], rows["minillm Q4_K_M"]
    llama = rows.get("llama.cpp Q4_K_M")
    ref = shipped["perplexity"]
    llama_text = "" if llama is None else \
        f", llama.cpp's Q4_K_M {llama['perplexity']:.2f} ({llama['bytes'] / 1e6:.1f} MB, {quality(llama['perplexity'], ref)})"
    return f"""
## What we measured

* **K** = super-blocks of 256 weights with quantized sub-block scales: Q4_K stores 256 weights in
  {block_bytes['Q4_K']} bytes ({8 * block_bytes['Q4_K'] / 256} bits per weight) against Q4_1's
  {8 * block_bytes['Q4_1'] / 32} for blocks of 32. On Gaussian weights of `ffn_down`'s shape its relative error
  is {errors['Q4_K'][2]:.4f} (Q4_0 at the same bits: {errors['Q4_0'][2]:.4f}, Q4_1: {errors['Q4_1'][2]:.4f}, Q6_K: {errors['Q6_K'][2]:.4f});
  on the shipped `ffn_down` of layer 3, already on Q4_1's grid, {errors['Q4_K'][1]:.4f}.
  Our dequantizer equals the `gguf` package's on a real block: {same_as_gguf}.
* **M** = the medium recipe: on SmolLM2-135M it gives {counts['Q4_K']} tensors Q4_K, {counts['Q6_K']} Q6_K,
  {counts['Q5_0']} Q5_0 and {counts['Q8_0']} Q8_0, because 256 does not divide the 576-wide rows: only `ffn_down`
  is a real k-quant here. That makes {recipe_bpw:.2f} bits per weight, more than the shipped Q4_1's
  {shipped['bits_per_weight']:.2f}.
* Our Q4_K_M file and llama.cpp's ({kq['llama_cpp_version']}) have {len(blocks['type_mismatches'])} type mismatches and
  {sum(blocks['bytes_differing'].values())} differing bytes in {sum(blocks['bytes'].values()) / 1e6:.1f} MB of tensor data.
* Perplexity ({protocol('hamlet', ours['tokens'], ours['seqlen'])}, {kq['date']}; the shipped Q4_1 model is this notebook's
  float reference): shipped Q4_1 {ref:.2f} ({shipped['bytes'] / 1e6:.1f} MB), our Q4_K_M {ours['perplexity']:.2f}
  ({ours['bytes'] / 1e6:.1f} MB, {quality(ours['perplexity'], ref)}, KL {ours['kl']:.4f}){llama_text}.
  (read from `figures/05_kquants.json`). Re-quantizing the shipped Q4_1 weights can only add error; from float
  weights, llama.cpp's published LLaMA-3-8B numbers put Q4_K_M (6.407) below Q4_1 (6.683) at fewer bits.
"""
