"""serve-bench --online: latency against request rate, the engine against static batching, in process
and over HTTP.

Kwon et al. 2023 (vLLM), Sec. 6.2 and Fig. 12: requests arrive over time; the *normalised latency*
(end-to-end latency over output tokens, averaged) stays flat while a system keeps up and turns up where
it cannot. Arrivals are drawn as vLLM's benchmarks/benchmark_serving.py draws them: gamma-distributed
gaps with shape ``burstiness`` and mean 1 / rate (1: a Poisson process; below 1 burstier).

Modes, on the same requests and arrival times, one after the other in real time: ``engine`` (``LLMEngine``
in process, requests added between steps), ``static`` (``generate_batch`` batches that run until their
longest request ends) and ``http`` (the server's app on 127.0.0.1, clients streaming with httpx). Per
request (vLLM's definitions): TTFT, TPOT = (latency - TTFT) / (output tokens - 1), inter-token latencies,
end-to-end latency; mean, p50, p99; goodput: requests meeting both TTFT and TPOT targets per second of the
window they arrive in (n requests at rate r: n / r seconds), so it never exceeds the offered rate.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..files import check_output_path, runs_folder, save_figure
from ..generation import generate_batch, generate_cached
from ..options import load, print_json
from ..paged.engine import LLMEngine
from ..timing import dtype_name, machine
from .records import record
from .serve_bench import BenchRequest, _greedy, make_requests

GOALS = {"engine_vs_static_rate": 2.0, "http_vs_in_process": 0.8}
PAPER = {"rate_vs_reservation": "2-4x the request rate at the same normalised latency (Sec. 6.2, Fig. 12)"}
KNEE = 2.0  # the curve "turns up" where normalised latency reaches KNEE x static batching's at the lowest rate


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Arrival times in seconds from the start, the first at 0: gaps ~ Gamma(shape=burstiness,
    scale=1 / (rate * burstiness)) (mean 1 / rate, variance 1 / (rate^2 * burstiness)), as vLLM's
    benchmark draws them; rate inf: every request at 0.

    Raises:
        ValueError: num_requests below 1, rate or burstiness not positive.
    """
    if num_requests < 1 or not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate / burstiness / num_requests: need > 0, > 0, >= 1; got {rate}, {burstiness}, "
                         f"{num_requests}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


@dataclass
class RequestTiming:
    """One request's times, in seconds from the run's start: its arrival, when each token (or chunk, over
    HTTP) arrived, when it finished; and its output tokens."""

    arrival: float
    token_times: list[float]
    finish: float
    output_tokens: int


def request_metrics(t: RequestTiming) -> dict:
    """TTFT, TPOT = (e2el - ttft) / (output_tokens - 1) (None for one token), inter-token latencies, e2el
    and the normalised latency e2el / output_tokens (s per token)."""
    ttft, e2el = t.token_times[0] - t.arrival, t.finish - t.arrival
    return {"ttft": ttft, "e2el": e2el, "tpot": (e2el - ttft) / (t.output_tokens - 1) if t.output_tokens > 1 else None,
            "itl": np.diff(t.token_times).tolist(), "normalized_latency": e2el / t.output_tokens}


def _stats(values, name: str) -> dict:
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if not len(v):
        return {f"{name}_mean_s": None, f"{name}_p50_s": None, f"{name}_p99_s": None}
    return {f"{name}_mean_s": float(v.mean()), f"{name}_p50_s": float(np.percentile(v, 50)),
            f"{name}_p99_s": float(np.percentile(v, 99))}


def summarize(timings: list[RequestTiming], expected_tokens: list[int], ttft_slo: float, tpot_slo: float,
              window: float | None = None) -> dict:
    """One mode at one rate: throughput over the run (first arrival to last finish), the latency statistics,
    goodput, the normalised latency, and ``answered_in_full`` (requests whose output has every token asked).

    ``window``: the seconds over which the requests arrive (n / rate); goodput counts the requests meeting both
    targets per second of it, so that it compares with the offered rate. Without it, per second of the run.
    """
    per = [request_metrics(t) for t in timings]
    duration = max(t.finish for t in timings) - min(t.arrival for t in timings)
    good = sum(m["ttft"] <= ttft_slo and (m["tpot"] is None or m["tpot"] <= tpot_slo) for m in per)
    out = sum(t.output_tokens for t in timings)
    report = {"num_requests": len(timings), "duration_s": duration,
              "answered_in_full": sum(t.output_tokens == n for t, n in zip(timings, expected_tokens)),
              "output_tokens": out, "request_throughput": len(timings) / duration,
              "output_tokens_per_s": out / duration, "goodput": good / (window or duration), "window_s": window,
              "normalized_latency_s": float(np.mean([m["normalized_latency"] for m in per]))}
    for name in ("ttft", "tpot", "e2el"):
        report.update(_stats([m[name] for m in per], name))
    report.update(_stats([x for m in per for x in m["itl"]], "itl"))
    return report


