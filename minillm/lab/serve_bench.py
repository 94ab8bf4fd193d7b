"""serve-bench: offline throughput of the engine against one request at a time, static batches and
transformers' continuous batching, on the same requests, in one process (Kwon et al. 2023, vLLM, Sec. 6;
Yu et al. 2022, Orca, Sec. 5: continuous over static batching).

The requests (``make_requests``): lengths from the fragmentation lab's log-normal traces
(``minillm.paged.fragmentation.make_trace``) times ``scale`` (default 1/4, so that the sequential mode
fits minutes on a 2-core CPU), prompts cut at seeded offsets from a play (``minillm.data.play_text``),
every request arriving at time 0, greedy, EOS ignored. Each mode reports output and total tokens/s, time
to first token (queueing included) and time per output token, p50 / p99. The engine also reports its
memory: peak and mean blocks, ``kv_utilization`` beside the lab's prediction, preemptions and the
prefix-cache hit rate. ``memory_run`` measures that share at the trace's full lengths on a tiny random
model (memory accounting does not depend on the weights); ``sharing_run`` measures blocks saved by
n = 4 sampling and beam width 4 on the real model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from tqdm.auto import tqdm

from ..data import HELD_OUT_PLAY, play_text
from ..generation import generate_batch, generate_cached
from ..config import ModelConfig
from ..model import Decoder
from ..paged.beam import BeamSearchParams
from ..paged.engine import LLMEngine
from ..paged.fragmentation import MAX_SEQ_LEN, TRACES, kv_utilization, make_trace
from ..sampling_params import SamplingParams
from ..fast.threads import torch_default_threads
from ..timing import dtype_name, machine
from .background import busy_note
from .engine_costs import linear_floor
from .peers import load_transformers_peer

PAPER = {"throughput_vs_orca": "2-4x (Sec. 6.2)", "parallel_sampling_saved": "6.1-30.5% (Sec. 6.3)",
         "beam_search_saved": "37.6-66.3% (Sec. 6.3)", "kv_utilization": 0.963,
         "orca_vs_static": "36.9x (Orca, GPT-3 175B)", "cb_vs_static_anyscale": "8x (Anyscale blog)"}
GOALS = {"engine_vs_sequential": 4.0, "engine_vs_static": 1.3, "engine_vs_transformers": 3.0,
         "engine_spec_vs_transformers": 3.0, "kv_utilization": 0.96, "kv_vs_lab_points": 1.0}
#: the engine with speculation, the command's extra row: prompt lookup with the draft length chosen per step
#: (exact: the greedy tokens are the plain engine's)
SPEC_ROW = {"method": "ngram", "num_speculative_tokens": "auto"}


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def make_requests(tokenizer, num_requests: int = 64, trace: str = "sharegpt", scale: float = 0.25,
                  seed: int = 0, play: str = HELD_OUT_PLAY) -> list[BenchRequest]:
    """Requests with the trace's lengths times ``scale`` (at least 4 prompt tokens and 1 output token),
    prompts cut from ``play`` at offsets drawn with ``seed``.

    Raises:
        ValueError: an unknown trace, num_requests below 1, scale not in (0, 1].
    """
    lengths = request_lengths(num_requests, trace, scale, seed)  # checks the arguments first
    text = tokenizer.encode(play_text(play))
    rng = np.random.default_rng(seed)
    reqs = []
    for p, o in lengths:
        start = int(rng.integers(0, len(text) - p))
        reqs.append(BenchRequest(text[start:start + p], o))
    return reqs


def request_lengths(num_requests: int = 64, trace: str = "sharegpt", scale: float = 0.25,
                    seed: int = 0) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each request ``make_requests`` builds, without a tokenizer: the
    trace's lengths times ``scale``, at least 4 and 1. The command checks its options against them before
    it loads a model.

    Raises:
        ValueError: an unknown trace, num_requests below 1, scale not in (0, 1].
    """
    if trace not in TRACES:
        raise ValueError(f"trace: {trace!r} is not one of {sorted(TRACES)}")
    if num_requests < 1 or not 0 < scale <= 1:
        raise ValueError(f"num_requests / scale: need >= 1 and (0, 1], got {num_requests} / {scale}")
    prompt, output = make_trace(replace(TRACES[trace], num_requests=num_requests, seed=seed))
    return [(max(4, round(p * scale)), max(1, round(o * scale))) for p, o in zip(prompt.tolist(), output.tolist())]


