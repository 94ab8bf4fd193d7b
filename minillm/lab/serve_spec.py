"""``serve-bench --spec ngram|draft``: the plain engine against the speculative engine, in one process on
the same requests, at each concurrency (requests kept in flight at that number).

Traces: "copy" asks the model to rewrite a passage of a play (prompt lookup finds its drafts in the
prompt), "chat" asks open-ended questions (it does not), "mixed" alternates them. Every request is
greedy, so both engines emit the same tokens (the command checks it) and only the time differs.
Reported per concurrency: output tokens/s, TPOT p50/p99, the mean acceptance length, and the ratio
to the plain engine; a figure of the speedup against concurrency per draft length.
"""

from __future__ import annotations

import time

import numpy as np

from ..data import HELD_OUT_PLAY, play_text
from ..files import runs_folder
from ..loading import load_model
from ..options import check_model_path, load, print_json
from ..paged.engine import LLMEngine
from ..sampling_params import SamplingParams
from ..timing import dtype_name, machine
from .serve_bench import median_run

SPEC_TRACES = ("copy", "chat", "mixed")
COPY_ASKS = ["Rewrite the following passage in modern English, keeping every line:",
             "Fix the spelling and punctuation of this passage and return it in full:",
             "Copy this passage exactly, then stop:"]
CHAT_ASKS = ["Write a short story about a lighthouse keeper.", "Explain how a refrigerator works.",
             "What should I pack for a week of hiking in the mountains?", "Give me three ideas for a birthday party.",
             "Why is the sky blue?", "Describe your ideal weekend.", "How do I start learning to paint?",
             "Write a poem about autumn rain."]