# ---- the modes ---------------------------------------------------------------------------------------
def _sleep_until(t0: float, at: float) -> None:
    time.sleep(max(0.0, t0 + at - time.perf_counter()))


def run_engine(model, reqs: list[BenchRequest], arrivals, engine_kwargs: dict) -> tuple[list[RequestTiming], dict]:
    """The engine in process: each request added at its arrival (between steps), steps while any is
    unfinished, otherwise waits for the next arrival. Returns the timings and the engine's memory summary."""
    engine = LLMEngine(model, **engine_kwargs)
    times: dict[int, list[float]] = {i: [] for i in range(len(reqs))}
    finish: dict[int, float] = {}
    nxt, t0 = 0, time.perf_counter()
    while nxt < len(reqs) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(reqs) and arrivals[nxt] <= now:
            r = reqs[nxt]
            engine.add_request(str(nxt), {"prompt_token_ids": r.prompt_token_ids}, _greedy(r.max_tokens),
                               arrival_time=t0 + arrivals[nxt])
            nxt += 1
        if not engine.has_unfinished_requests():
            _sleep_until(t0, arrivals[nxt])
            continue
        outputs = engine.step()
        now = time.perf_counter() - t0
        for out in outputs:
            i, n = int(out.request_id), len(out.outputs[0].token_ids)
            times[i] += [now] * (n - len(times[i]))
            if out.finished:
                finish[i] = now
    timings = [RequestTiming(float(arrivals[i]), times[i], finish[i], len(times[i])) for i in range(len(reqs))]
    summary = engine.stats.summary(engine.block_size)
    summary["rows_per_step_mean"] = float(np.mean([len(r.runs) for r in engine.stats.records]))
    return timings, summary


def run_static(model, reqs: list[BenchRequest], arrivals, batch_size: int) -> list[RequestTiming]:
    """Static batching: when idle, take up to ``batch_size`` requests that have arrived and run them as one
    ``generate_batch`` (left padded, until the longest output); token k of a request arrives when the batch's
    step k ends (``step_s``), and the next batch starts when this one returns."""
    timings: list[RequestTiming | None] = [None] * len(reqs)
    waiting: list[int] = []
    nxt, t0 = 0, time.perf_counter()
    while nxt < len(reqs) or waiting:
        now = time.perf_counter() - t0
        while nxt < len(reqs) and arrivals[nxt] <= now:
            waiting.append(nxt)
            nxt += 1
        if not waiting:
            _sleep_until(t0, arrivals[nxt])
            continue
        batch, waiting = waiting[:batch_size], waiting[batch_size:]
        start = time.perf_counter() - t0
        longest = max(reqs[i].max_tokens for i in batch)
        results = generate_batch(model, [reqs[i].prompt_token_ids for i in batch], _greedy(longest),
                                 max_seq_len=max(len(reqs[i].prompt_token_ids) for i in batch) + longest)
        for i, g in zip(batch, results):
            n = reqs[i].max_tokens
            token_times = (start + np.cumsum(g.step_s[:n])).tolist()
            timings[i] = RequestTiming(float(arrivals[i]), token_times, token_times[-1], n)
    return timings