def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def _summary(reqs, wall, ttft, tpot, tokens) -> dict:
    out = sum(r.max_tokens for r in reqs)
    total = out + sum(len(r.prompt_token_ids) for r in reqs)
    return {"wall_s": wall, "output_tokens": out, "total_tokens": total, "output_tokens_per_s": out / wall,
            "total_tokens_per_s": total / wall, "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99), "tokens": tokens}


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def run_sequential(model, reqs: list[BenchRequest]) -> dict:
    """One request at a time with ``generate_cached``; request k waits for the k before it."""
    t0, ttft, tpot, tokens = time.perf_counter(), [], [], []
    for r in reqs:
        start = time.perf_counter()
        g = generate_cached(model, r.prompt_token_ids, _greedy(r.max_tokens),
                            max_seq_len=len(r.prompt_token_ids) + r.max_tokens)  # a cache of what it needs
        ttft.append(start - t0 + g.prefill_s)
        if r.max_tokens > 1:
            tpot.append(g.decode_s / (r.max_tokens - 1))
        tokens.append(g.tokens)
    return _summary(reqs, time.perf_counter() - t0, ttft, tpot, tokens)


def run_static(model, reqs: list[BenchRequest], batch_size: int) -> dict:
    """Static batches of ``batch_size`` in arrival order (``generate_batch``: left padded to the longest
    prompt, run until the longest output of the batch ends; a request's tokens are its first max_tokens)."""
    t0, ttft, tpot, tokens = time.perf_counter(), [], [], []
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        start = time.perf_counter()
        longest = max(r.max_tokens for r in batch)
        results = generate_batch(model, [r.prompt_token_ids for r in batch], _greedy(longest),
                                 max_seq_len=max(len(r.prompt_token_ids) for r in batch) + longest)
        for r, g in zip(batch, results):
            ttft.append(start - t0 + g.step_s[0])
            if r.max_tokens > 1:
                tpot.append(sum(g.step_s[1:r.max_tokens]) / (r.max_tokens - 1))
            tokens.append(g.tokens[:r.max_tokens])
    return _summary(reqs, time.perf_counter() - t0, ttft, tpot, tokens)


def drive_engine(engine, reqs: list[BenchRequest], progress=None):
    """Add every request at time 0 (greedy) and step until all finish; returns the finished outputs in the
    requests' order, the wall time and each request's TTFT and TPOT (seconds)."""
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids}, _greedy(r.max_tokens), arrival_time=t0)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
                if progress is not None:
                    progress.update(1)
    wall = time.perf_counter() - t0
    outs = [done[i] for i in range(len(reqs))]
    ttft = [o.metrics.first_token_time - t0 for o in outs]
    tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / (r.max_tokens - 1)
            for o, r in zip(outs, reqs) if r.max_tokens > 1]
    return outs, wall, ttft, tpot


