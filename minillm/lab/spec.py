"""``python -m minillm bench spec``: plain cached decoding vs speculative decoding on chat workloads, with the
speedup predicted from measured alpha, draft cost and verify cost beside the measured one, and a
sweep over gamma (num_speculative_tokens).

Measuring rules as ``minillm.timing``: a warm-up, several repeats (the median), same prompts and
same (greedy) settings for both paths, and the machine, dtype, batch size and lengths printed.
"""

from __future__ import annotations

import statistics

from tqdm.auto import tqdm

from ..generation import generate_cached
from ..options import add_model_args, at_least, int_list, load, print_json
from ..sampling_params import SamplingParams
from ..timing import dtype_name, machine, measure_verify
from ..speculative.decode import predicted_speedup, speculative_generate
from ..speculative.proposers import DraftModelProposer, NgramProposer
from ..speculative.cli import check_draft, load_draft
from ..speculative.rejection import expected_tokens_per_pass, leviathan_speedup

PASSAGE = ("The old lighthouse keeper climbed the spiral stairs every evening to light the great lamp. Ships passed "
           "safely by the rocks all night, and in the morning he walked down to the harbour to talk with the "
           "fishermen about the weather and the sea.")
MISSPELLED = ("The old lighthose keeper climbed the spiral stares every evening to light the grate lamp. Ships passed "
              "safly by the rocks all night, and in the morning he walked down to the harbor to talk with the "
              "fishermen about the wether and the sea.")
SPEC_WORKLOADS = {
    "story (open-ended)": "Write a short story about a lighthouse keeper.",
    "chat answer": "What are three benefits of regular exercise?",
    "rewrite (input-grounded)": f"Rewrite the following passage, keeping every word: {PASSAGE}",
    "fix spelling (input-grounded)": f"Correct the spelling mistakes in this paragraph and write it out in full: "
                                     f"{MISSPELLED}",
    "summarise (input-grounded)": f"Summarise this passage in one sentence, reusing its words: {PASSAGE}",
    "shorten (input-grounded)": f"Shorten this passage by removing the second sentence: {PASSAGE}",
    "edit code (input-grounded)": "Rename the variable x to total in this code and show the whole code:\n```python\n"
                                  "def add_all(numbers):\n    x = 0\n    for n in numbers:\n        x = x + n\n"
                                  "    return x\n```",
}
INPUT_GROUNDED = [name for name in SPEC_WORKLOADS if "input-grounded" in name]


def make_proposer(model, draft=None):
    """A fresh proposer: prompt lookup for ``draft=None``, else a ``DraftModelProposer`` on ``draft``."""
    if draft is None:
        return NgramProposer(model.config.vocab_size)
    return DraftModelProposer(draft, model.config.max_seq_len)


def compare_once(model, tokenizer, prompt_ids, params, gamma, draft=None, repeats=1, verify=None, draft_cost=0.0):
    """Plain cached decoding and speculative decoding on one prompt: the median tokens/s of each over
    ``repeats`` runs, and the prediction of ``predicted_speedup`` from the last speculative run."""
    plain = [generate_cached(model, prompt_ids, params, tokenizer=tokenizer) for _ in range(repeats)]
    spec = [speculative_generate(model, make_proposer(model, draft), prompt_ids, params, num_speculative_tokens=gamma,
                                 tokenizer=tokenizer) for _ in range(repeats)]
    plain_tps = statistics.median(r.decode_tokens_per_s for r in plain)
    spec_tps = statistics.median(r.decode_tokens_per_s for r, _ in spec)
    st = spec[-1][1]
    verify = verify or measure_verify(model, ks=range(1, gamma + 2))
    pred = predicted_speedup(st, verify, draft_cost)
    return {
        "plain_tokens_per_s": plain_tps, "spec_tokens_per_s": spec_tps, "measured_speedup": spec_tps / plain_tps,
        "tokens": plain[-1].tokens, "new_tokens": len(plain[-1].tokens),
        "same_tokens": all(r.tokens == plain[-1].tokens for r, _ in spec),
        "alpha": st.alpha, "acceptance_rate": st.acceptance_rate, "acceptance_by_position": st.acceptance_by_position(),
        "drafted": st.drafted, "accepted": st.accepted, "emitted": st.emitted,
        "passes": len(st.drafted), "mean_drafted": sum(st.drafted) / len(st.drafted),
        "passes_without_draft": sum(k == 0 for k in st.drafted) / len(st.drafted),
        "tokens_per_target_pass": st.tokens_per_target_pass,
        "draft_s_per_pass": sum(st.draft_s) / len(st.drafted), "verify_s_per_pass": sum(st.verify_s) / len(st.drafted),
        "expected_tokens_per_pass": expected_tokens_per_pass(st.alpha, gamma),
        "leviathan_speedup": leviathan_speedup(st.alpha, gamma, draft_cost),
        "leviathan_speedup_with_verify_cost": expected_tokens_per_pass(st.alpha, gamma)
        / (verify[gamma + 1] / verify[1] + gamma * draft_cost),
        **pred,
    }


