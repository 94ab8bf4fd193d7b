"""``python -m minillm tour``: every technique against its naive baseline on the embedded model, as
one table (measured in one process, so that the ratios hold whatever the machine's minute)."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

from ..data import BENCH_PROMPT
from ..fast import plain_copy
from ..files import check_output_path, runs_folder
from ..generation import generate, generate_cached, generate_naive
from ..options import add_model_args, at_least, is_quantized_file, load, print_json
from ..quant import Recipe
from ..quant.pipeline import quantize_model
from ..sampling_params import SamplingParams
from ..timing import dtype_name, machine
from .decode import plot_step_times
from .serve_bench import _greedy, make_requests, run_engine, run_sequential
from .spec import SPEC_WORKLOADS, compare_once


def tour(model, tokenizer, *, new_tokens: int = 128, prompt: str = BENCH_PROMPT, figures: str | Path | None = None,
         quantized: bool = False) -> dict:
    """Every technique so far against its naive baseline on the embedded model, as one table: naive vs
    KV-cached generation (contiguous, dynamic, int8), the paged engine vs one request at a time
    (``engine_row``), n-gram speculative decoding vs plain cached decoding on an input-grounded chat
    prompt, and 4-bit weights (RTN, group 64, the int4 kernel) vs float32 weights, which ``quantized``
    (a model that ``quantize`` wrote) leaves out. Writes tour_decode_step_time.png into ``figures``
    (default ``runs_folder()``: figures/runs, git-ignored).
    """
    figures = Path(figures) if figures is not None else runs_folder()
    prompt_tokens = tokenizer.encode(prompt)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    generate_cached(model, prompt_tokens, SamplingParams(max_new_tokens=4))  # warm-up
    naive = generate_naive(model, prompt_tokens, params)
    cached = generate_cached(model, prompt_tokens, params)
    rows = [{
        "technique": "KV cache (contiguous)",
        "baseline": "recompute the sequence every step",
        "baseline_tokens_per_s": naive.decode_tokens_per_s,
        "tokens_per_s": cached.decode_tokens_per_s,
        "speedup": cached.decode_tokens_per_s / naive.decode_tokens_per_s,
        "check": "greedy tokens identical" if naive.tokens == cached.tokens else "TOKENS DIFFER",
    }]
    for name, kwargs in (("KV cache (dynamic)", {"cache": "dynamic"}),
                         ("KV cache (int8)", {"cache": "contiguous", "kv_dtype": "int8"})):
        r = generate(model, prompt_tokens, params, **kwargs)
        same = sum(a == b for a, b in zip(r.tokens, naive.tokens))
        rows.append({
            "technique": name, "baseline": "recompute the sequence every step",
            "baseline_tokens_per_s": naive.decode_tokens_per_s, "tokens_per_s": r.decode_tokens_per_s,
            "speedup": r.decode_tokens_per_s / naive.decode_tokens_per_s,
            "check": "greedy tokens identical" if same == len(naive.tokens) else f"{same}/{len(naive.tokens)} greedy tokens equal",
        })
    if model.accelerated:
        rows.append(kernels_row(model, prompt_tokens, params, cached))
    rows.append(engine_row(model, tokenizer, new_tokens))
    rows.append(speculative_row(model, tokenizer, new_tokens))
    if not quantized:
        rows.append(quantization_row(model, prompt_tokens, params, cached))
    fig = plot_step_times(naive.step_s, cached.step_s, len(prompt_tokens), Path(figures) / "tour_decode_step_time.png")
    return {"machine": machine(), "dtype": dtype_name(model.dtype), "prompt_tokens": len(prompt_tokens),
            "new_tokens": new_tokens, "rows": rows, "figures": [str(fig)]}


def kernels_row(model, prompt_tokens, params, cached) -> dict:
    """The tour's speed-layer row: the same cached decode on the library's plain torch (``fast.plain_copy``: the
    same weights, ``F.linear``, torch's norms and SDPA) vs with minillm's CPU kernels swapped in (``model``)."""
    plain = plain_copy(model)
    generate_cached(plain, prompt_tokens, SamplingParams(max_new_tokens=4))  # warm-up
    r = generate_cached(plain, prompt_tokens, params)
    same = sum(a == b for a, b in zip(r.tokens, cached.tokens))
    return {"technique": "minillm's CPU kernels (minillm.fast)", "baseline": "plain torch, cached decode",
            "baseline_tokens_per_s": r.decode_tokens_per_s, "tokens_per_s": cached.decode_tokens_per_s,
            "speedup": cached.decode_tokens_per_s / r.decode_tokens_per_s,
            "check": "greedy tokens identical" if same == len(r.tokens) else f"{same}/{len(r.tokens)} greedy tokens equal"}


def engine_row(model, tokenizer, new_tokens: int = 128, num_requests: int = 8) -> dict:
    """The tour's engine row: ``num_requests`` prompts cut from a play (ShareGPT-like prompt lengths x 1/4),
    each generating ``new_tokens`` greedy tokens, through the engine vs one at a time with ``generate_cached``
    (output tokens/s over the wall time of all of them, ``minillm.lab.serve_bench``'s modes); the check
    compares their greedy tokens."""
    reqs = [replace(r, max_tokens=new_tokens) for r in make_requests(tokenizer, num_requests)]
    generate_cached(model, reqs[0].prompt_token_ids, _greedy(2))  # warm-up
    seq = run_sequential(model, reqs)
    eng = run_engine(model, reqs, max_num_seqs=num_requests)
    same = sum(a == b for a, b in zip(seq["tokens"], eng["tokens"]))
    return {"technique": "paged engine (continuous batching)",
            "baseline": f"one request at a time, {num_requests} requests",
            "baseline_tokens_per_s": seq["output_tokens_per_s"], "tokens_per_s": eng["output_tokens_per_s"],
            "speedup": eng["output_tokens_per_s"] / seq["output_tokens_per_s"],
            "check": "greedy tokens identical" if same == num_requests else f"{same}/{num_requests} requests' greedy tokens equal"}


def speculative_row(model, tokenizer, new_tokens: int) -> dict:
    """The tour's speculative-decoding row: prompt lookup (gamma 4) vs plain cached decoding, greedy,
    on the "rewrite" workload of ``bench spec`` (the answer copies the prompt), via ``compare_once``."""
    ids = tokenizer.encode_chat(SPEC_WORKLOADS["rewrite (input-grounded)"])
    r = compare_once(model, tokenizer, ids, SamplingParams(max_new_tokens=new_tokens), gamma=4)
    return {"technique": "speculative (n-gram)", "baseline": "cached decode, rewrite a passage",
            "baseline_tokens_per_s": r["plain_tokens_per_s"], "tokens_per_s": r["spec_tokens_per_s"],
            "speedup": r["measured_speedup"],
            "check": f"greedy tokens identical, alpha {r['alpha']:.2f}" if r["same_tokens"] else "TOKENS DIFFER"}


def quantization_row(model, prompt_tokens, params, cached) -> dict:
    """The tour's quantization row: the same cached decode with every block's linear layers in 4 bits
    (RTN, group 64: no calibration, so the tour stays quick; GPTQ/AWQ change accuracy, not speed) run by
    the int4 kernel, vs the float32 model. The check counts greedy tokens equal to the float model's."""
    q = copy.deepcopy(model)
    quantize_model(q, Recipe.of("rtn", bits=4, group_size=64), progress=False)
    generate_cached(q, prompt_tokens, SamplingParams(max_new_tokens=4))  # warm-up
    r = generate_cached(q, prompt_tokens, params)
    same = next((i for i, (a, b) in enumerate(zip(r.tokens, cached.tokens)) if a != b), len(r.tokens))
    return {"technique": "int4 weights (RTN g64)", "baseline": "float32 weights, cached decode",
            "baseline_tokens_per_s": cached.decode_tokens_per_s, "tokens_per_s": r.decode_tokens_per_s,
            "speedup": r.decode_tokens_per_s / cached.decode_tokens_per_s,
            "check": f"first {same}/{len(r.tokens)} greedy tokens equal float's"}


def format_tour(report: dict) -> str:
    rows = report["rows"]
    t = max([len("technique")] + [len(r["technique"]) for r in rows])  # each column as wide as its longest entry
    b = max([len("baseline")] + [len(r["baseline"]) for r in rows])
    lines = [f"machine: {report['machine']}",
             f"dtype {report['dtype']}, batch 1, prompt {report['prompt_tokens']} tokens, "
             f"{report['new_tokens']} new tokens, greedy",
             f"{'technique':{t}s} {'baseline':{b}s} {'base tok/s':>10s} {'tok/s':>8s} {'speedup':>8s}  check"]
    for r in rows:
        lines.append(f"{r['technique']:{t}s} {r['baseline']:{b}s} {r['baseline_tokens_per_s']:10.1f} "
                     f"{r['tokens_per_s']:8.1f} {r['speedup']:7.1f}x  {r['check']}")
    lines.append("figures: " + ", ".join(report["figures"]))
    return "\n".join(lines)


def cmd_tour(args) -> int:
    if args.out is not None:
        check_output_path(args.out, "--out", folder=True)  # before minutes of measuring
    model, tokenizer = load(args)
    report = tour(model, tokenizer, new_tokens=args.new_tokens, figures=args.out,
                  quantized=is_quantized_file(args.model))
    print_json(report) if args.json else print(format_tour(report))
    return 0


def register(sub) -> None:
    """Add ``tour`` under ``sub``."""
    t = sub.add_parser("tour", help="every technique vs its naive baseline on the embedded model")
    t.add_argument("--new-tokens", type=at_least(2), default=128)
    t.add_argument("--out", default=None, help=f"folder for its figure (default: $MINILLM_FIGURES, else "
                   f"{runs_folder()}, which git ignores)")
    add_model_args(t)
    t.set_defaults(func=cmd_tour, measures_speed=True)
