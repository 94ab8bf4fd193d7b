"""``python -m minillm serve``: the OpenAI-compatible server (``minillm.server.app``) on uvicorn.

Ctrl-C or SIGTERM: uvicorn stops accepting connections, lets running requests finish for
``--shutdown-timeout`` seconds and cancels the rest (each cancelled request is aborted), then the engine
thread stops and the process exits with status 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from ..files import SIGTERM_STATUS
from ..options import add_model_args, at_least, load, print_json


def model_name(path: str | None) -> str:
    """The name the server answers to: the model file's stem, or the folder's name; for the embedded
    model, SmolLM2-135M-Instruct (its file's stem without the format)."""
    if path is None:
        from ..loading import default_model_path

        return default_model_path().stem.split(".")[0]
    return Path(path).stem if Path(path).suffix else Path(path).name


def build_engine(model, tokenizer, args):
    from ..paged import LLMEngine

    return LLMEngine(model, tokenizer, block_size=args.block_size, num_blocks=args.num_blocks,
                     max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                     max_seq_len=args.max_seq_len, enable_prefix_caching=not args.no_prefix_caching,
                     speculative_config=args.speculative_config, trace=args.trace_out)


def seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def json_object(text: str) -> dict:
    """argparse type: a JSON object (vLLM's --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def check_max_seq_len(max_seq_len: int | None, model) -> None:
    """Raises ValueError naming --max-seq-len when it is past the model's context (the engine would cap it)."""
    context = model.config.max_seq_len
    if max_seq_len is not None and max_seq_len > context:
        raise ValueError(f"--max-seq-len {max_seq_len} is past the model's context of {context} tokens; give at most "
                         f"{context} (or leave it out for the model's)")


def cmd_serve(args) -> int:
    """Load the model, start the engine thread and serve until interrupted; returns the exit code (0)."""
    import uvicorn

    from .app import create_app, engine_server
    from .loop import EngineLoop

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.trace_out is not None:
        from ..paged.trace import check_trace_path

        check_trace_path(args.trace_out)  # before loading: a bad path costs nothing
    model, tokenizer = load(args)
    check_max_seq_len(args.max_seq_len, model)
    engine = build_engine(model, tokenizer, args)
    name = args.served_model_name or model_name(args.model)
    loop = EngineLoop(engine, max_pending=args.max_num_seqs + args.max_queue)
    app = create_app(loop, name)

    def started(port: int) -> None:  # once bound: --port 0 takes a free port, and this is the one it took
        info = {"url": f"http://{args.host}:{port}/v1", "port": port, "model": name, "num_blocks": engine.num_blocks,
                "block_size": engine.block_size, "max_seq_len": engine.max_seq_len,
                "max_num_seqs": args.max_num_seqs, "max_queue": args.max_queue}
        if args.json:
            print_json(info)
        else:
            print(f"serving {name} at {info['url']} ({engine.num_blocks} KV blocks of {engine.block_size} tokens, "
                  f"context {engine.max_seq_len}, {args.max_num_seqs} sequences a step, {args.max_queue} more may "
                  "wait); Ctrl-C stops", file=sys.stderr, flush=True)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again for the handler it
    # found: KeyboardInterrupt, or the SystemExit of the command's SIGTERM handler (``files.sigterm_as_exit``),
    # which end here as a clean exit. uvicorn's own SystemExit (it could not listen: it logged why) stays a failure.
    try:
        engine_server(config, loop, args.shutdown_timeout, on_started=started).run()
    except KeyboardInterrupt:
        pass
    except SystemExit as e:
        if e.code != SIGTERM_STATUS:
            print(f"error: the server could not start on {args.host}:{args.port} (the error above says why); "
                  "choose another --port or stop what listens there", file=sys.stderr)
            return 1
    finally:
        loop.stop()
    print("server stopped", file=sys.stderr)
    return 0


def register(sub) -> None:
    """Add the ``serve`` subcommand to an argparse subparsers object."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine (completions, chat, "
                                     "streaming, /metrics)")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=at_least(0), default=8000, help="port to listen on (0: a free one, which the "
                   "startup line and --json report)")
    p.add_argument("--served-model-name", default=None, help="the model name requests give (default: the model "
                   "file's stem)")
    p.add_argument("--block-size", type=at_least(1), default=16)
    p.add_argument("--num-blocks", type=at_least(1), default=None, help="KV pool in blocks (default: what "
                   "max-num-seqs full-context sequences take, at most 512 MiB)")
    p.add_argument("--max-num-seqs", type=at_least(1), default=64, help="sequences in a step at most")
    p.add_argument("--max-num-batched-tokens", type=at_least(1), default=256, help="tokens per engine step")
    p.add_argument("--max-seq-len", type=at_least(2), default=None, help="context to use (default and at most: the model's)")
    p.add_argument("--speculative-config", type=json_object, default=None, help="speculate, as vLLM's option: "
                   "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (counters in /metrics)")
    p.add_argument("--trace-out", default=None, metavar="PATH", help="write the engine's steps to PATH (JSON lines, "
                   "docs/trace.md) for `python -m minillm trace replay PATH`")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse prompt blocks across requests")
    p.add_argument("--max-queue", type=at_least(0), default=256, help="requests that may wait beyond "
                   "--max-num-seqs; past them new requests get 503 (default 256)")
    p.add_argument("--shutdown-timeout", type=seconds, default=30.0, help="seconds running requests may take to "
                   "finish after Ctrl-C / SIGTERM before they are aborted (default 30; a second Ctrl-C aborts them at once)")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch threads (default: torch's)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