def run_engine(model, reqs: list[BenchRequest], *, block_size: int = 16, num_blocks: int | None = None,
               max_num_seqs: int = 64, max_num_batched_tokens: int = 256, progress=None,
               speculative_config: dict | None = None, trace=None) -> dict:
    """The engine, every request added at time 0; adds its memory figures, the lab's prediction and
    ``rows_per_step_mean`` (sequences in a step's forward, the mean over steps); with ``speculative_config``,
    the drafts' acceptance instead of the linear layers' floor; ``trace``: the engine's trace file, or None."""
    engine = LLMEngine(model, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, speculative_config=speculative_config,
                       trace=trace)
    outs, wall, ttft, tpot = drive_engine(engine, reqs, progress)
    report = _summary(reqs, wall, ttft, tpot, [o.outputs[0].token_ids for o in outs])
    mem = engine.stats.summary(block_size)
    lab = kv_utilization([len(r.prompt_token_ids) for r in reqs], [r.max_tokens for r in reqs],
                         f"paged_{block_size}")
    report.update({k: mem[k] for k in ("kv_utilization", "preemptions", "prefix_hit_rate", "peak_blocks",
                                       "mean_blocks", "steps")})
    report.update({"lab_kv_utilization": lab, "num_blocks": engine.num_blocks,
                   "rows_per_step_mean": float(np.mean([len(rec.runs) for rec in engine.stats.records]))})
    if speculative_config is not None:
        spec = engine.stats.spec_decoding
        report.update({"speculative_config": dict(speculative_config), "num_draft_tokens": spec.num_draft_tokens,
                       "num_accepted_tokens": spec.num_accepted_tokens,
                       "acceptance_rate": spec.num_accepted_tokens / max(1, spec.num_draft_tokens)})
    else:
        floor = linear_floor(model, engine.stats.records)  # after the wall clock: not part of the engine's time
        report.update({"linear_s": floor["linear_s"], "linear_grid": floor["grid"],
                       "linear_only_tokens_per_s": report["output_tokens"] / floor["linear_s"]})
    report["engine"] = engine  # for the notebook's timeline; removed before JSON
    return report


def run_transformers(hf, reqs: list[BenchRequest], max_num_seqs: int = 64, kv_tokens: int | None = None) -> dict:
    """transformers' continuous batching (``ContinuousBatchingManager``, its paged SDPA attention on the CPU),
    each request with its own max_new_tokens, EOS never ending one (eos_token_id -1), greedy, with torch's
    default threads (``minillm.threads.torch_default_threads``: how it runs without minillm choosing).

    ``kv_tokens`` gives its pool the engine's KV capacity (in its own 256-token pages): left to itself it
    sizes the cache from the free memory, which on a machine shared with other jobs ends in the OOM killer,
    and the comparison is fairer with the same memory on both sides."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs), eos_token_id=-1,
                              pad_token_id=0)
    t0 = time.perf_counter()
    results = {}
    pool = {}
    if kv_tokens is not None:
        page = ContinuousBatchingConfig().page_size
        pool["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=-(-kv_tokens // page))
    with torch_default_threads(), hf.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=5, warmup=False, **pool) as manager:
        for i, r in enumerate(reqs):
            manager.add_request(r.prompt_token_ids, request_id=str(i), max_new_tokens=r.max_tokens,
                                record_timestamps=True, eos_token_id=-1)
        while len(results) < len(reqs):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[int(result.request_id)] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before every request finished")
    wall = time.perf_counter() - t0
    outs = [results[i] for i in range(len(reqs))]
    ttft = [o.timestamps[0] - t0 for o in outs]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) for o in outs if len(o.timestamps) > 1]
    return _summary(reqs, wall, ttft, tpot, [list(o.generated_tokens) for o in outs])


def memory_run(trace: str = "sharegpt", num_requests: int = 64, block_size: int = 16, max_num_seqs: int = 64,
               seed: int = 0) -> dict:
    """The engine's kv_utilization at the trace's full lengths (requests scaled in number, not length) on
    a one-layer random model, beside the lab's prediction for the same lengths; returns both."""
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layers=1, dim=32, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=32, vocab_size=64,
                      max_seq_len=MAX_SEQ_LEN)
    state = {"tok_embeddings.weight": torch.randn(64, 32), "norm.weight": torch.ones(32)}
    state.update({f"layers.0.{k}": torch.randn(*s) / 8 for k, s in (
        ("attn.wq.weight", (32, 32)), ("attn.wk.weight", (16, 32)), ("attn.wv.weight", (16, 32)),
        ("attn.wo.weight", (32, 32)), ("mlp.w_gate.weight", (32, 32)), ("mlp.w_up.weight", (32, 32)),
        ("mlp.w_down.weight", (32, 32)))})
    state.update({"layers.0.attn_norm.weight": torch.ones(32), "layers.0.ffn_norm.weight": torch.ones(32)})
    model = Decoder(cfg, state).eval()
    prompt, output = make_trace(replace(TRACES[trace], num_requests=num_requests, seed=seed))
    engine = LLMEngine(model, block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                       enable_prefix_caching=False, eos_ids=set())
    rng = np.random.default_rng(seed)
    for i, (p, o) in enumerate(zip(prompt.tolist(), output.tolist())):
        engine.add_request(str(i), rng.integers(0, 64, p).tolist(), _greedy(o))
    while engine.has_unfinished_requests():
        engine.step()
    mem = engine.stats.summary(block_size)
    return {"trace": trace, "num_requests": num_requests, "block_size": block_size, "max_num_seqs": max_num_seqs,
            "mean_prompt": float(prompt.mean()), "mean_output": float(output.mean()),
            "kv_utilization": mem["kv_utilization"], "preemptions": mem["preemptions"],
            "lab_kv_utilization": kv_utilization(prompt, output, f"paged_{block_size}")}