def draft_cost_ratio(model, draft, repeats: int = 5) -> float:
    """c: seconds of one draft decode step / seconds of one target decode step (batch 1, measured)."""
    return measure_verify(draft, ks=(1,), repeats=repeats)[1] / measure_verify(model, ks=(1,), repeats=repeats)[1]


def bench_spec(model, tokenizer, *, num_speculative_tokens: int = 4, new_tokens: int = 64, repeats: int = 1,
               draft=None, draft_name: str = "ngram", workloads=None, verify_s=None, progress: bool = True) -> dict:
    """Plain cached decoding vs speculative decoding, greedy, batch 1, on ``SPEC_WORKLOADS``.

    Args:
        draft: None for n-gram prompt lookup (Saxena 2023), or a draft ``Decoder`` sharing the tokenizer.
        workloads: names of SPEC_WORKLOADS to run (default: all).
        verify_s: {k: seconds of a target forward over k tokens} for k = 1..gamma+1, measured before
            (``timing.measure_verify``), so that several reports predict from one measurement; default:
            measured here.

    Returns:
        dict: machine, dtype, proposer, num_speculative_tokens, new_tokens, repeats, verify_s ({k:
        seconds of a target forward over k tokens}, k = 1..gamma+1), draft_cost_ratio (c), and rows:
        per workload the greedy answer (tokens), tokens/s of both paths, measured speedup, alpha,
        drafted / accepted / emitted per pass, acceptance per position, tokens per pass, share of
        passes without a draft, and the predicted speedups: proposer-aware (``predicted_speedup``, from the measured tokens per pass and from
        alpha) and Leviathan et al.'s closed form (Theorem 3.8; with and without the measured verify
        cost).
    """
    gamma = num_speculative_tokens
    params = SamplingParams(max_new_tokens=new_tokens)  # stop at the end of the answer, as a user would
    generate_cached(model, tokenizer.encode("warm up"), SamplingParams(max_new_tokens=4))
    verify = verify_s or measure_verify(model, ks=range(1, gamma + 2))
    c = 0.0 if draft is None else draft_cost_ratio(model, draft)
    rows = []
    for name in tqdm(workloads or list(SPEC_WORKLOADS), desc="bench spec", disable=not progress, leave=False):
        ids = tokenizer.encode_chat(SPEC_WORKLOADS[name])
        rows.append({"workload": name, "prompt_tokens": len(ids),
                     **compare_once(model, tokenizer, ids, params, gamma, draft, repeats, verify, c)})
    return {"machine": machine(), "dtype": dtype_name(model.dtype), "proposer": draft_name,
            "num_speculative_tokens": gamma, "new_tokens": new_tokens, "repeats": repeats,
            "verify_s": verify, "verify_cost_ratio": verify[gamma + 1] / verify[1], "draft_cost_ratio": c, "rows": rows}


def sweep_gamma(model, tokenizer, *, gammas=(1, 2, 3, 4, 6, 8), workloads=None, new_tokens: int = 64,
                repeats: int = 1, draft=None, verify_s=None, progress: bool = True) -> dict:
    """Measured and predicted (proposer-aware) speedup for each gamma on each workload (default:
    the input-grounded ones), and the best gamma of each. The plain path runs once per workload.
    ``verify_s`` as ``bench_spec``'s (k = 1..max(gammas)+1; default: measured here).

    Returns:
        dict: verify_s, draft_cost_ratio, rows (workload, gamma, measured_speedup, predicted_speedup,
        predicted_speedup_after_first_token, passes, first_pass_tokens, alpha, tokens_per_target_pass,
        same_tokens) and best ({workload: {"measured": gamma,
        "predicted": gamma}}).
    """
    params = SamplingParams(max_new_tokens=new_tokens)
    generate_cached(model, tokenizer.encode("warm up"), SamplingParams(max_new_tokens=4))
    verify = verify_s or measure_verify(model, ks=range(1, max(gammas) + 2))
    c = 0.0 if draft is None else draft_cost_ratio(model, draft)
    rows, best = [], {}
    jobs = [(w, g) for w in (workloads or INPUT_GROUNDED) for g in gammas]
    plain = {}
    for name, gamma in tqdm(jobs, desc="sweep gamma", disable=not progress, leave=False):
        ids = tokenizer.encode_chat(SPEC_WORKLOADS[name])
        if name not in plain:
            runs = [generate_cached(model, ids, params, tokenizer=tokenizer) for _ in range(repeats)]
            plain[name] = (statistics.median(r.decode_tokens_per_s for r in runs), runs[-1].tokens)
        spec = [speculative_generate(model, make_proposer(model, draft), ids, params, num_speculative_tokens=gamma,
                                     tokenizer=tokenizer) for _ in range(repeats)]
        st = spec[-1][1]
        pred = predicted_speedup(st, verify, c)
        rows.append({"workload": name, "gamma": gamma,
                     "measured_speedup": statistics.median(r.decode_tokens_per_s for r, _ in spec) / plain[name][0],
                     "predicted_speedup": pred["predicted_speedup"],
                     "predicted_speedup_after_first_token": pred["predicted_speedup_after_first_token"],
                     "passes": len(st.drafted), "first_pass_tokens": st.emitted[0],
                     "alpha": st.alpha, "tokens_per_target_pass": st.tokens_per_target_pass,
                     "same_tokens": all(r.tokens == plain[name][1] for r, _ in spec)})
    for name in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == name]
        best[name] = {key: max(mine, key=lambda r: r[f"{key}_speedup"])["gamma"] for key in ("measured", "predicted")}
    return {"machine": machine(), "dtype": dtype_name(model.dtype), "new_tokens": new_tokens,
            "repeats": repeats, "verify_s": verify, "draft_cost_ratio": c, "rows": rows, "best": best}


