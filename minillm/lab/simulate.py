"""Simulated serving: minillm's own scheduler, block manager and prefix cache on serve-bench's requests, with
the forward replaced by a clock that the roofline cost model advances.

Each step is ``LLMEngine.step`` without tensors: ``Scheduler.schedule_or_preempt_idle`` plans (blocks reserved,
prefix hits found, preemption when the pool runs out), the cost model prices the plan, the block names commit,
every sequence that caught up with its known tokens gets one token, and a sequence with all its tokens
finishes. The price of a step on ``tp`` devices (Pope et al. 2023, Sec. 2-3; Williams et al. 2009):

    max(FLOPs / tp / peak, bytes / tp / bandwidth) + overhead + 2 x n_layers x all_reduce(N x C x bytes)

bytes: every weight once, each sequence's KV cache read once and its new K/V written; FLOPs: 2 per weight per
token, 2 per head weight per sampled row, 4 x H x D per (query, key) pair per layer; all_reduce on a ring
(Patarasuk and Yuan 2009): 2 (p - 1) / p x bytes / link bandwidth + latency x log2 p, two per layer (after
attention's output projection and after the MLP, Megatron-LM: Shoeybi et al. 2019, Sec. 3). The KV pool
holds what the device memory leaves after the weights (vLLM's ``gpu_memory_utilization``). Speculation is
left out: its acceptance depends on the tokens, which a simulation does not draw. Routing over replicas:
``sim_router``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from ..kv_cache import kv_cache_bytes
from ..config import ModelConfig
from ..paged.block_manager import BlockManager, blocks_for
from ..paged.config import DEFAULT_KV_BYTES
from ..paged.scheduler import Scheduler, SchedulerOutput
from ..paged.sequence import Sequence
from .hardware import Device

__all__ = ["SimEngine", "all_reduce_time", "cmd_simulate", "format_sim_report", "kv_pool_blocks", "max_concurrency",
           "simulate", "step_cost", "weight_bytes"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MEMORY_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization: the rest is activations and the runtime


def all_reduce_time(nbytes: float, p: int, link_bandwidth: float, latency: float) -> float:
    """Seconds of one ring all-reduce of ``nbytes`` over ``p`` devices: 2 (p - 1) / p x nbytes / link_bandwidth
    (bytes/s, one way) + latency x log2 p; 0 for p = 1."""
    if p == 1:
        return 0.0
    return 2 * (p - 1) / p * nbytes / link_bandwidth + latency * math.log2(p)


def weight_bytes(config: ModelConfig, nbytes: float) -> float:
    """Bytes the weights take in memory: every parameter (embedding and an untied output layer both) x nbytes."""
    return config.n_params * nbytes


def kv_token_bytes(config: ModelConfig, nbytes: float, tp: int = 1) -> float:
    """KV bytes one token takes on one of ``tp`` devices: 2 x n_layers x (Hkv / tp, at least 1) x D x nbytes
    (a KV head is copied when there are more devices than KV heads)."""
    return 2 * config.n_layers * math.ceil(config.n_kv_heads / tp) * config.head_dim * nbytes


def kv_pool_blocks(device: Device, config: ModelConfig, tp: int = 1, block_size: int = 16,
                   memory_utilization: float = MEMORY_UTILIZATION, max_num_seqs: int = 64) -> int:
    """Blocks of ``block_size`` tokens in the KV pool: (memory x memory_utilization - weights / tp) / a block's
    bytes on one device; a device without memory in the table (this CPU) gets the engine's default pool.

    Raises:
        ValueError: the weights do not fit (naming what they need, what there is, and a --tp that fits).
    """
    nbytes = DTYPE_BYTES[device.dtype]
    block = kv_token_bytes(config, nbytes, tp) * block_size
    if device.memory is None:  # LLMEngine's default: DEFAULT_KV_BYTES, or what max_num_seqs full contexts take
        return int(min(DEFAULT_KV_BYTES, kv_cache_bytes(config, max_num_seqs, config.max_seq_len, nbytes)) // block)
    usable = device.memory * memory_utilization
    weights = weight_bytes(config, nbytes) / tp
    if weights >= usable:
        fits = next((p for p in (2, 4, 8, 16, 32, 64) if weight_bytes(config, nbytes) / p < usable), None)
        raise ValueError(f"--tp: the weights take {weights / 1e9:.1f} GB on each of {tp} {device.name} and "
                         f"{usable / 1e9:.1f} GB are usable ({memory_utilization:.0%} of {device.memory / 1e9:.0f} GB); "
                         + (f"use --tp {fits} or more" if fits else "no tensor parallelism of up to 64 fits"))
    return int((usable - weights) // block)


def step_cost(config: ModelConfig, device: Device, spans: list[tuple[int, int]], sampled: int, tp: int = 1,
              overhead: float | None = None) -> dict:
    """The price of one step. ``spans``: (context already cached, new tokens) per scheduled sequence;
    ``sampled``: rows of the output layer (sequences that catch up).

    Returns:
        {"flops", "bytes" (one device's), "compute_s", "memory_s", "all_reduce_s", "overhead_s", "time_s"}:
        time_s = max(compute_s, memory_s) + overhead_s + all_reduce_s (seconds).
    """
    nbytes = DTYPE_BYTES[device.dtype]
    per_layer, head = config.layer_linear_params, config.vocab_size * config.dim
    tokens = sum(n for _, n in spans)
    pairs = sum(n * c + n * (n + 1) / 2 for c, n in spans)  # (query, key) pairs, causal within the new tokens
    flops = (config.n_layers * (2 * tokens * per_layer + 4 * pairs * config.n_heads * config.head_dim)
             + 2 * sampled * head)
    weights = (config.n_layers * per_layer + head) * nbytes / tp  # each device reads its shard once
    kv = kv_token_bytes(config, nbytes, tp) * sum(c + n for c, n in spans)  # read the context, write the new
    compute_s, memory_s = flops / tp / device.flops_at(tokens), (weights + kv) / device.bandwidth
    all_reduce_s = 2 * config.n_layers * all_reduce_time(tokens * config.dim * nbytes, tp, device.link_bandwidth,
                                                         device.link_latency)
    overhead_s = device.step_overhead if overhead is None else overhead
    return {"flops": flops, "bytes": weights + kv, "compute_s": compute_s, "memory_s": memory_s,
            "all_reduce_s": all_reduce_s, "overhead_s": overhead_s,
            "time_s": max(compute_s, memory_s) + overhead_s + all_reduce_s}


@dataclass
class _Timing:
    arrival: float
    max_tokens: int
    prompt_len: int
    first: float | None = None
    last: float | None = None
    cached: int | None = None


@dataclass
class SimEngine:
    """One simulated engine: the real ``Scheduler`` and ``BlockManager``, a clock instead of a forward.

    ``host_time``: also advance the clock by the scheduler's own measured seconds (on this CPU, the engine's
    host work is part of its step; on a GPU it is not counted: the overhead term stands for it).
    """

    config: ModelConfig
    device: Device
    tp: int = 1
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    enable_prefix_caching: bool = True
    overhead: float | None = None
    host_time: bool = False
    seed: int = 0
    clock: float = 0.0
    steps: int = 0
    preemptions: int = 0
    peak_blocks: int = 0
    cost_totals: dict = field(default_factory=lambda: dict.fromkeys(
        ("compute_s", "memory_s", "all_reduce_s", "overhead_s", "host_s", "time_s"), 0.0))

    def __post_init__(self):
        if self.num_blocks is None:
            self.num_blocks = kv_pool_blocks(self.device, self.config, self.tp, self.block_size,
                                             max_num_seqs=self.max_num_seqs)
        self.manager = BlockManager(self.num_blocks, self.block_size, self.enable_prefix_caching)
        self.scheduler = Scheduler(self.manager, self.max_num_seqs, self.max_num_batched_tokens)
        self.timings: dict[str, _Timing] = {}
        self._rng = np.random.default_rng(self.seed)
        self._next = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, arrival: float) -> None:
        """Queue a request that arrives at ``arrival`` (simulated seconds); greedy, EOS ignored.

        Raises:
            ValueError: a request the pool could never hold (``Scheduler.check_fits``).
        """
        context = min(self.config.max_seq_len, len(prompt_token_ids) + max_tokens)
        if blocks_for(context, self.block_size) > self.num_blocks:
            raise ValueError(f"request {request_id!r}: {context} tokens need {blocks_for(context, self.block_size)} "
                             f"blocks and the simulated pool holds {self.num_blocks}; lower the lengths or raise --tp")
        seq = Sequence(self._next, request_id, 0, (self._next, 0), list(prompt_token_ids), len(prompt_token_ids))
        self._next += 1
        self.timings[request_id] = _Timing(arrival, max_tokens, len(prompt_token_ids))
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def step(self) -> None:
        """One engine step: schedule, price, commit, one token for each sequence that caught up, finish."""
        begun = time.perf_counter()
        plan = self.scheduler.schedule_or_preempt_idle()
        host = time.perf_counter() - begun
        self.preemptions += len(plan.preempted)
        self.peak_blocks = max(self.peak_blocks, self.manager.num_used_blocks)
        ready = [s for s, n in plan.scheduled if s.num_computed_tokens + n >= s.num_tokens]
        cost = step_cost(self.config, self.device, [(s.num_computed_tokens, n) for s, n in plan.scheduled],
                         len(ready), self.tp, self.overhead)
        cost["host_s"] = host if self.host_time else 0.0
        cost["time_s"] += cost["host_s"]
        for k in self.cost_totals:
            self.cost_totals[k] += cost[k]
        self.clock += cost["time_s"]
        self.steps += 1
        self.manager.commit()
        self.scheduler.plan = SchedulerOutput()
        for seq, n in plan.scheduled:
            t = self.timings[seq.request_id]
            if t.cached is None:  # its first admission: what the prefix cache served
                t.cached = seq.num_computed_tokens
            seq.num_computed_tokens += n
        for seq in ready:
            t = self.timings[seq.request_id]
            seq.token_ids.append(int(self._rng.integers(self.config.vocab_size)))  # an output the cache never saw
            t.first = t.first if t.first is not None else self.clock
            t.last = self.clock
            if seq.num_output_tokens >= t.max_tokens:
                self.scheduler.finish(seq)

    def run_until(self, when: float) -> None:
        """Step while there is work and the clock is before ``when``; an idle engine waits until ``when``."""
        while self.clock < when and self.has_unfinished():
            self.step()
        self.clock = max(self.clock, when)

    def summary(self, start: float = 0.0) -> dict:
        """serve-bench's figures: throughput over the makespan, TTFT (from arrival) and TPOT percentiles, memory."""
        ts = list(self.timings.values())
        wall = max(t.last for t in ts) - start
        out = sum(t.max_tokens for t in ts)
        total = out + sum(t.prompt_len for t in ts)
        ttft = [t.first - t.arrival for t in ts]
        tpot = [(t.last - t.first) / (t.max_tokens - 1) for t in ts if t.max_tokens > 1]
        prompt = sum(t.prompt_len for t in ts)
        return {"wall_s": wall, "output_tokens": out, "total_tokens": total, "output_tokens_per_s": out / wall,
                "total_tokens_per_s": total / wall, "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
                "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99), "steps": self.steps,
                "preemptions": self.preemptions, "peak_blocks": self.peak_blocks, "num_blocks": self.num_blocks,
                "prefix_hit_rate": sum(t.cached or 0 for t in ts) / prompt if prompt else 0.0,
                "step_time_split": dict(self.cost_totals)}


def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def simulate(config: ModelConfig, device: Device, requests: list[tuple[list[int], int]], arrivals=None,
             **engine_kwargs) -> dict:
    """Run ``requests`` ((prompt token ids, max_tokens) each) arriving at ``arrivals`` (seconds; default all at
    0) through one ``SimEngine`` (``engine_kwargs``: its fields) until all finish; returns ``SimEngine.summary``."""
    engine = SimEngine(config, device, **engine_kwargs)
    arrivals = np.zeros(len(requests)) if arrivals is None else np.asarray(arrivals, dtype=float)
    for i in np.argsort(arrivals, kind="stable"):
        engine.run_until(float(arrivals[i]))
        engine.add_request(str(i), *requests[i], arrival=float(arrivals[i]))
    while engine.has_unfinished():
        engine.step()
    return engine.summary(float(arrivals.min()))


def max_concurrency(config: ModelConfig, device: Device, context: int, tpot_target: float, tp: int = 1,
                    num_blocks: int | None = None, block_size: int = 16, overhead: float | None = None) -> dict:
    """The largest number of sequences decoding together whose step (one token each at ``context`` cached
    positions) takes at most ``tpot_target`` seconds and whose KV fits the pool; {"concurrency", "tpot_s",
    "limit": "tpot" or "kv pool"}; concurrency 0 when one sequence alone misses the target."""
    pool = num_blocks if num_blocks is not None else kv_pool_blocks(device, config, tp, block_size)
    fits = pool // blocks_for(context + 1, block_size)

    def tpot(b: int) -> float:
        return step_cost(config, device, [(context, 1)] * b, b, tp, overhead)["time_s"]

    lo, hi = 0, max(fits, 0)
    while lo < hi:  # the step time grows with b: the largest b meeting the target
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if tpot(mid) <= tpot_target else (lo, mid - 1)
    return {"concurrency": lo, "tpot_s": tpot(lo) if lo else tpot(1),
            "limit": "kv pool" if lo == fits and lo else "tpot", "pool_sequences": fits}


def format_sim_report(report: dict) -> str:
    """serve-bench's table for the simulated engine, then its memory, where its step time went and the
    largest concurrency under the TPOT target."""
    d, m = report["device"], report["sim"]
    split = m["step_time_split"]
    lines = [f"simulated: {report['model']} on {report['tp']} x {d['name']} (the roofline cost model; not measured)",
             f"{report['num_requests']} requests, {report['trace']}-like lengths x {report['scale']} (mean prompt "
             f"{report['mean_prompt']:.0f}, output {report['mean_output']:.0f} tokens), {report['arrivals']}, greedy, "
             f"{d['dtype']}, block {report['block_size']}, max_num_seqs {report['max_num_seqs']}, budget "
             f"{report['max_num_batched_tokens']} tokens/step",
             f"{'mode':<13}{'out tok/s':>10}{'total tok/s':>12}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}"
             f"{'wall s':>8}",
             f"{'simulated':<13}{m['output_tokens_per_s']:>10.1f}{m['total_tokens_per_s']:>12.1f}{m['ttft_p50_s']:>10.3f}"
             f"{m['ttft_p99_s']:>8.3f}{m['tpot_p50_s']:>10.4f}{m['tpot_p99_s']:>8.4f}{m['wall_s']:>8.1f}",
             f"engine memory: peak {m['peak_blocks']} of {m['num_blocks']} blocks, {m['preemptions']} preemptions, "
             f"prefix hit rate {100 * m['prefix_hit_rate']:.1f}%, {m['steps']} steps",
             "step time: " + ", ".join(f"{k[:-2].replace('_', '-')} {v:.2f} s" for k, v in split.items()
                                       if k != "time_s") + f" (steps pay max(compute, memory); total {split['time_s']:.2f} s)"]
    c = report["max_concurrency"]
    lines.append(f"largest concurrency with TPOT <= {report['tpot_target_s'] * 1e3:.0f} ms (decode at context "
                 f"{report['context']}): {c['concurrency']} sequences ({c['tpot_s'] * 1e3:.1f} ms a step; limit: "
                 f"{c['limit']}; the pool holds {c['pool_sequences']})")
    lines.append("device: " + "; ".join(f"{k}: {v}" for k, v in d["sources"].items()))
    return "\n".join(lines)


# ---- serve-bench --simulate ----------------------------------------------------------------------------

def _tokenizer(args):
    """The tokenizer that cuts serve-bench's prompts: the given model's (loaded) or the embedded one's (read
    from its file without its weights, which a simulation does not need)."""
    if args.model is not None:
        from ..options import load
        return load(args)[1]
    from ..formats.gguf import read_gguf
    from ..loading import default_model_path
    from ..tokenizer import Tokenizer
    return Tokenizer.from_gguf(read_gguf(default_model_path()))


def sim_device(args) -> Device:
    """``--simulate``'s device: the table's, or "cpu": this machine as ``roofline`` measures it now (the
    embedded model's decode and prefill rows, about a minute)."""
    from .hardware import cpu_device, device_named
    if args.simulate.lower() != "cpu":
        return device_named(args.simulate)
    from ..options import load
    from .sim_fidelity import roofline_report
    return cpu_device(roofline_report(load(args)[0]))


def cmd_simulate(args) -> int:
    """serve-bench's requests (or --online's arrivals at each --rate) through the simulated engine; prints
    serve-bench's table (``--json``: one line of strict JSON)."""
    from ..options import print_json
    from .hardware import model_named
    from .online import arrival_times
    from .serve_bench import make_requests
    from .serve_bench_cli import serve_bench_kwargs
    config = model_named(args.sim_model)  # refused before anything is measured or read
    if args.online and args.scale is None:
        args.scale = 0.25
    kwargs, _ = serve_bench_kwargs(args)
    if args.tp > 1 and args.simulate.lower() == "cpu":  # refused before the minute "cpu" takes to measure
        raise ValueError(f"--tp: {args.tp} devices, but cpu is this one machine, with no link between machines; "
                         "use --tp 1, or simulate a GPU from the table")
    device = sim_device(args)
    engine_kwargs = dict(tp=args.tp, block_size=args.block_size, num_blocks=args.num_blocks,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         host_time=device.memory is None)
    pool = engine_kwargs["num_blocks"] or kv_pool_blocks(device, config, args.tp, args.block_size,
                                                         max_num_seqs=args.max_num_seqs)
    tokenizer = _tokenizer(args)
    runs = []
    for rate in ([float(r) for r in args.rate.split(",")] if args.online else [None]):
        n = max(1, round(rate * args.duration)) if rate is not None else kwargs["num_requests"]
        reqs = make_requests(tokenizer, n, kwargs["trace"], kwargs["scale"])
        arrivals = None if rate is None else arrival_times(n, rate, args.burstiness)
        runs.append((rate, reqs, simulate(config, device, [(r.prompt_token_ids, r.max_tokens) for r in reqs],
                                          arrivals, **engine_kwargs)))
    rate, reqs, sim = runs[0]
    mean_prompt = float(np.mean([len(r.prompt_token_ids) for r in reqs]))
    mean_output = float(np.mean([r.max_tokens for r in reqs]))
    context = round(mean_prompt + mean_output / 2)  # a decoding sequence's mean context
    report = {"model": args.sim_model, "tp": args.tp, "trace": kwargs["trace"], "scale": kwargs["scale"],
              "num_requests": len(reqs), "mean_prompt": mean_prompt, "mean_output": mean_output,
              "arrivals": "all at t=0" if rate is None else f"{rate:g} requests/s",
              "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "tpot_target_s": args.tpot_slo,
              "context": context, "device": {"name": device.name, "dtype": device.dtype, "memory": device.memory,
                                             "bandwidth": device.bandwidth, "flops": device.flops,
                                             "link_bandwidth": device.link_bandwidth,
                                             "step_overhead": device.step_overhead, "sources": device.sources},
              "sim": sim, "max_concurrency": max_concurrency(config, device, context, args.tpot_slo, args.tp, pool,
                                                             args.block_size),
              "rates": [{"rate": r, **s} for r, _, s in runs if r is not None]}
    if args.json:
        print_json(report)
        return 0
    print(format_sim_report(report))
    for row in report["rates"][1:]:
        print(f"rate {row['rate']:g}/s: {row['output_tokens_per_s']:.1f} out tok/s, TTFT p50 {row['ttft_p50_s']:.3f} s, "
              f"TPOT p50 {row['tpot_p50_s'] * 1e3:.1f} ms, p99 {row['tpot_p99_s'] * 1e3:.1f} ms")
    return 0