def sharing_run(model, reqs: list[BenchRequest], block_size: int = 16, width: int = 4) -> dict:
    """Blocks saved by sharing (1 - blocks in use / blocks the sequences would hold unshared, summed over
    steps) for n = ``width`` parallel samples (temperature 1, seed 0) and beam width ``width``."""
    out = {}
    for name, params in (("parallel_sampling", lambda r: SamplingParams(n=width, temperature=1.0, seed=0,
                                                                        max_tokens=r.max_tokens, ignore_eos=True)),
                         ("beam_search", lambda r: BeamSearchParams(width, r.max_tokens, ignore_eos=True))):
        engine = LLMEngine(model, block_size=block_size, max_num_seqs=64 * width)
        for i, r in enumerate(reqs):
            engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids}, params(r))
        while engine.has_unfinished_requests():
            engine.step()
        out[name] = engine.stats.summary(block_size)["sharing_saved"]
    return {"width": width, "num_requests": len(reqs), **out}


def serve_bench(model, tokenizer, *, num_requests: int = 64, trace: str = "sharegpt", scale: float = 0.25,
                block_size: int = 16, num_blocks: int | None = None, max_num_seqs: int = 64,
                max_num_batched_tokens: int = 256, peer: bool = False, sharing_requests: int = 8,
                memory_requests: int = 64, progress: bool = True, speculative_config: dict | None = None,
                peer_repeats: int = 1, trace_out=None) -> dict:
    """Every mode on the same requests, then the memory and sharing runs; the report described in the
    module docstring (``modes`` keyed engine / engine+spec / static / sequential / transformers; engine+spec only
    with ``speculative_config``, the engine's with speculation). With ``peer`` and ``peer_repeats`` > 1 the engine
    and transformers run that many turns, one after the other: each keeps its run of median tokens/s, and the
    goal is the median of the turns' ratios (the peer's speed moves by up to a quarter between runs here).
    ``trace_out``: the first engine run's trace (``LLMEngine(trace=...)``), or None."""
    reqs = make_requests(tokenizer, num_requests, trace, scale)
    generate_cached(model, reqs[0].prompt_token_ids, _greedy(2))  # warm-up
    modes = {}
    names = (["engine"] + (["engine+spec"] if speculative_config else []) + ["static", "sequential"]
             + (["transformers"] if peer else []))
    # transformers runs right after the engine, so that each turn's two runs are minutes apart at most
    order = ["engine"] + (["transformers"] if peer else []) + [n for n in names if n not in ("engine", "transformers")]
    later = ["engine", "transformers"] * (peer_repeats - 1 if peer else 0)  # the later turns
    runs: dict[str, list[dict]] = {name: [] for name in names}
    hf = None
    # the bar counts requests run, the sharing runs' too (n samples, then beams): they come after the modes
    shared = reqs[:sharing_requests]
    total = len(order + later) * len(reqs) + 2 * len(shared)
    extra = {}  # the memory and sharing runs' results, into the report after the modes
    with tqdm(total=total, desc="serve-bench", disable=not progress) as bar:
        for name in order + later:
            bar.set_postfix_str(name)
            if name in ("engine", "engine+spec"):
                run = run_engine(model, reqs, block_size=block_size, num_blocks=num_blocks,
                                 max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 progress=bar, speculative_config=speculative_config if name != "engine" else None,
                                 trace=trace_out if name == "engine" and not runs["engine"] else None)
            elif name == "sequential":
                run = run_sequential(model, reqs)
            elif name == "static":
                run = run_static(model, reqs, max_num_seqs)
            else:
                if hf is None:
                    # "sdpa": the manager pages it; transformers 5 deprecates the older name "paged|sdpa"
                    hf = load_transformers_peer(dtype=model.dtype, attn_implementation="sdpa")
                run = run_transformers(hf, reqs, max_num_seqs, kv_tokens=runs["engine"][0]["num_blocks"] * block_size)
            if runs[name]:  # a later turn: its engine (and KV pool) is not kept
                run.pop("engine", None)
            runs[name].append(run)
            if name not in ("engine", "engine+spec"):
                bar.update(len(reqs))
        if memory_requests:
            bar.set_postfix_str("memory")
            extra["memory"] = memory_run(trace, memory_requests, block_size, max_num_seqs)
        if shared:
            bar.set_postfix_str("sharing")
            extra["sharing"] = sharing_run(model, shared, block_size)
            bar.update(2 * len(shared))
    for name in names:
        modes[name] = median_run(runs[name], "output_tokens_per_s")
    engine = runs["engine"][0]["engine"]
    ref = modes["sequential"]["tokens"]
    for m in modes.values():
        m.pop("engine", None)
        m["same_tokens_as_sequential"] = sum(a == b for a, b in zip(m.pop("tokens"), ref))
    report = {"machine": machine(), "dtype": dtype_name(model.dtype), "trace": trace, "scale": scale,
              "num_requests": num_requests, "block_size": block_size, "max_num_seqs": max_num_seqs,
              "max_num_batched_tokens": max_num_batched_tokens,
              "mean_prompt": float(np.mean([len(r.prompt_token_ids) for r in reqs])),
              "mean_output": float(np.mean([r.max_tokens for r in reqs])), "modes": modes, "paper": PAPER}
    report.update(extra)
    if later:
        report["turns"] = [{"engine": e["output_tokens_per_s"], "transformers": t["output_tokens_per_s"]}
                           for e, t in zip(runs["engine"], runs["transformers"])]
    report["goals"] = goals(report)
    report["_engine"] = engine
    return report


