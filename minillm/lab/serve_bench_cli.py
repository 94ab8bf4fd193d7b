"""``python -m minillm serve-bench``: the engine against one request at a time, static batches and
(``--peer``) transformers' continuous batching on the same requests (``minillm.lab.serve_bench``;
Kwon et al. 2023, Sec. 6); ``--online``: latency against request rate (``minillm.lab.online``)."""

from __future__ import annotations

import argparse
import sys

import torch

from ..kv_cache import kv_cache_bytes
from ..options import add_model_args, at_least, load, print_json
from ..paged.block_manager import blocks_for
from ..paged.engine import DEFAULT_KV_BYTES
from ..paged.fragmentation import MAX_SEQ_LEN, TRACES
from ..paged.trace import check_trace_path
from ..timing import available_memory
from ..fast.threads import fix_threads
from .background import background_load, check_load
from .online import cmd_online
from .serve_bench import SPEC_ROW, format_report, request_lengths, serve_bench
from .serve_spec import SPEC_TRACES, cmd_serve_spec
from .simulate import cmd_simulate

SIM_MODEL = "smollm2-135m"  # --sim-model's default: the embedded model

# --quick's defaults; an explicit --requests or --scale still wins (the report says what ran)
QUICK = dict(num_requests=4, scale=1 / 32, sharing_requests=1, memory_requests=2)
DEFAULTS = dict(num_requests=64, scale=0.25)
#: a trace's own default scale: Alpaca-like requests are short already (mean 19 / 58 tokens), so they run
#: at their drawn lengths
TRACE_SCALE = {"alpaca": 1.0}