def run_http(model, tokenizer, reqs: list[BenchRequest], arrivals, engine_kwargs: dict) -> tuple[list[RequestTiming], dict]:
    """The engine behind the server's app (``minillm.server``) on 127.0.0.1 and a free port, one streaming
    client per request started at its arrival (httpx); output tokens from the stream's usage chunk."""
    import httpx

    from ..server.app import ServerThread, create_app
    from ..server.loop import EngineLoop

    engine = LLMEngine(model, tokenizer, **engine_kwargs)
    loop = EngineLoop(engine)

    async def clients(url: str) -> list[RequestTiming]:
        limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs))
        async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
            t0 = time.perf_counter()

            async def one(i: int) -> RequestTiming:
                await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
                body = {"prompt": reqs[i].prompt_token_ids, "max_tokens": reqs[i].max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                times, tokens, end = [], 0, None
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"request {i}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now, data = time.perf_counter() - t0, json.loads(line[6:])
                        if "error" in data:
                            raise RuntimeError(f"request {i}: {data['error']['message']}")
                        if data.get("usage"):
                            tokens = data["usage"]["completion_tokens"]
                        for c in data["choices"]:
                            if c["text"]:
                                times.append(now)
                            if c["finish_reason"] is not None:
                                end = now
                return RequestTiming(float(arrivals[i]), times, end, tokens)

            return await asyncio.gather(*(one(i) for i in range(len(reqs))))

    with ServerThread(create_app(loop, "bench")) as server:
        timings = asyncio.run(clients(server.url))
        summary = loop.call(lambda e: {**e.stats.summary(e.block_size),
                                       "rows_per_step_mean": float(np.mean([len(r.runs) for r in e.stats.records]))})
        summary = summary.result(60)
    return timings, summary


# ---- the benchmark -----------------------------------------------------------------------------------
def sustained_rate(rates, latencies, threshold: float) -> tuple[float, bool]:
    """The request rate at which ``latencies`` (ascending ``rates``) first reach ``threshold``, linearly
    interpolated between measured rates; (rate, censored): censored when no measured rate reaches it (the
    rate is then a lower bound, the highest measured). A latency above it at the lowest rate gives 0."""
    for i, (r, v) in enumerate(zip(rates, latencies)):
        if v > threshold:
            if i == 0:
                return 0.0, False
            r0, v0 = rates[i - 1], latencies[i - 1]
            return float(r0 + (threshold - v0) * (r - r0) / (v - v0)), False
    return float(rates[-1]), True


def online_bench(model, tokenizer, rates, *, burstiness: float = 1.0, duration: float = 10.0, http: bool = False,
                 trace: str = "sharegpt", scale: float = 0.25, seed: int = 0, block_size: int = 16,
                 num_blocks: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 256,
                 ttft_slo: float = 2.0, tpot_slo: float = 0.25, min_requests: int = 2,
                 progress: bool = True) -> dict:
    """Every mode at every rate (round(rate * duration) requests, at least ``min_requests``, arriving over
    count / rate seconds, the window goodput is counted over: ask for 10 or more where a low rate's goodput
    should not be a ratio of two requests); the report: settings,
    ``modes`` {mode: [summary per rate]}, the knee and the rates each mode sustains there, and ``goals``.

    Raises:
        ValueError: no rate, a rate or burstiness not positive, duration not positive, min_requests below 1
            (before any run).
    """
    rates = sorted(float(r) for r in rates)
    if not rates or rates[0] <= 0 or duration <= 0 or burstiness <= 0:
        raise ValueError(f"rate / duration / burstiness: need positive values, got {rates}, {duration}, {burstiness}")
    if min_requests < 1:
        raise ValueError(f"min_requests: need at least 1 request per rate, got {min_requests}")
    if not math.isfinite(rates[-1]):
        raise ValueError("rate: must be finite (requests per second); for every request at once run serve-bench "
                         "without --online")
    counts = [max(min_requests, round(r * duration)) for r in rates]
    pool = make_requests(tokenizer, max(counts), trace, scale, seed)
    engine_kwargs = dict(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens)
    generate_cached(model, pool[0].prompt_token_ids, _greedy(2))  # warm-up
    modes: dict[str, list[dict]] = {"engine": [], "static": []} | ({"http": []} if http else {})
    for rate, n in zip(rates, counts):
        reqs, arrivals = pool[:n], arrival_times(n, rate, burstiness, seed)
        expected = [r.max_tokens for r in reqs]
        for mode in modes:
            if progress:
                print(f"rate {rate:g}/s, {n} requests: {mode}", file=sys.stderr, flush=True)
            if mode == "engine":
                timings, mem = run_engine(model, reqs, arrivals, engine_kwargs)
            elif mode == "static":
                timings, mem = run_static(model, reqs, arrivals, max_num_seqs), None
            else:
                timings, mem = run_http(model, tokenizer, reqs, arrivals, engine_kwargs)
            row = {"rate": rate, **summarize(timings, expected, ttft_slo, tpot_slo, window=n / rate)}
            if mem is not None:
                row.update({k: mem[k] for k in ("steps", "preemptions", "peak_blocks", "rows_per_step_mean")})
            modes[mode].append(row)
    report = {"machine": machine(), "dtype": dtype_name(model.dtype), "trace": trace, "scale": scale, "seed": seed,
              "rates": rates, "burstiness": burstiness, "duration_s": duration, "min_requests": min_requests,
              "block_size": block_size,
              "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
              "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo,
              "mean_prompt": float(np.mean([len(r.prompt_token_ids) for r in pool])),
              "mean_output": float(np.mean([r.max_tokens for r in pool])), "modes": modes, "paper": PAPER}
    report["knee"] = knee(report)
    report["goals"] = goals(report)
    return report


def knee(report: dict) -> dict:
    """The normalised latency where static batching's curve turns up (``KNEE`` x its value at the lowest
    rate) and the rate each mode sustains below it (``sustained_rate``)."""
    static = report["modes"]["static"]
    threshold = KNEE * static[0]["normalized_latency_s"]
    out = {"threshold_s": threshold, "rule": f"{KNEE:g}x static batching's normalised latency at the lowest rate"}
    for mode, rows in report["modes"].items():
        rate, censored = sustained_rate([r["rate"] for r in rows], [r["normalized_latency_s"] for r in rows], threshold)
        out[mode] = {"rate": rate, "at_least": censored}
    return out


def goals(report: dict) -> dict:
    """The issue's goals with measured values: the engine sustains >= 2x static batching's rate at the knee
    (undecided when static never reaches it), and over HTTP >= 0.8x the in-process output tokens/s at the
    highest rate (``saturating``: whether the engine completed requests at under half the rate they arrived
    there, so that the rate, not the arrivals, bounds its throughput, as the goal asks)."""
    k, g = report["knee"], {}
    e, s = k["engine"], k["static"]
    ratio = e["rate"] / s["rate"] if s["rate"] > 0 and not s["at_least"] else None
    if ratio is None:
        held = None  # static batching never turned up: nothing to compare at
    elif ratio >= GOALS["engine_vs_static_rate"]:
        held = True  # an engine that never turned up only makes its true ratio larger
    else:
        held = None if e["at_least"] else False
    g["engine_vs_static_rate"] = {"measured": ratio, "at_least": e["at_least"], "goal": GOALS["engine_vs_static_rate"],
                                  "held": held}
    if "http" in report["modes"]:
        top = report["modes"]["engine"][-1]
        ratio = report["modes"]["http"][-1]["output_tokens_per_s"] / top["output_tokens_per_s"]
        g["http_vs_in_process"] = {"measured": ratio, "rate": report["rates"][-1], "goal": GOALS["http_vs_in_process"],
                                   "held": ratio >= GOALS["http_vs_in_process"],
                                   # the engine completed requests at under half the rate they arrived
                                   "saturating": top["request_throughput"] < 0.5 * top["rate"]}
    return g


def format_report(report: dict) -> str:
    """One table per mode (a row per rate), then the knee and the goals."""
    lines = [f"machine: {report['machine']}", f"{report['trace']}-like lengths x {report['scale']} (mean prompt "
             f"{report['mean_prompt']:.0f}, output {report['mean_output']:.0f} tokens), arrivals gamma(burstiness "
             f"{report['burstiness']:g}) for {report['duration_s']:g} s per rate, greedy, {report['dtype']}, "
             f"max_num_seqs {report['max_num_seqs']} (also the static batch), goodput targets TTFT <= "
             f"{report['ttft_slo_s']:g} s, TPOT <= {report['tpot_slo_s']:g} s"]
    head = (f"{'mode':<7}{'rate/s':>7}{'reqs':>5}{'full':>5}{'req/s':>7}{'out tok/s':>10}{'goodput':>8}"
            f"{'TTFT mean/p50/p99 s':>22}{'TPOT mean/p50/p99 s':>22}{'ITL p50/p99 s':>15}{'E2E p50/p99 s':>15}"
            f"{'norm. lat. s/tok':>17}")
    lines.append(head)
    for mode, rows in report["modes"].items():
        for r in rows:
            def three(n):
                return "/".join("-" if r[f"{n}_{q}_s"] is None else f"{r[f'{n}_{q}_s']:.3f}" for q in ("mean", "p50", "p99"))
            lines.append(f"{mode:<7}{r['rate']:>7g}{r['num_requests']:>5}{r['answered_in_full']:>5}"
                         f"{r['request_throughput']:>7.2f}{r['output_tokens_per_s']:>10.1f}{r['goodput']:>8.2f}"
                         f"{three('ttft'):>22}{three('tpot'):>22}"
                         f"{r['itl_p50_s'] or 0:>8.3f}/{r['itl_p99_s'] or 0:<6.3f}{r['e2el_p50_s']:>8.2f}/"
                         f"{r['e2el_p99_s']:<6.2f}{r['normalized_latency_s']:>17.4f}")
    k = report["knee"]
    lines.append(f"knee: normalised latency {k['threshold_s']:.4f} s/token ({k['rule']}); sustained there: " +
                 ", ".join(f"{m} {'>= ' if k[m]['at_least'] else ''}{k[m]['rate']:.2f}/s" for m in report["modes"]))
    for name, v in report["goals"].items():
        if v["measured"] is None:
            lines.append(f"goal {name}: not measured (static batching never reached the knee; raise the rates)")
            continue
        verdict = {True: "held", False: "NOT met", None: "undecided (raise the rates)"}[v["held"]]
        bound = ">= " if v.get("at_least") else ""
        note = "" if v.get("saturating", True) else " (the engine was not saturated at that rate: raise it)"
        lines.append(f"goal {name}: {bound}{v['measured']:.2f}x vs {v['goal']}x -> {verdict}{note}")
    return "\n".join(lines)


def plot_latency(report: dict, path) -> Path:
    """Normalised latency (s/token) against request rate, one curve per mode, the knee as a dashed line
    (the paper's Fig. 12 axes). Writes a PNG at ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    styles = {"engine": ("tab:blue", "o-", "engine (continuous batching, paged)"),
              "static": ("tab:orange", "s-", "static batching (memory reserved per request)"),
              "http": ("tab:green", "^--", "engine over HTTP (minillm serve)")}
    for mode, rows in report["modes"].items():
        colour, marker, label = styles[mode]
        ax.plot([r["rate"] for r in rows], [r["normalized_latency_s"] for r in rows], marker, color=colour, label=label)
    ax.axhline(report["knee"]["threshold_s"], color="grey", ls=":", lw=1, label="knee (2x static at the lowest rate)")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("normalised latency (s/token)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{report['trace']}-like x {report['scale']}, burstiness {report['burstiness']:g}, "
                 f"{report['machine'].split(',')[0]}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def cmd_online(args) -> int:
    """``serve-bench --online``: parse the rates, load the model, run, print (``--json``: one line), write the
    figure and the record under ``--out``; returns the exit code (0)."""

    try:
        rates = [float(r) for r in args.rate.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"rate: expected comma-separated requests per second, got {args.rate!r}") from None
    if not rates or min(rates) <= 0 or not all(math.isfinite(r) for r in rates):
        raise ValueError(f"rate: each rate must be > 0 and finite, got {args.rate!r}")
    if not args.burstiness > 0 or not args.duration > 0:
        raise ValueError(f"burstiness / duration: must be > 0, got {args.burstiness} / {args.duration}")
    if args.requests is not None:
        raise ValueError("requests: --online draws rate x --duration requests at each rate; drop --requests")
    out = Path(args.out) if args.out is not None else runs_folder()
    if args.out is None:
        out.mkdir(parents=True, exist_ok=True)
    check_output_path(out, "--out", folder=True)  # before minutes of measuring
    out.mkdir(exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    scale = args.scale if args.scale is not None else 0.25
    scale, duration = (min(scale, 1 / 32), min(args.duration, 1.0)) if args.quick else (scale, args.duration)
    model, tokenizer = load(args)
    report = online_bench(model, tokenizer, rates, burstiness=args.burstiness, duration=duration, http=args.http,
                          trace=args.trace, scale=scale, block_size=args.block_size, num_blocks=args.num_blocks,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo, progress=not args.json)
    report["figure"] = str(plot_latency(report, out / "online_latency.png"))

    report["record"] = str(record(report, out / "online.json", "python -m minillm " + " ".join(sys.argv[1:])))
    if args.json:
        print_json(report)
    else:
        print(format_report(report))
        print(f"figure: {report['figure']}; record: {report['record']}", file=sys.stderr)
    return 0
