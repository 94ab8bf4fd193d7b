"""Command line: ``python -m minillm <command>``.

Commands: generate, bench decode | spec | quant | stack, distill-draft, roofline, perplexity, quantize, tour,
fragmentation, serve-bench, serve, exercises. ``generate`` and ``bench decode`` are here; the others register
themselves with ``set_defaults(func=...)``: the technique folders' commands (``quant.cli``: perplexity,
quantize; ``speculative.cli``: distill-draft; ``roofline.cli``), the lab's benchmarks (``lab.tour``,
``lab.spec``, ``lab.quant``, ``lab.stack``, ``lab.fragmentation``, ``lab.serve_bench_cli``), ``server.cli`` and
``exercises.cli``; the options they share are in ``minillm.options``. Bad input exits with status 2 and a
message naming the option.

Other tools call these; the options and the JSON keys are kept stable.
"""

from __future__ import annotations

import argparse
import sys

from .exercises import cli as exercises_cli
from .files import sigterm_as_exit
from .formats import hf_export as export_hf_cli
from .generation import generate
from .stops import check_prompt
from .lab import fragmentation as fragmentation_cli
from .lab import quant as bench_quant_cli
from .lab import replay as trace_cli
from .lab import serve_bench_cli
from .lab import spec as bench_spec_cli
from .lab import products as bench_products_cli
from .lab import stack as bench_stack_cli
from .lab import tour as tour_cli
from .lab.background import background_load, check_load
from .lab.decode import bench_decode, format_bench
from .lab.llamacpp import bench_decode_llamacpp, format_bench_llamacpp
from .lab.peers import LLAMACPP_INSTALL, llamacpp_available
from .options import add_model_args, at_least, is_quantized_file, load, print_json
from .quant import cli as quant_cli
from .roofline import cli as roofline_cli
from .sampling_params import SamplingParams
from .server import cli as server_cli  # FastAPI loads only when `serve` runs
from .speculative import cli as speculative_cli
from .speculative import speculative_generate
from .timing import warn_if_busy