def share(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:  # NaN included
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (it multiplies the trace's lengths), got {text}")
    return value


def serve_bench_kwargs(args) -> tuple[dict, list[tuple[int, int]]]:
    """``serve_bench``'s arguments from the options, and each request's (prompt, output) lengths; refuses,
    before a model is loaded, options that could not run (ValueError naming the option)."""
    kwargs = dict(DEFAULTS, scale=TRACE_SCALE.get(args.trace, DEFAULTS["scale"]))
    kwargs.update(QUICK if args.quick else {})
    kwargs.update({k: v for k, v in (("num_requests", args.requests), ("scale", args.scale)) if v is not None})
    kwargs.update(trace=args.trace, block_size=args.block_size, num_blocks=args.num_blocks,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  peer=args.peer, peer_repeats=args.peer_repeats, progress=not args.json,
                  speculative_config=None if args.no_spec_row else SPEC_ROW,
                  trace_out=None if args.trace_out is None else check_trace_path(args.trace_out))
    if args.block_size > MAX_SEQ_LEN:
        # the memory run replays the traces' full lengths with this block size, and no sequence is longer
        raise ValueError(f"--block-size: {args.block_size} tokens per block is more than the longest sequence "
                         f"serve-bench runs ({MAX_SEQ_LEN} tokens, the traces' cap), so every block would stand "
                         f"mostly empty; use at most {MAX_SEQ_LEN} (16, the default, is vLLM's)")
    lengths = request_lengths(kwargs["num_requests"], args.trace, kwargs["scale"])
    p, o = max(lengths, key=sum)
    need = blocks_for(p + o, args.block_size)
    if args.num_blocks is not None and args.num_blocks < need:
        blocks = f"{args.num_blocks} block{'s' * (args.num_blocks != 1)}"
        raise ValueError(f"--num-blocks: {blocks} of {args.block_size} tokens cannot hold the longest request ({p} "
                         f"prompt + {o} output tokens: {need} blocks); give at least {need}, or leave --num-blocks "
                         "out (the default pool)")
    return kwargs, lengths


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def check_against_model(args, model, tokenizer, lengths: list[tuple[int, int]]) -> None:
    """Refuse, right after the model loads and before any work, what needs the model to check: prompts
    past its context, a KV pool (--num-blocks, or the default's) that cannot hold the longest request or
    does not fit in memory, a model without a tokenizer."""
    if tokenizer is None:
        raise ValueError(f"--model: {args.model} has no tokenizer, and serve-bench cuts its prompts from a play's "
                         "text; give a model with its tokenizer")
    ctx = model.config.max_seq_len
    longest_prompt = max(p for p, _ in lengths)
    if longest_prompt >= ctx:
        raise ValueError(f"--scale: the longest prompt ({longest_prompt} tokens) leaves no room for a new token in "
                         f"the model's context of {ctx}; lower --scale")
    element = torch.empty((), dtype=model.dtype).element_size()
    block_bytes = kv_cache_bytes(model.config, 1, args.block_size, element)
    need = max(blocks_for(min(ctx, p + o), args.block_size) for p, o in lengths)
    if args.num_blocks is None:  # the engine's default pool (LLMEngine)
        pool = min(DEFAULT_KV_BYTES, kv_cache_bytes(model.config, args.max_num_seqs, ctx, element))
        if pool // block_bytes < need:
            raise ValueError(f"--block-size: the default KV pool ({_size(pool)}) holds {int(pool // block_bytes)} "
                             f"blocks of {args.block_size} tokens ({_size(block_bytes)} each) and the longest request "
                             f"needs {need}; use a smaller --block-size, or give --num-blocks")
        return
    free = available_memory()
    if free is not None and args.num_blocks * block_bytes > 0.8 * free:
        raise ValueError(f"--num-blocks: {args.num_blocks} blocks of {args.block_size} tokens take "
                         f"{args.num_blocks * block_bytes / 2**30:.1f} GiB and {free / 2**30:.1f} GiB are free; "
                         "give fewer, or leave --num-blocks out (the default pool)")


def cmd_serve_bench(args) -> int:
    """Run the modes, print the table (``--json``: one line of strict JSON); returns the exit code (0)."""
    if args.peer_repeats > 1 and (args.spec or args.online or not args.peer):
        raise ValueError(f"--peer-repeats: {args.peer_repeats} turns of the engine against transformers are for the "
                         "offline run with --peer" + ("; with --spec the turns are --spec-repeats" if args.spec else
                                                       ", not --online" if args.online else "; add --peer"))
    if args.trace_out is not None and (args.simulate or args.spec or args.online):
        mode = "--simulate" if args.simulate else "--spec" if args.spec else "--online"
        raise ValueError(f"--trace-out: records the engine's run of the offline benchmark; {mode} runs other "
                         "engines, so leave one of the two out")
    if args.simulate:  # the real scheduler, the forward priced by the cost model (minillm.lab.simulate)
        return cmd_simulate(args)
    if args.tp != 1 or args.sim_model != SIM_MODEL:  # options of the simulation only: never ignored in silence
        raise ValueError(f"{'--tp' if args.tp != 1 else '--sim-model'}: prices a simulated run; add --simulate "
                         "HARDWARE (h100, cpu, ...) or leave it out")
    if args.spec:  # plain vs speculative engine (minillm.lab.serve_spec)
        return cmd_serve_spec(args)
    if args.trace in SPEC_TRACES:
        raise ValueError(f"--trace: {args.trace} is a trace of --spec (plain vs speculative engine); add --spec")
    if args.online:  # latency against request rate: the lab's harness
        if args.scale is None:  # None tells serve_bench_kwargs "not given"; the harness reads a number
            args.scale = DEFAULTS["scale"]
        check_load(args.background_load)
        with background_load(args.background_load):
            return cmd_online(args)
    kwargs, lengths = serve_bench_kwargs(args)  # bad options cost nothing: no model is loaded yet
    check_load(args.background_load)
    if args.threads:
        fix_threads(args.threads)  # the user's count; otherwise minillm.threads chooses from the load
    model, tokenizer = load(args)
    check_against_model(args, model, tokenizer, lengths)
    with background_load(args.background_load):  # stopped when the runs end, also on an error or Ctrl-C
        report = serve_bench(model, tokenizer, **kwargs)
    report["background_load"] = args.background_load
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
    p.add_argument("--requests", type=at_least(1), default=None, help="requests, all arriving at once (default 64; "
                   "4 with --quick)")
    p.add_argument("--trace", choices=sorted(TRACES) + list(SPEC_TRACES), default="sharegpt", help="length distribution (the "
                   "fragmentation lab's log-normal traces)")
    p.add_argument("--scale", type=share, default=None, help="multiply every prompt and output length by this, in "
                   "(0, 1] (default 0.25, so the sequential mode fits minutes on a 2-core CPU; 1/32 with --quick)")
    p.add_argument("--block-size", type=at_least(1), default=16, help=f"tokens per KV block, at most {MAX_SEQ_LEN} "
                   "(default 16)")
    p.add_argument("--num-blocks", type=at_least(1), default=None, help="KV pool in blocks (default: 512 MiB)")
    p.add_argument("--max-num-seqs", type=at_least(1), default=64, help="running sequences at most; also the "
                   "static batch size")
    p.add_argument("--max-num-batched-tokens", type=at_least(1), default=256, help="tokens per engine step")
    p.add_argument("--peer", action="store_true", help="also run transformers' continuous batching "
                   "(generate_batch's manager over paged SDPA attention)")
    p.add_argument("--peer-repeats", type=at_least(1), default=1, help="--peer: turns of the engine and transformers, "
                   "one after the other; each mode keeps its run of median tokens/s and the goal is the median of the "
                   "turns' ratios (an odd N makes it one turn's; default 1)")
    p.add_argument("--no-spec-row", action="store_true", help="leave out the row engine+spec (the engine with "
                   "prompt-lookup speculation, draft length auto: the same greedy tokens, fewer steps)")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch threads (default: chosen from the "
                   "cores this process may use and their load, minillm.threads)")
    p.add_argument("--background-load", type=at_least(0), default=0, metavar="N", help="run N CPU-bound processes "
                   "beside the benchmark (started and stopped by the command, at most 30 minutes): the figures of a "
                   "machine that other programs share (default 0)")
    p.add_argument("--trace-out", default=None, metavar="PATH", help="write the engine run's steps to PATH (JSON "
                   "lines, docs/trace.md) for `python -m minillm trace replay PATH`")
    p.add_argument("--quick", action="store_true", help="a smoke run for CI: 4 short requests (scale 1/32) unless "
                   "--requests / --scale say otherwise, and small sharing and memory runs")
    o = p.add_argument_group("online (--online: requests arrive over time; minillm.lab.online)")
    o.add_argument("--online", action="store_true", help="normalised latency, TTFT, TPOT and goodput against "
                   "request rate: the engine vs static batching on the same arrivals (Kwon et al. 2023, Fig. 12)")
    o.add_argument("--rate", default="1,2,4", help="request rates per second, comma-separated (default 1,2,4)")
    o.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps between arrivals, as "
                   "vLLM's benchmark (1: Poisson; below 1 burstier)")
    o.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per rate: rate x duration "
                   "requests (default 10)")
    o.add_argument("--http", action="store_true", help="also through the server's app on 127.0.0.1 (streaming "
                   "httpx clients)")
    o.add_argument("--ttft-slo", type=float, default=2.0, help="goodput's TTFT target in seconds (default 2)")
    o.add_argument("--tpot-slo", type=float, default=0.25, help="goodput's TPOT target in seconds (default 0.25)")
    o.add_argument("--out", default=None, help="folder for the figure and record (default: $MINILLM_FIGURES, "
                   "else figures/runs, which git ignores)")
    s = p.add_argument_group("speculative decoding in the engine (--spec: minillm.lab.serve_spec)")
    s.add_argument("--spec", choices=["ngram", "draft"], default=None, help="plain vs speculative engine on the same "
                   "requests at each --concurrency (traces copy, chat, mixed; default copy)")
    s.add_argument("--num-speculative-tokens", default="4", help="draft length: K, auto, or a comma list (default 4)")
    s.add_argument("--draft-model", default=None, help="--spec draft: the draft (any file load_model takes, e.g. "
                   "an int4 file of the target from python -m minillm quantize)")
    s.add_argument("--concurrency", default="1,4,16,64", help="requests kept in flight, comma-separated")
    s.add_argument("--spec-max-tokens", type=at_least(1), default=64, help="output tokens per request (default 64)")
    s.add_argument("--spec-repeats", type=at_least(1), default=1, help="turns of the plain engine and every k, in "
                   "that order; each row reports the medians (default 1)")
    m = p.add_argument_group("simulated serving (--simulate: minillm.lab.simulate, docs/cluster.md)")
    m.add_argument("--simulate", default=None, metavar="HARDWARE", help="run the trace through the real scheduler "
                   "and block manager with each step priced by the roofline cost model instead of a forward, on h100, "
                   "h200, a100, l4, mi300x (datasheets) or cpu (this machine as roofline measures it)")
    m.add_argument("--sim-model", default=SIM_MODEL, help="--simulate: the model by its config: smollm2-135m, "
                   "llama-3.1-8b, llama-3.1-70b (default smollm2-135m)")
    m.add_argument("--tp", type=at_least(1), default=1, help="--simulate: tensor-parallel devices (two ring "
                   "all-reduces per layer; default 1)")
    p.set_defaults(func=cmd_serve_bench, measures_speed=True)