def median_run(runs: list[dict], key: str) -> dict:
    """The run of median ``key`` (the lower middle of an even count) with every run's value as ``key + "_runs"``;
    a single run as it is."""
    if len(runs) == 1:
        return runs[0]
    mid = sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]
    return dict(mid, **{f"{key}_runs": [r[key] for r in runs]})


def goals(report: dict) -> dict:
    """Each of the engine's serving goals with its measured value and whether it held (None where not measured)."""
    m, g = report["modes"], {}
    e = m["engine"]["output_tokens_per_s"]
    for name, key in (("sequential", "engine_vs_sequential"), ("static", "engine_vs_static"),
                      ("transformers", "engine_vs_transformers")):
        ratio = e / m[name]["output_tokens_per_s"] if name in m else None
        if name == "transformers" and report.get("turns"):  # the median of the turns' ratios
            ratio = float(np.median([t["engine"] / t["transformers"] for t in report["turns"]]))
        g[key] = {"measured": ratio, "goal": GOALS[key], "held": None if ratio is None else ratio >= GOALS[key]}
    if "engine+spec" in m:
        key = "engine_spec_vs_transformers"
        ratio = (m["engine+spec"]["output_tokens_per_s"] / m["transformers"]["output_tokens_per_s"]
                 if "transformers" in m else None)
        g[key] = {"measured": ratio, "goal": GOALS[key], "held": None if ratio is None else ratio >= GOALS[key]}
    mem = report.get("memory")
    if mem:
        g["kv_utilization"] = {"measured": mem["kv_utilization"], "goal": GOALS["kv_utilization"],
                               "held": mem["kv_utilization"] >= GOALS["kv_utilization"]}
    points = [100 * abs(x["kv_utilization"] - x["lab_kv_utilization"]) for x in (m["engine"], mem or {}) if x]
    g["kv_vs_lab_points"] = {"measured": max(points), "goal": GOALS["kv_vs_lab_points"],
                             "held": max(points) <= GOALS["kv_vs_lab_points"]}
    return g


