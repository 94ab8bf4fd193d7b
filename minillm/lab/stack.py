"""bench stack: every technique together, one row per configuration, each adding one to the row above.

1. no KV cache, float32, one request at a time (``generate_naive``; on the first requests only);
2. + KV cache (``generate_cached``, one at a time); 3. + the paged engine (continuous batching);
4. + int4 weights (int8 output layer); 5. + prefix caching (the workload shares a system prompt);
6. + speculative decoding inside the engine, where the engine has it.

One workload (``make_workload``): chat requests with one system prompt, half asking to copy a passage of a
play (speculation's good case), half open questions; greedy, EOS ignored, every request arriving at once.
Each row reports output tokens/s, TTFT and TPOT p50 / p99, weight bytes, peak KV bytes, the quality cost
(KL and top-1 agreement with the float model on one perplexity protocol; the share of greedy tokens equal
to row 2's before a request's first difference) and its roofline bound: the tokens/s that the bytes of a
decode step at the row's mean rows per step allow at this machine's measured bandwidth (``roofline``).
Beside the stack: each technique alone over row 2, and a concurrency sweep of the engine rows (the largest
concurrency whose TPOT p99 stays at most 0.1 s, i.e. every request gets 10 tokens/s).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..data import HELD_OUT_PLAY, play_text
from ..evaluation import perplexity, reference_logprobs
from ..generation import generate_cached, generate_naive
from ..kv_cache import kv_cache_bytes
from ..fast.linear import FastLinear
from ..linear import Linear
from ..model import LayerNorm, RMSNorm
from ..paged.engine import LLMEngine
from ..quant.qlinear import QuantLinear
from ..roofline.cost import decode_cost, forward_cost
from ..sampling_params import SamplingParams
from ..timing import dtype_name, machine
from .engine_costs import linear_seconds
from .serve_bench import drive_engine

SYSTEM = ("You are a patient teaching assistant for a class on Shakespeare. Answer in plain English, in a few "
          "sentences, and when a student asks you to copy a passage, copy it exactly as written, line by line, "
          "without comments.")
QUESTIONS = ("Why does Hamlet hesitate to act?", "What is a soliloquy, and why do plays use them?",
             "Describe the ghost's role in the first act.", "How does Ophelia change during the play?",
             "What makes a tragedy different from a comedy?", "Explain the play within the play.",
             "Who is Horatio, and why does he matter?", "What does the graveyard scene say about death?")
TPOT_SLO = 0.1  # seconds per output token: 10 tokens/s for every request
QUALITY = dict(seqlen=256, max_tokens=1024)  # the perplexity protocol of the quality columns (Hamlet)
NGRAM = {"method": "ngram", "num_speculative_tokens": "auto"}  # row 6's speculation: prompt lookup
VARIANT = "int4 draft, float target"  # row 6's variant


@dataclass(frozen=True)
class StackRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    kind: str  # "copy" or "chat"


def make_workload(tokenizer, num_requests: int = 16, new_tokens: int = 32, seed: int = 0,
                  passage_tokens: int = 48, system: str = SYSTEM) -> list[StackRequest]:
    """Chat requests sharing the ``system`` prompt: even ones copy a passage of Hamlet cut at a seeded offset, odd
    ones ask one of ``QUESTIONS``; each wants ``new_tokens`` tokens.

    Raises:
        ValueError: num_requests or new_tokens below 1.
    """
    if num_requests < 1 or new_tokens < 1:
        raise ValueError(f"num_requests / new_tokens: need >= 1, got {num_requests} / {new_tokens}")
    text = tokenizer.encode(play_text(HELD_OUT_PLAY))
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(num_requests):
        if i % 2 == 0:
            start = int(rng.integers(0, len(text) - passage_tokens))
            user, kind = "Copy this passage exactly:\n" + tokenizer.decode(text[start:start + passage_tokens]), "copy"
        else:
            user, kind = QUESTIONS[(i // 2) % len(QUESTIONS)], "chat"
        ids = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}])
        reqs.append(StackRequest(ids, new_tokens, kind))
    return reqs


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def summarize(reqs, wall: float, ttft: list[float], tpot: list[float], tokens: list[list[int]]) -> dict:
    """Output tokens/s over the wall time, TTFT and TPOT p50 / p99 (seconds), and the tokens."""
    out = sum(r.max_tokens for r in reqs)
    return {"requests": len(reqs), "wall_s": wall, "output_tokens": out, "output_tokens_per_s": out / wall,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "tpot_p50_s": _pct(tpot, 50),
            "tpot_p99_s": _pct(tpot, 99), "tokens": tokens}


def run_one_at_a_time(model, reqs, generate=generate_cached) -> dict:
    """One request after another with ``generate`` (``generate_cached``, or ``generate_naive``: the same
    signature); request k waits for the k before it. Adds the peak KV bytes (the contiguous cache)."""
    t0, ttft, tpot, tokens = time.perf_counter(), [], [], []
    for r in reqs:
        start = time.perf_counter()
        g = generate(model, r.prompt_token_ids, _greedy(r.max_tokens), max_seq_len=len(r.prompt_token_ids) + r.max_tokens)
        ttft.append(start - t0 + g.prefill_s)
        if r.max_tokens > 1:
            tpot.append(g.decode_s / (r.max_tokens - 1))
        tokens.append(g.tokens)
    report = summarize(reqs, time.perf_counter() - t0, ttft, tpot, tokens)
    element = torch.empty((), dtype=model.dtype).element_size()
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
    report["peak_kv_bytes"] = 0 if generate is generate_naive else kv_cache_bytes(model.config, 1, longest, element)
    report["rows_per_step_mean"] = 1.0
    return report


def run_engine(model, reqs, *, max_num_seqs: int = 64, enable_prefix_caching: bool = False, block_size: int = 16,
               max_num_batched_tokens: int = 256, **engine_kwargs) -> dict:
    """Every request added to one ``LLMEngine`` at time 0; adds the peak KV bytes (blocks in use at the
    fullest step), the prefix hit rate, preemptions and the mean rows (sequences) per step."""
    engine = LLMEngine(model, block_size=block_size, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
                       **engine_kwargs)
    outs, wall, ttft, tpot = drive_engine(engine, reqs)
    report = summarize(reqs, wall, ttft, tpot, [list(o.outputs[0].token_ids) for o in outs])
    mem = engine.stats.summary(block_size)
    element = torch.empty((), dtype=model.dtype).element_size()
    report.update(peak_kv_bytes=mem["peak_blocks"] * kv_cache_bytes(model.config, 1, block_size, element),
                  prefix_hit_rate=mem["prefix_hit_rate"], preemptions=mem["preemptions"],
                  rows_per_step_mean=float(np.mean([len(rec.runs) for rec in engine.stats.records])))
    spec = engine.stats.spec_decoding
    if spec is not None:
        report.update(acceptance_rate=spec.acceptance_rate, mean_acceptance_length=spec.mean_acceptance_length)
    return report


def weight_bytes(model) -> int:
    """Bytes of weights a forward reads: each linear layer as its kernel reads it (``QuantLinear.kernel_nbytes``;
    a float ``Linear``'s shards), plus the norms. The embedding's looked-up rows are left out."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.kernel_nbytes()
        elif isinstance(m, (Linear, FastLinear)):
            total += sum(p.numel() * p.element_size() for p in m.parameters())
        elif isinstance(m, (RMSNorm, LayerNorm)):
            total += sum(p.numel() * p.element_size() for p in m.parameters())
    return total


def roofline_bound(model, rows: float, context: float, bandwidth: float, peak_flops: float,
                   recompute: bool = False) -> float:
    """Output tokens/s the roofline allows: ``rows`` sequences decoding one token each after ``context``
    positions read the weights once and their KV (``recompute``: the whole sequence is run again, as
    without a cache), at ``bandwidth`` bytes/s and ``peak_flops`` FLOP/s."""
    element = torch.empty((), dtype=model.dtype).element_size()
    if recompute:
        cost = forward_cost(model.config, 1, max(1, round(context)), 0, kv_bytes=element, causal_prefill=True)
        rows = 1
    else:
        cost = decode_cost(model.config, max(1, round(rows)), round(context), kv_bytes=element)
    seconds = max((weight_bytes(model) + cost.kv_bytes) / bandwidth, cost.flops / peak_flops)
    return rows / seconds


def quality(model, reference, tokens) -> dict:
    """KL(float || model) and top-1 agreement on ``QUALITY``'s windows of ``tokens`` (the float model's
    ``reference`` log-probabilities), and its perplexity."""
    r = perplexity(model, tokens, reference=reference, **QUALITY)
    return {"perplexity": r["perplexity"], "kl": r["kl"], "top1_agreement": r["top1_agreement"]}


def equal_share(tokens: list[list[int]], baseline: list[list[int]]) -> float:
    """Share of the tokens that equal the baseline's before each request's first difference."""
    same = total = 0
    for a, b in zip(tokens, baseline):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same, total = same + n, total + len(b)
    return same / total if total else 0.0


def largest_concurrency(sweep: dict) -> int:
    """The largest concurrency of a sweep ({c: report}) whose TPOT p99 is at most ``TPOT_SLO`` (0: none)."""
    return max((int(c) for c, r in sweep.items() if r["tpot_p99_s"] <= TPOT_SLO), default=0)


def _row(name: str, adds: str, run: dict, model, ceilings, context: float, recompute: bool = False) -> dict:
    run = dict(run)
    tokens = run.pop("tokens")
    return {"name": name, "adds": adds, "weights": "int4" if any(isinstance(m, QuantLinear) for m in model.modules())
            else dtype_name(model.dtype), **run, "weight_bytes": weight_bytes(model),
            "bound_tokens_per_s": roofline_bound(model, run["rows_per_step_mean"], context, ceilings.bandwidth,
                                                 ceilings.matmul_flops["float32"], recompute),
            "tokens": tokens}


def bench_stack(model, quantized, tokenizer, ceilings, *, num_requests: int = 16, new_tokens: int = 32,
                naive_requests: int = 2, concurrency=(1, 4, 16, 64), sweep_tokens: int = 16,
                quant_recipe: str = "", speculation: bool = True, kernel_rows=(1, 4, 16, 64, 256),
                progress: bool = True) -> dict:
    """The stack's rows, each technique alone, the engine rows' concurrency sweep, the quality columns and
    the linear layers' time per row count (float against int4); the report the module docstring describes.

    ``model`` is the float model, ``quantized`` its int4 copy (int8 head), ``ceilings`` this machine's
    (``roofline.ceilings.measure``); ``speculation`` adds row 6 (prompt lookup, "auto" lengths) and its
    variant (the int4 copy drafting for the float target).
    """
    from tqdm.auto import tqdm


    reqs = make_workload(tokenizer, num_requests, new_tokens)
    context = float(np.mean([len(r.prompt_token_ids) for r in reqs])) + new_tokens / 2
    for m in (model, quantized):  # warm-up
        generate_cached(m, reqs[0].prompt_token_ids, _greedy(2))
    n = num_requests
    plan = [("no KV cache", "float32, one request at a time, recompute every step", model,
             lambda: run_one_at_a_time(model, reqs[:naive_requests], generate_naive)),
            ("KV cache", "generate_cached, one at a time", model, lambda: run_one_at_a_time(model, reqs)),
            ("paged engine", "continuous batching", model, lambda: run_engine(model, reqs, max_num_seqs=n)),
            ("int4 weights", f"int4 ({quant_recipe}), int8 output layer", quantized,
             lambda: run_engine(quantized, reqs, max_num_seqs=n)),
            ("prefix caching", "shared system prompt's blocks reused", quantized,
             lambda: run_engine(quantized, reqs, max_num_seqs=n, enable_prefix_caching=True))]
    draft = {"method": "draft_model", "model": quantized, "num_speculative_tokens": "auto"}
    if speculation:
        plan += [("speculative decoding", "prompt lookup, auto length", quantized,
                  lambda: run_engine(quantized, reqs, max_num_seqs=n, enable_prefix_caching=True,
                                     speculative_config=NGRAM)),
                 (VARIANT, "variant of 6: float32 target, the int4 copy drafts (auto)", model,
                  lambda: run_engine(model, reqs, max_num_seqs=n, enable_prefix_caching=True,
                                     speculative_config=draft))]
    alone_plan = {"int4 weights": lambda: run_one_at_a_time(quantized, reqs),
                  "prefix caching": lambda: run_engine(model, reqs, max_num_seqs=1, enable_prefix_caching=True)}
    if speculation:  # alone: the float engine one request at a time, prompt lookup
        alone_plan["speculative decoding"] = lambda: run_engine(model, reqs, max_num_seqs=1, speculative_config=NGRAM)
    sweep_plan = {"paged engine": (model, {}), "int4 weights": (quantized, {}),
                  "prefix caching": (quantized, {"enable_prefix_caching": True})}
    if speculation:
        sweep_plan["speculative decoding"] = (quantized, {"enable_prefix_caching": True, "speculative_config": NGRAM})
    total = len(plan) + len(alone_plan) + len(sweep_plan) * len(concurrency) + 2
    with tqdm(total=total, desc="bench stack", disable=not progress) as bar:
        rows = []
        for name, adds, m, run in plan:
            bar.set_postfix_str(name)
            rows.append(_row(name, adds, run(), m, ceilings, context, recompute=name == "no KV cache"))
            bar.update(1)
        alone = {}
        for name, run in alone_plan.items():
            bar.set_postfix_str(f"{name} alone")
            alone[name] = {k: v for k, v in run().items() if k != "tokens"}
            bar.update(1)
        sweep = {}
        for name, (m, kwargs) in sweep_plan.items():
            sweep[name] = {}
            for c in concurrency:
                bar.set_postfix_str(f"{name} at {c}")
                r = run_engine(m, make_workload(tokenizer, c, sweep_tokens, seed=1), max_num_seqs=c, **kwargs)
                sweep[name][str(c)] = {k: r[k] for k in ("output_tokens_per_s", "tpot_p50_s", "tpot_p99_s",
                                                         "ttft_p99_s", "rows_per_step_mean")}
                bar.update(1)
        bar.set_postfix_str("quality")
        text = tokenizer.encode(play_text(HELD_OUT_PLAY))
        reference = reference_logprobs(model, text, **QUALITY)
        float_ppl = perplexity(model, text, **QUALITY)["perplexity"]
        q_int4 = quality(quantized, reference, text)
        bar.update(1)
        bar.set_postfix_str("linear layers per row count")
        kernels = {"float32": linear_seconds(model, kernel_rows), "int4": linear_seconds(quantized, kernel_rows)}
        bar.update(1)
    return _finish(rows, alone, sweep, kernels, float_ppl, q_int4, reqs, ceilings, model, num_requests, new_tokens,
                   naive_requests, sweep_tokens, quant_recipe)


def _finish(rows, alone, sweep, kernels, float_ppl, q_int4, reqs, ceilings, model, num_requests, new_tokens,
            naive_requests, sweep_tokens, quant_recipe) -> dict:
    """Quality, gains and the concurrency column onto the measured rows; the report."""
    base, base_tokens = rows[1], rows[1]["tokens"]
    first_tokens = base_tokens[0]
    chain = [r for r in rows if r["name"] != VARIANT]  # the variant of row 6 stands beside the stack
    for i, r in enumerate(rows):
        q = q_int4 if r["weights"] == "int4" else {"perplexity": float_ppl, "kl": 0.0, "top1_agreement": 1.0}
        r.update(q)
        r["greedy_equal_share"] = equal_share(r.pop("tokens"), base_tokens)
        r["over_row2"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        above = rows[2] if r["name"] == VARIANT else rows[i - 1]  # the variant: over the float engine
        r["label"] = "6b" if r["name"] == VARIANT else str(chain.index(r) + 1)
        r["gain_in_stack"] = None if i == 0 else r["output_tokens_per_s"] / above["output_tokens_per_s"]
        if r["name"] in sweep:
            r["max_concurrency_at_tpot_slo"] = largest_concurrency(sweep[r["name"]])
        elif i == 1:  # one at a time: concurrency 1, if it keeps the pace
            r["max_concurrency_at_tpot_slo"] = int(r["tpot_p99_s"] <= TPOT_SLO)
    by = {r["name"]: r for r in rows}
    gains = {"KV cache": {"alone": by["KV cache"]["output_tokens_per_s"] / by["no KV cache"]["output_tokens_per_s"],
                          "in_stack": by["KV cache"]["gain_in_stack"]},
             "paged engine": {"alone": by["paged engine"]["over_row2"], "in_stack": by["paged engine"]["gain_in_stack"]}}
    for name, a in alone.items():
        gains[name] = {"alone": a["output_tokens_per_s"] / base["output_tokens_per_s"], "in_stack": by[name]["gain_in_stack"],
                       "alone_run": a}
    top = chain[-1]
    first_int4 = sweep.get("int4 weights", {})
    return {"machine": machine(), "device": str(model.device), "dtype": dtype_name(model.dtype),
            "num_requests": num_requests, "new_tokens": new_tokens, "naive_requests": naive_requests,
            "mean_prompt": float(np.mean([len(r.prompt_token_ids) for r in reqs])),
            "copy_requests": sum(r.kind == "copy" for r in reqs), "quant_recipe": quant_recipe,
            "quality_protocol": f"{HELD_OUT_PLAY}, {QUALITY['max_tokens']} tokens in windows of {QUALITY['seqlen']}",
            "bandwidth_GB_per_s": ceilings.bandwidth / 1e9, "peak_GFLOP_per_s": ceilings.matmul_flops["float32"] / 1e9,
            "rows": rows, "first_request_tokens": first_tokens, "gains": gains, "sweep": sweep, "sweep_tokens": sweep_tokens,
            "int4_over_float_engine": {c: first_int4[c]["output_tokens_per_s"] / sweep["paged engine"][c]["output_tokens_per_s"]
                                       for c in first_int4},
            "linear_seconds": {k: {str(m): list(v) for m, v in t.items()} for k, t in kernels.items()},
            "full_stack_over_row2": top["over_row2"],
            "full_stack_over_row1": top["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]}


def format_report(report: dict) -> str:
    """The table: one row per configuration, the gains alone and in the stack, the sweep."""
    lines = [f"machine: {report['machine']} ({report['device']})",
             f"{report['num_requests']} chat requests at once sharing a system prompt ({report['copy_requests']} copy a "
             f"passage, the rest open questions), mean prompt {report['mean_prompt']:.0f} tokens, {report['new_tokens']} "
             f"new tokens each, greedy; row 1 on the first {report['naive_requests']}",
             f"{'row':<26}{'out tok/s':>10}{'TTFT p50':>9}{'p99':>7}{'TPOT p50':>9}{'p99':>7}{'weights MB':>11}"
             f"{'peak KV MB':>11}{'KL':>7}{'top-1':>7}{'= float':>8}{'bound':>8}{'max conc':>9}"]
    for i, r in enumerate(report["rows"], 1):
        conc = r.get("max_concurrency_at_tpot_slo")
        lines.append(f"{r.get('label', str(i)) + '.':<3} {r['name']:<24}{r['output_tokens_per_s']:>10.1f}{r['ttft_p50_s']:>9.2f}{r['ttft_p99_s']:>7.2f}"
                     f"{r['tpot_p50_s']:>9.3f}{r['tpot_p99_s']:>7.3f}{r['weight_bytes'] / 1e6:>11.1f}"
                     f"{r['peak_kv_bytes'] / 1e6:>11.1f}{r['kl']:>7.3f}{r['top1_agreement']:>7.3f}"
                     f"{r['greedy_equal_share']:>8.2f}{r['bound_tokens_per_s']:>8.{0 if r['bound_tokens_per_s'] >= 10 else 1}f}{'-' if conc is None else conc:>9}")
    lines.append("gains over the row before (in the stack) and over row 2 alone (row 1 for the KV cache):")
    for name, g in report["gains"].items():
        alone = "-" if g["alone"] is None else f"{g['alone']:.2f}x"
        lines.append(f"  {name:<22} alone {alone:>8}   in the stack {g['in_stack']:.2f}x")
    lines.append(f"full stack: {report['full_stack_over_row2']:.1f}x row 2, {report['full_stack_over_row1']:.1f}x row 1 "
                 f"(per-token rates); bound = tokens/s the bytes of a decode step allow at "
                 f"{report['bandwidth_GB_per_s']:.1f} GB/s")
    for name, s in report["sweep"].items():
        lines.append(f"  {name:<22} " + "  ".join(f"c={c}: {v['output_tokens_per_s']:.0f} tok/s, TPOT p99 "
                                                   f"{v['tpot_p99_s']:.3f} s" for c, v in s.items()))
    lines.append("int4 engine / float engine by concurrency: " + ", ".join(
        f"{c}: {x:.2f}x" for c, x in report["int4_over_float_engine"].items()))
    lines.append("linear layers, one pass (blocks + head), ms by rows: " + "; ".join(
        f"{k}: " + ", ".join(f"{m}: {1e3 * sum(v):.1f}" for m, v in t.items()) for k, t in report["linear_seconds"].items()))
    return "\n".join(lines)


def cmd_bench_stack(args) -> int:
    """Load the float model and its int4 copy (``--quant-file``, or RTN in this process), measure the
    ceilings, run the stack, print the table (``--json``: one line of strict JSON)."""
    from safetensors import safe_open

    from ..loading import load_model
    from ..options import load, print_json
    from ..quant.pipeline import quantize_model
    from ..quant.recipe import Recipe
    from ..roofline.ceilings import measure

    if args.naive_requests > args.requests:
        raise ValueError(f"--naive-requests: {args.naive_requests} is more than --requests {args.requests}")
    if args.dtype != "float32":
        raise ValueError(f"--dtype: the stack starts from float32 (row 1) and the int4 file computes in float32; "
                         f"drop --dtype {args.dtype}")
    if args.quant_file and not (args.quant_file.endswith(".safetensors") and os.path.isfile(args.quant_file)):
        raise ValueError(f"--quant-file: {args.quant_file!r} is not a .safetensors file; write one with `python -m "
                         "minillm quantize --quant awq+gptq --bits 4 --group-size 32 --quant-head int8 --out FILE`")
    model, tokenizer = load(args)
    if args.quant_file:
        quantized, _ = load_model(args.quant_file, device=model.device, n_shards=args.shards)
        with safe_open(args.quant_file, "pt") as f:
            q = json.loads(f.metadata()["quant_config"])
        recipe = f"{q['method'].upper()} g{q['group_size']} ({os.path.basename(args.quant_file)})"
    else:
        quantized, _ = load(args)
        quantize_model(quantized, Recipe.of("rtn", bits=4, group_size=32, quant_head="int8"), progress=not args.json)
        recipe = "RTN g32"
    ceilings = measure(str(model.device), dtypes=("float32",), megabytes=256)
    report = bench_stack(model, quantized, tokenizer, ceilings, num_requests=args.requests, new_tokens=args.new_tokens,
                         naive_requests=args.naive_requests, concurrency=args.concurrency, quant_recipe=recipe,
                         speculation=not args.no_speculation, progress=not args.json)
    if args.figure:
        from .stack_plots import plot_stack

        plot_stack(report, args.figure)
    print_json(report) if args.json else print(format_report(report))
    return 0


def register(bench) -> None:
    """Add ``stack`` under ``bench``."""
    from ..options import add_model_args, at_least, int_list

    p = bench.add_parser("stack", help="every technique together: one row per configuration, each adding one")
    add_model_args(p)
    p.add_argument("--requests", type=at_least(1), default=16, help="requests, all arriving at once (default 16)")
    p.add_argument("--new-tokens", type=at_least(2), default=32, help="new tokens per request (default 32)")
    p.add_argument("--naive-requests", type=at_least(1), default=2,
                   help="requests row 1 (no KV cache) runs, the first of the workload (default 2)")
    p.add_argument("--concurrency", type=int_list(1, allow_empty=False), default=(1, 4, 16, 64),
                   help="concurrencies of the engine rows' sweep, comma-separated (default 1,4,16,64)")
    p.add_argument("--quant-file", default=None, help="the int4 model: a .safetensors written by `python -m minillm "
                   "quantize` (e.g. --quant awq+gptq --bits 4 --group-size 32 --quant-head int8); default: RTN, "
                   "groups of 32, int8 output layer, quantized here")
    p.add_argument("--no-speculation", action="store_true", help="leave out row 6 (prompt lookup in the engine) and "
                   "its variant (the int4 copy drafting for the float target)")
    p.add_argument("--figure", default=None, help="also draw tokens/s against memory into this PNG")
    p.set_defaults(func=cmd_bench_stack, measures_speed=True)