def spec_requests(tokenizer, trace: str, num: int, max_tokens: int, passage_tokens: int = 96,
                  seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request, through the model's chat template; passages are cut at
    seeded offsets from a held-out play."""
    if trace not in SPEC_TRACES:
        raise ValueError(f"--trace: with --spec, one of {SPEC_TRACES}, got {trace!r}")
    rng = np.random.default_rng(seed)
    text = tokenizer.encode(play_text(HELD_OUT_PLAY))
    reqs = []
    for i in range(num):
        copy = trace == "copy" or (trace == "mixed" and i % 2 == 0)
        if copy:
            start = int(rng.integers(0, len(text) - passage_tokens))
            content = f"{COPY_ASKS[i % len(COPY_ASKS)]}\n\n{tokenizer.decode(text[start:start + passage_tokens])}"
        else:
            content = CHAT_ASKS[i % len(CHAT_ASKS)]
        reqs.append((tokenizer.apply_chat_template([{"role": "user", "content": content}]), max_tokens))
    return reqs


def run_at_concurrency(engine: LLMEngine, reqs, concurrency: int) -> dict:
    """Keep ``concurrency`` requests in flight until all are done; tokens, times and TPOTs."""
    pending, live, outs = list(enumerate(reqs)), 0, {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and live < concurrency:
            i, (ids, n) = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": ids}, SamplingParams(max_tokens=n, ignore_eos=True))
            live += 1
        for out in engine.step():
            if out.finished:
                outs[int(out.request_id)] = out
                live -= 1
    wall = time.perf_counter() - start
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outs.values() if len(o.outputs[0].token_ids) > 1]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs.values())
    spec = engine.stats.spec_decoding
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "tpot_p50_ms": 1e3 * float(np.percentile(tpot, 50)),
            "tpot_p99_ms": 1e3 * float(np.percentile(tpot, 99)), "steps": engine.stats.steps,
            "acceptance_length": spec.mean_acceptance_length if spec else None,
            "acceptance_rate": spec.acceptance_rate if spec else None,
            "outputs": [outs[i].outputs[0].token_ids for i in sorted(outs)]}


def serve_spec(model, tokenizer, *, spec: str = "ngram", ks=(4,), draft=None, trace: str = "copy",
               concurrency=(1, 4, 16, 64), requests_per_seq: int = 2, min_requests: int = 4, max_tokens: int = 64,
               passage_tokens: int = 96, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3, repeats: int = 1,
               progress: bool = True) -> dict:
    """Plain and speculative engines on the same requests at each concurrency; the report (JSON-ready).

    With ``repeats`` > 1 the plain engine and every k run in turn that many times: each row keeps the run of
    median tokens/s (``tok_s_runs`` lists all), and its speedup is the median of the ratios to the plain run
    of the same turn (a turn's runs are seconds apart; the machine's speed drifts over minutes).

    Raises:
        ValueError: --spec draft without a draft model; a speculative engine whose tokens differ.
    """
    if spec == "draft" and draft is None:
        raise ValueError("--draft-model: --spec draft needs a draft model (a path load_model takes)")
    rows = []
    for c in concurrency:
        reqs = spec_requests(tokenizer, trace, max(min_requests, requests_per_seq * c), max_tokens, passage_tokens)
        runs = {"plain": [], **{str(k): [] for k in ks}}
        for turn in range(repeats):
            plain = run_at_concurrency(LLMEngine(model, tokenizer, max_num_seqs=c), reqs, c)
            runs["plain"].append(plain)
            for k in ks:
                config = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": prompt_lookup_min,
                           "prompt_lookup_max": prompt_lookup_max} if spec == "ngram"
                          else {"method": "draft_model", "model": draft, "num_speculative_tokens": k})
                engine = LLMEngine(model, tokenizer, max_num_seqs=c, speculative_config=config)
                res = run_at_concurrency(engine, reqs, c)
                if res["outputs"] != plain["outputs"]:
                    raise ValueError(f"speculative engine (k={k}, concurrency {c}) emitted other tokens than the "
                                     "plain engine; this is a bug, please report it")
                runs[str(k)].append(res)
                if progress:
                    print(f"  concurrency {c:>3}  k={k!s:<4}  plain {plain['tok_s']:7.1f} tok/s  spec "
                          f"{res['tok_s']:7.1f} tok/s  x{res['tok_s'] / plain['tok_s']:.2f}  acceptance length "
                          f"{res['acceptance_length']:.2f}" + (f"  (turn {turn + 1}/{repeats})" if repeats > 1 else ""),
                          flush=True)
        plains = runs.pop("plain")
        row = {"concurrency": c, "requests": len(reqs), "plain": _median(plains), "spec": {}}
        for k, rs in runs.items():  # each turn's run over the plain run of the same turn
            speedup = float(np.median([r["tok_s"] / p["tok_s"] for r, p in zip(rs, plains)]))
            row["spec"][k] = dict(_median(rs), speedup=speedup)
        rows.append(row)
    return {"spec": spec, "trace": trace, "ks": [str(k) for k in ks], "max_tokens": max_tokens, "repeats": repeats,
            "dtype": dtype_name(model.dtype), "machine": machine(), "rows": rows}


def _median(rs: list[dict]) -> dict:
    """The run of median tokens/s (the lower middle of an even count), with every run's tokens/s."""
    return _public(median_run(rs, "tok_s"))


def _public(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "outputs"}


def format_spec_report(report: dict) -> str:
    turns = report.get("repeats", 1)
    lines = [f"serve-bench --spec {report['spec']} --trace {report['trace']} (greedy, {report['max_tokens']} tokens "
             f"each; {report['machine']})" + (f"; medians of {turns} turns, x the median of each turn's ratio"
                                               if turns > 1 else ""),
             f"{'conc':>4} {'k':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'x':>5} {'TPOT p50/p99 ms (plain)':>24} "
             f"{'TPOT p50/p99 ms (spec)':>23} {'accept len':>10} {'fewer steps':>11} {'step cost':>9}"]
    for row in report["rows"]:
        p = row["plain"]
        for k, s in row["spec"].items():
            fewer = p["steps"] / s["steps"]  # x = fewer steps / what a speculative step costs against a plain one
            lines.append(f"{row['concurrency']:>4} {k:>5} {p['tok_s']:>11.1f} {s['tok_s']:>10.1f} {s['speedup']:>5.2f} "
                         f"{p['tpot_p50_ms']:>11.1f}/{p['tpot_p99_ms']:<11.1f} {s['tpot_p50_ms']:>11.1f}/"
                         f"{s['tpot_p99_ms']:<10.1f} {s['acceptance_length']:>10.2f} {fewer:>10.2f}x "
                         f"{fewer / s['speedup']:>8.2f}x")
    lines.append("fewer steps: the plain engine's steps over the speculative one's (the speedup if a step with drafts "
                 "cost a plain one); step cost: what a step with drafts and draft forwards costs against a plain one"
                 + (" (the steps of each row's run of median tokens/s)" if turns > 1 else ""))
    return "\n".join(lines)


def plot_speedup(report: dict, path) -> None:
    """The speedup over the plain engine against concurrency, one line per draft length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    cs = [r["concurrency"] for r in report["rows"]]
    for k in report["ks"]:
        ax.plot(cs, [r["spec"][k]["speedup"] for r in report["rows"]], marker="o", label=f"k = {k}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s, speculative / plain")
    ax.set_title(f"Speculation in the batch: {report['spec']}, {report['trace']} trace")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def spec_lengths(text: str) -> list:
    """--num-speculative-tokens: "4", "auto" or a comma list ("2,4,auto")."""
    ks = []
    for part in text.split(","):
        part = part.strip()
        if part == "auto":
            ks.append(part)
        elif part.isdigit() and int(part) >= 1:
            ks.append(int(part))
        else:
            raise ValueError(f"--num-speculative-tokens: each value is an integer >= 1 or 'auto', got {part!r}")
    return ks


def cmd_serve_spec(args) -> int:
    """``serve-bench --spec``: refuse bad options first, then run, print (``--json``) and draw the figure."""
    ks = spec_lengths(args.num_speculative_tokens)
    trace = args.trace if args.trace in SPEC_TRACES else "copy"
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.spec == "draft" and not args.draft_model:
        raise ValueError("--draft-model: --spec draft needs a draft model (any file load_model takes, e.g. the int4 "
                         "file of python -m minillm quantize)")
    check_model_path(args.draft_model, "--draft-model")  # before the target is loaded
    model, tokenizer = load(args)
    draft = load_model(args.draft_model, dtype=model.dtype, device=model.device)[0] if args.draft_model else None
    report = serve_spec(model, tokenizer, spec=args.spec, ks=ks, draft=draft, trace=trace, concurrency=concurrency,
                        max_tokens=args.spec_max_tokens, passage_tokens=min(96, model.config.max_seq_len // 8),
                        repeats=args.spec_repeats, progress=not args.json)
    folder = runs_folder()
    folder.mkdir(parents=True, exist_ok=True)
    plot_speedup(report, folder / f"serve_spec_{args.spec}_{trace}.png")
    if args.json:
        print_json(report)
    else:
        print(format_spec_report(report))
    return 0