def format_spec(report: dict) -> str:
    v = report["verify_s"]
    lines = [f"machine: {report['machine']}",
             f"dtype {report['dtype']}, batch 1, greedy, up to {report['new_tokens']} new tokens (stop at EOS), "
             f"{report['proposer']} drafts, gamma {report['num_speculative_tokens']}, median of {report['repeats']}; "
             f"draft cost c = {report['draft_cost_ratio']:.3f}",
             "verify cost (target forward over k tokens / one decode step): "
             + ", ".join(f"k={k}: {s / v[1]:.2f}" for k, s in v.items()),
             f"{'workload':30s} {'tokens':>6s} {'plain tok/s':>11s} {'spec tok/s':>10s} {'alpha':>5s} {'no-draft':>8s} "
             f"{'tok/pass':>8s} {'cost/pass':>9s} {'Leviathan':>9s} {'predicted':>9s} {'measured':>8s}  same tokens"]
    for r in report["rows"]:
        lines.append(f"{r['workload']:30s} {r['new_tokens']:6d} {r['plain_tokens_per_s']:11.1f} "
                     f"{r['spec_tokens_per_s']:10.1f} {r['alpha']:5.2f} {r['passes_without_draft']:8.0%} "
                     f"{r['tokens_per_target_pass']:8.2f} {r['cost_per_pass']:9.2f} {r['leviathan_speedup']:8.2f}x "
                     f"{r['predicted_speedup']:8.2f}x {r['measured_speedup']:7.2f}x  {r['same_tokens']}")
    lines.append("no-draft: passes where the proposer drafted nothing; cost/pass in decode steps; Leviathan: "
                 "(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)); predicted: tokens per pass / cost per pass")
    return "\n".join(lines)


def format_sweep(report: dict) -> str:
    lines = [f"machine: {report['machine']}", f"dtype {report['dtype']}, batch 1, greedy, up to "
             f"{report['new_tokens']} new tokens, median of {report['repeats']}",
             f"{'workload':30s} {'gamma':>5s} {'alpha':>5s} {'tok/pass':>8s} {'predicted':>9s} {'measured':>8s}  same"]
    for r in report["rows"]:
        lines.append(f"{r['workload']:30s} {r['gamma']:5d} {r['alpha']:5.2f} {r['tokens_per_target_pass']:8.2f} "
                     f"{r['predicted_speedup']:8.2f}x {r['measured_speedup']:7.2f}x  {r['same_tokens']}")
    for name, b in report["best"].items():
        lines.append(f"best gamma, {name}: predicted {b['predicted']}, measured {b['measured']}")
    return "\n".join(lines)


def cmd_bench_spec(args) -> int:
    if args.draft != "ngram":
        check_draft(args.draft)
    model, tokenizer = load(args)
    draft = None if args.draft == "ngram" else load_draft(args, model)
    report = bench_spec(model, tokenizer, num_speculative_tokens=args.num_speculative_tokens,
                        new_tokens=args.new_tokens, repeats=args.repeats, draft=draft, draft_name=args.draft,
                        progress=not args.json)
    if args.gammas:
        report["sweep"] = sweep_gamma(model, tokenizer, gammas=args.gammas, new_tokens=args.new_tokens,
                                      repeats=args.repeats, draft=draft, progress=not args.json)
    if args.json:
        print_json(report)
        return 0
    print(format_spec(report))
    if args.gammas:
        print(format_sweep(report["sweep"]))
    return 0


def register(bench) -> None:
    """Add ``bench spec`` under ``bench``'s subparsers."""
    bs = bench.add_parser("spec", help="plain cached decode vs speculative decoding on workloads, predicted and measured")
    bs.add_argument("--num-speculative-tokens", type=at_least(1), default=4)
    bs.add_argument("--new-tokens", type=at_least(2), default=64)
    bs.add_argument("--repeats", type=at_least(1), default=1)
    bs.add_argument("--draft", default="ngram", help="'ngram' (prompt lookup, default) or a draft model path")
    bs.add_argument("--gammas", type=int_list(1), default=None,
                    help="also sweep gamma on the input-grounded workloads, e.g. 1,2,3,4,6,8")
    add_model_args(bs)
    bs.set_defaults(func=cmd_bench_spec, measures_speed=True)