def format_report(report: dict, goals: bool = True) -> str:
    """The table: one row per mode, then memory, sharing and (``goals``) the command's goals."""
    busy = report.get("background_load", 0)
    lines = [f"machine: {report['machine']}" + busy_note(busy),
             f"{report['num_requests']} requests, {report['trace']}-like lengths x "
             f"{report['scale']} (mean prompt {report['mean_prompt']:.0f}, output {report['mean_output']:.0f} tokens), "
             f"all at t=0, greedy, {report['dtype']}, block {report['block_size']}, max_num_seqs "
             f"{report['max_num_seqs']}, budget {report['max_num_batched_tokens']} tokens/step",
             f"{'mode':<13}{'out tok/s':>10}{'total tok/s':>12}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}"
             f"{'wall s':>8}  same tokens"]
    for name, m in report["modes"].items():
        lines.append(f"{name:<13}{m['output_tokens_per_s']:>10.1f}{m['total_tokens_per_s']:>12.1f}{m['ttft_p50_s']:>10.2f}"
                     f"{m['ttft_p99_s']:>8.2f}{m['tpot_p50_s']:>10.3f}{m['tpot_p99_s']:>8.3f}{m['wall_s']:>8.1f}  "
                     f"{m['same_tokens_as_sequential']}/{report['num_requests']}")
    e = report["modes"]["engine"]
    lines.append(f"engine memory: peak {e['peak_blocks']} / mean {e['mean_blocks']:.1f} of {e['num_blocks']} blocks, "
                 f"kv_utilization {100 * e['kv_utilization']:.1f}% (lab predicts {100 * e['lab_kv_utilization']:.1f}%), "
                 f"{e['preemptions']} preemptions, prefix hit rate {100 * e['prefix_hit_rate']:.1f}%, {e['steps']} steps")
    if "engine+spec" in report["modes"]:
        x = report["modes"]["engine+spec"]
        lines.append(f"engine+spec: the engine with speculative_config={x['speculative_config']}: {x['steps']} steps "
                     f"against {e['steps']}, {100 * x['acceptance_rate']:.0f}% of {x['num_draft_tokens']} draft tokens "
                     "accepted")
    if report.get("turns"):
        lines.append(f"{len(report['turns'])} turns of engine / transformers (output tok/s): " + ", ".join(
            f"{t['engine']:.1f} / {t['transformers']:.1f}" for t in report["turns"]) + "; rows above: each one's median run")
    if "linear_s" in e:
        lines.append(f"engine time in the linear layers alone (its step shapes, timed apart): {e['linear_s']:.1f} of "
                     f"{e['wall_s']:.1f} s; with nothing else, {e['linear_only_tokens_per_s']:.0f} output tok/s")
    if "memory" in report:
        x = report["memory"]
        lines.append(f"full {x['trace']} lengths ({x['num_requests']} requests, mean {x['mean_prompt']:.0f} / "
                     f"{x['mean_output']:.0f}): kv_utilization {100 * x['kv_utilization']:.1f}% (lab "
                     f"{100 * x['lab_kv_utilization']:.1f}%, paper 96.3%)")
    if "sharing" in report:
        s = report["sharing"]
        lines.append(f"sharing saves: n={s['width']} sampling {100 * s['parallel_sampling']:.1f}% (paper 6.1-30.5%), "
                     f"beam width {s['width']} {100 * s['beam_search']:.1f}% (paper 37.6-66.3%)")
    for k, v in (report["goals"] if goals else {}).items():
        if v["measured"] is not None:
            lines.append(f"goal {k} ({report['trace']} trace{', busy' if busy else ''}): {v['measured']:.3g} vs "
                         f"{v['goal']} -> {'held' if v['held'] else 'NOT met'}")
    return "\n".join(lines)