class StopStringPrinter:
    """Prints generated text as tokens arrive, holding back any tail that may still turn out to be
    the start of a stop string (so that a stop string is never shown, even in part).

    ``feed(token_id)`` prints what is safe so far; ``printed`` counts the characters printed.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], out=None):
        # sys.stdout as it is now, not at import: a caller may have redirected it (contextlib.redirect_stdout)
        self.tokenizer, self.stop, self.out = tokenizer, stop, sys.stdout if out is None else out
        self.decode = tokenizer.stream_decoder()
        self.text, self.printed = "", 0

    def safe_length(self) -> int:
        """Characters of ``text`` that no stop string can still claim."""
        safe = len(self.text)
        for stop in self.stop:
            hit = self.text.find(stop)
            if hit >= 0:
                safe = min(safe, hit)
            else:  # the longest suffix of the text that begins the stop string
                k = next((k for k in range(min(len(stop) - 1, len(self.text)), 0, -1)
                          if self.text.endswith(stop[:k])), 0)
                safe = min(safe, len(self.text) - k)
        return safe

    def feed(self, token_id: int) -> None:
        if token_id == self.tokenizer.eos_id:
            return
        self.text += self.decode(token_id)
        safe = self.safe_length()
        if safe > self.printed:
            self.out.write(self.text[self.printed:safe])
            self.out.flush()
            self.printed = safe


def check_generate_options(args) -> None:
    """The combinations ``generate`` refuses, checked before a model is loaded."""
    if args.kv_dtype and args.cache != "contiguous":
        raise ValueError(f"kv-dtype: int8 is implemented for the contiguous cache only, not --cache {args.cache}; "
                         "use --cache contiguous (the default)")
    if args.draft:
        if args.cache != "contiguous" or args.kv_dtype:
            raise ValueError("draft: speculative decoding uses the contiguous float cache; drop --cache/--kv-dtype")
        if args.draft != "ngram":
            speculative_cli.check_draft(args.draft)
    if not args.prompt:
        raise ValueError("prompt: is empty; give some text with --prompt")


def cmd_generate(args) -> int:
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed, stop=tuple(args.stop))
    check_generate_options(args)
    model, tokenizer = load(args)
    if tokenizer is None:
        raise ValueError(f"model: {args.model} has no byte-level BPE tokenizer.json, so text cannot be encoded")
    if args.chat:
        prompt_tokens = tokenizer.encode_chat(args.prompt)
    else:
        prompt_tokens = tokenizer.encode(args.prompt)
    try:  # the library's message names its argument, max_seq_len; here the user typed --max-seq-len
        check_prompt(model, prompt_tokens, args.max_seq_len)
    except ValueError as e:
        raise ValueError(str(e).replace("max_seq_len", "--max-seq-len")) from None
    printer = None if args.json else StopStringPrinter(tokenizer, params.stop)
    on_token = printer.feed if printer else None
    stats = None
    if args.draft:
        ctx = min(args.max_seq_len or model.config.max_seq_len, model.config.max_seq_len)
        result, stats = speculative_generate(model, speculative_cli.make_proposer(args, model, ctx), prompt_tokens, params,
                                             num_speculative_tokens=args.num_speculative_tokens,
                                             max_seq_len=args.max_seq_len, tokenizer=tokenizer, on_token=on_token)
    else:
        result = generate(model, prompt_tokens, params, cache=args.cache, kv_dtype=args.kv_dtype,
                          max_seq_len=args.max_seq_len, tokenizer=tokenizer, on_token=on_token)
    if args.json:
        print_json({
            "prompt_tokens": result.prompt_tokens, "tokens": result.tokens, "text": result.text,
            "finish_reason": result.finish_reason, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
            "decode_tokens_per_s": result.decode_tokens_per_s, "cache": args.cache, "kv_dtype": args.kv_dtype,
            "dtype": args.dtype, "device": args.device,
            **({"draft": args.draft, "num_speculative_tokens": args.num_speculative_tokens,
                "acceptance_rate": stats.acceptance_rate, "alpha": stats.alpha,
                "target_passes": len(stats.drafted), "tokens_per_target_pass": stats.tokens_per_target_pass}
               if stats else {}),
        })
        return 0
    print(result.text[printer.printed:])
    print(f"[{len(result.prompt_tokens)} prompt tokens, {len(result.tokens)} new, finish: {result.finish_reason}; "
          f"prefill {result.prefill_s:.3f} s, decode {result.decode_tokens_per_s:.1f} tokens/s, "
          f"cache {args.cache}]", file=sys.stderr)
    if stats:  # what speculation did: the same text as plain decoding, in fewer target passes
        print(f"[speculative, draft {args.draft}, gamma {args.num_speculative_tokens}: {len(stats.drafted)} target "
              f"passes, {stats.tokens_per_target_pass:.2f} tokens per pass, alpha {stats.alpha:.2f}, "
              f"acceptance rate {stats.acceptance_rate:.2f}]", file=sys.stderr)
    return 0


def cmd_bench_decode(args) -> int:
    check_load(args.background_load)
    if args.peer == "llamacpp":
        return _bench_decode_llamacpp(args)
    peer = not args.no_peer
    if peer and is_quantized_file(args.model):
        print(f"note: {args.model} is quantized by minillm; transformers cannot load it, so the peer is skipped "
              "(pass --no-peer to skip it silently)", file=sys.stderr)
        peer = False
    model, tokenizer = load(args)
    with background_load(args.background_load):  # stopped when the runs end, also on an error or Ctrl-C
        report = bench_decode(model, tokenizer, new_tokens=args.new_tokens, repeats=args.repeats,
                              peer=peer, model_path=args.model, progress=not args.json)
    report["background_load"] = args.background_load
    print_json(report) if args.json else print(format_bench(report))
    return 0


def _bench_decode_llamacpp(args) -> int:
    if args.no_peer:
        raise ValueError("peer: --peer llamacpp and --no-peer contradict each other; drop one")
    if not llamacpp_available():
        raise ValueError(f"peer: llamacpp needs the optional package llama-cpp-python: {LLAMACPP_INSTALL}")
    if is_quantized_file(args.model) or not (args.model or ".gguf").endswith(".gguf"):
        raise ValueError(f"model: --peer llamacpp runs llama.cpp and minillm on the same GGUF file; got {args.model!r}")
    if args.dtype != "float32":
        raise ValueError(f"dtype: --peer llamacpp quantizes the float32 model; drop --dtype {args.dtype}")
    model, tokenizer = load(args)
    with background_load(args.background_load):
        report = bench_decode_llamacpp(model, tokenizer, new_tokens=args.new_tokens, repeats=args.repeats,
                                       model_path=args.model, quant_head=args.quant_head, compile=not args.no_compile,
                                       int8_activations=not args.no_int8_activations, progress=not args.json)
    report["background_load"] = args.background_load
    print_json(report) if args.json else print(format_bench_llamacpp(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (streams as it goes)")
    g.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (ChatML)")
    g.add_argument("--max-new-tokens", type=at_least(1), default=64, help="tokens to generate at most (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                   "whose probability reaches this (default 1.0 = off)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (default: none, a new draw each run)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--cache", default="contiguous", choices=["none", "dynamic", "contiguous"],
                   help="none: recompute the sequence every step (the naive baseline); dynamic: a cache "
                        "grown by concatenation; contiguous: one preallocated buffer per layer (default)")
    g.add_argument("--kv-dtype", default=None, choices=["int8"], help="store the contiguous cache in int8")
    g.add_argument("--draft", default=None, help="speculative decoding: 'ngram' (prompt lookup) or a draft model path")
    g.add_argument("--num-speculative-tokens", type=at_least(1), default=4,
                   help="drafts per target pass (gamma; default 4)")
    g.add_argument("--max-seq-len", type=at_least(2), default=None, help="context to use (default: the model's)")
    add_model_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks")
    bench = b.add_subparsers(dest="bench", required=True)
    bd = bench.add_parser("decode", help="batch-1 decode tokens/s: naive, cached, transformers")
    bd.add_argument("--new-tokens", type=at_least(2), default=64)
    bd.add_argument("--repeats", type=at_least(1), default=3)
    bd.add_argument("--no-peer", action="store_true", help="skip the transformers measurement (skipped anyway "
                    "for a .safetensors file written by quantize, which transformers cannot read)")
    bd.add_argument("--peer", choices=["transformers", "llamacpp"], default="transformers",
                    help="transformers (default): the float paths beside transformers; llamacpp: minillm's float32 "
                         "and 4-bit paths beside llama.cpp on the same GGUF, interleaved, with bytes per token and "
                         f"the share of the measured bandwidth (needs the optional {LLAMACPP_INSTALL})")
    bd.add_argument("--quant-head", choices=["none", "int8", "int4"], default="int8",
                    help="--peer llamacpp: the output layer of the 4-bit paths (default int8: within 0.1%% of the "
                         "float head's perplexity; int4 is faster and 5.7%% worse, docs/decode.md)")
    bd.add_argument("--no-compile", action="store_true", help="--peer llamacpp: leave out the compiled 4-bit path")
    bd.add_argument("--no-int8-activations", action="store_true", help="--peer llamacpp: leave out the paths whose "
                    "4-bit layers take int8 activations (llama.cpp's recipe: integer dot products, x rounded per 32)")
    bd.add_argument("--background-load", type=at_least(0), default=0, metavar="N", help="run N CPU-bound processes "
                    "beside the benchmark (started and stopped by the command, at most 30 minutes): decode on a machine "
                    "that other programs share (default 0)")
    add_model_args(bd)
    bd.set_defaults(func=cmd_bench_decode, measures_speed=True)

    tour_cli.register(sub)
    roofline_cli.register(sub)
    bench_spec_cli.register(bench)
    bench_stack_cli.register(bench)
    bench_products_cli.register(bench)
    speculative_cli.register(sub)
    quant_cli.register(sub)
    bench_quant_cli.register(bench)
    fragmentation_cli.register(sub)
    serve_bench_cli.register(sub)
    trace_cli.register(sub)
    server_cli.register(sub)
    exercises_cli.register(sub)
    export_hf_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "measures_speed", False):
        warn_if_busy()
    try:
        with sigterm_as_exit():  # finally blocks run: a half-written file's temporary goes, background loads stop
            return args.func(args)
    except ValueError as e:  # ModelFileError included: bad input, named by the message
        print(f"error: {e}", file=sys.stderr)
        return 2
