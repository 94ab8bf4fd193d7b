"""``python -m minillm serve-bench``: the engine against one request at a time, static batches and
(``--peer``) transformers' continuous batching on the same requests (``minillm.paged.serve_bench``;
Kwon et al. 2023, Sec. 6)."""

from __future__ import annotations

import sys

import torch

from ..options import add_model_args, at_least, load, print_json
from .fragmentation import TRACES
from .serve_bench import format_report, serve_bench

QUICK = dict(num_requests=4, scale=1 / 32, sharing_requests=1, memory_requests=2)


def cmd_serve_bench(args) -> int:
    """Run the modes, print the table (``--json``: one line of strict JSON); returns the exit code (0)."""
    if args.threads:
        torch.set_num_threads(args.threads)  # on a shared machine one thread avoids waiting at every op's barrier
    model, tokenizer = load(args)
    kwargs = dict(num_requests=args.requests, trace=args.trace, scale=args.scale, block_size=args.block_size,
                  num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, peer=args.peer, progress=not args.json)
    if args.quick:
        kwargs.update(QUICK)
    report = serve_bench(model, tokenizer, **kwargs)
    report.pop("_engine")
    if args.json:
        print_json(report)
    else:
        print(format_report(report))
        sys.stdout.flush()
    return 0


def register(sub) -> None:
    """Add the ``serve-bench`` subcommand to an argparse subparsers object."""
    p = sub.add_parser("serve-bench", help="offline throughput: continuous batching vs sequential, static batches "
                                           "and transformers' continuous batching")
    add_model_args(p)
    p.add_argument("--requests", type=at_least(1), default=64, help="requests, all arriving at once (default 64)")
    p.add_argument("--trace", choices=sorted(TRACES), default="sharegpt", help="length distribution (the "
                   "fragmentation lab's log-normal traces)")
    p.add_argument("--scale", type=float, default=0.25, help="multiply every prompt and output length by this "
                   "(default 0.25, so the sequential mode fits minutes on a 2-core CPU)")
    p.add_argument("--block-size", type=at_least(1), default=16)
    p.add_argument("--num-blocks", type=at_least(1), default=None, help="KV pool in blocks (default: 512 MiB)")
    p.add_argument("--max-num-seqs", type=at_least(1), default=64, help="running sequences at most; also the "
                   "static batch size")
    p.add_argument("--max-num-batched-tokens", type=at_least(1), default=256, help="tokens per engine step")
    p.add_argument("--peer", action="store_true", help="also run transformers' continuous batching "
                   "(generate_batch's manager, attn_implementation='paged|sdpa')")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch threads (default: torch's; 1 on a "
                   "machine shared with other work, with --shards 1)")
    p.add_argument("--quick", action="store_true", help="a smoke run (4 short requests) for CI")
    p.set_defaults(func=cmd_serve_bench, measures_speed=True)
