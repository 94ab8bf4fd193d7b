"""``python -m minillm bench decode``: batch-1 decode tokens/s of the naive path, the KV caches and
transformers on the same weights; the KV cache's step time against position (notebook 02) and its figure.
``--peer llamacpp`` runs ``minillm.lab.llamacpp`` instead: minillm's 4-bit paths beside llama.cpp. The
command itself (parse, call, print) is in ``minillm.cli``.

Measuring rules (``minillm.timing``): a warm-up run, device synchronization, several repeats, the
median, and every number printed with the machine, dtype, batch size, prompt and output length.
Speed is reported here, never asserted in tests.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..data import BENCH_PROMPT
from ..generation import generate, generate_cached, generate_dynamic, generate_naive
from ..kv_cache import make_cache
from ..fast.threads import torch_default_threads
from ..paged import generate_paged
from ..quant.qlinear import QuantLinear
from ..sampling_params import SamplingParams
from ..timing import dtype_name, instruction_set, machine, synchronize, time_median
from .background import busy_note
from .peers import load_transformers_peer


def decode_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads, quantized layers included: every float parameter as
    ``weight_bytes_per_token`` counts it, plus what each quantized layer's forward reads (its kernel's
    codes, scales and zeros: ``QuantLinear.kernel_nbytes``). A tied embedding is counted once, as the
    output layer."""
    quant = sum(m.kernel_nbytes() for m in model.modules() if isinstance(m, QuantLinear))
    return weight_bytes_per_token(model) + quant


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every Linear weight (the tied embedding once, as the
    output projection) plus norms; the embedding lookup of one row is negligible."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if n != "tok_embeddings" and n != "pos_embeddings")


def _median_run(fn, repeats: int, warmup: int = 1):
    for _ in range(warmup):
        fn()
    runs = [fn() for _ in range(repeats)]
    return runs, statistics.median(r["decode_tokens_per_s"] for r in runs)


def run_ours(gen, model, prompt_tokens, params):
    def run():
        r = gen(model, prompt_tokens, params)
        return {"decode_tokens_per_s": r.decode_tokens_per_s, "prefill_s": r.prefill_s, "tokens": r.tokens,
                "step_s": r.step_s}
    return run


def _transformers(hf, prompt_tokens, params):
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            synchronize(device)
            self.times.append(time.perf_counter())

        def end(self):
            pass

    n = params.max_new_tokens
    device = next(hf.parameters()).device

    def run():
        clock = Clock()
        t0 = time.perf_counter()
        with torch.inference_mode(), torch_default_threads():  # as it runs without minillm choosing
            out = hf.generate(torch.tensor([prompt_tokens], device=device), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, streamer=clock, pad_token_id=0)
        new = clock.times[1:]  # the first put() is the prompt
        return {"decode_tokens_per_s": (len(new) - 1) / (new[-1] - new[0]), "prefill_s": new[0] - t0,
                "tokens": out[0, len(prompt_tokens):].tolist()}
    return run


def bench_decode(model, tokenizer, *, prompt: str = BENCH_PROMPT, new_tokens: int = 64, repeats: int = 3,
                 peer: bool = True, model_path=None, progress: bool = True) -> dict:
    """Batch-1 greedy decode tokens/s: naive (no cache), dynamic KV cache, contiguous KV cache in the
    model's dtype and in int8, the paged KV cache (blocks of 16, ``minillm.paged``), and, with ``peer``,
    transformers on the same GGUF weights.

    Returns:
        dict with machine, dtype, batch_size, prompt_tokens, new_tokens, repeats, weight_bytes and
        per path: decode_tokens_per_s (median), prefill_s (median), achieved_GB_per_s (weight bytes
        read per token (``decode_bytes_per_token``) x tokens/s / 1e9), and whether its tokens equal the cached path's.
    """
    prompt_tokens = tokenizer.encode(prompt)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    wbytes = decode_bytes_per_token(model)  # quantized layers counted by what their kernels read
    paths = {"ours naive (no cache)": run_ours(generate_naive, model, prompt_tokens, params),
             "ours dynamic KV (concatenation)": run_ours(generate_dynamic, model, prompt_tokens, params),
             "ours cached (contiguous KV)": run_ours(generate_cached, model, prompt_tokens, params),
             # the speed layer's one-index_select read, as this row has measured it (the plain model: its own)
             "ours paged KV (block_size 16)": run_ours(partial(generate_paged, attention="indexed" if model.accelerated
                                                               else None), model, prompt_tokens, params),
             "ours cached, int8 KV": run_ours(lambda *a: generate(*a, kv_dtype="int8"), model, prompt_tokens, params)}
    if peer:
        hf = load_transformers_peer(model_path, model.dtype, model.device)
        paths["transformers (same GGUF)"] = _transformers(hf, prompt_tokens, params)
    results = {}
    for name, fn in tqdm(paths.items(), desc="bench decode", disable=not progress, leave=False):
        runs, tps = _median_run(fn, repeats)
        results[name] = {"decode_tokens_per_s": tps, "prefill_s": statistics.median(r["prefill_s"] for r in runs),
                         "achieved_GB_per_s": wbytes * tps / 1e9, "tokens": runs[-1]["tokens"],
                         "step_s": runs[-1].get("step_s")}
    ref = results["ours cached (contiguous KV)"]["tokens"]
    for r in results.values():
        r["same_tokens_as_cached"] = r.pop("tokens") == ref
    base = results["ours cached (contiguous KV)"]["decode_tokens_per_s"]
    if peer:
        results["cached_over_transformers"] = base / results["transformers (same GGUF)"]["decode_tokens_per_s"]
    return {"machine": machine(), "instruction_set": instruction_set(), "device": str(model.device),
            "dtype": dtype_name(model.dtype),
            "batch_size": 1, "prompt": prompt, "prompt_tokens": len(prompt_tokens), "new_tokens": new_tokens,
            "repeats": repeats, "weight_bytes": wbytes, "results": results}


def format_bench(report: dict) -> str:
    lines = [f"machine: {report['machine']}" + busy_note(report.get("background_load", 0)),
             f"device {report['device']}, dtype {report['dtype']}, batch {report['batch_size']}, "
             f"prompt {report['prompt_tokens']} tokens, {report['new_tokens']} new tokens, greedy, "
             f"median of {report['repeats']} runs after a warm-up; weights read per token "
             f"{report['weight_bytes'] / 1e6:.1f} MB",
             f"{'path':32s} {'decode tok/s':>12s} {'prefill s':>10s} {'GB/s':>7s}  same tokens"]
    for name, r in report["results"].items():
        if not isinstance(r, dict):
            continue
        lines.append(f"{name:32s} {r['decode_tokens_per_s']:12.1f} {r['prefill_s']:10.3f} "
                     f"{r['achieved_GB_per_s']:7.1f}  {r['same_tokens_as_cached']}")
    if "cached_over_transformers" in report["results"]:
        lines.append(f"cached / transformers: {report['results']['cached_over_transformers']:.2f}x")
    return "\n".join(lines)


def plot_step_times(naive_s: list[float], cached_s: list[float], prompt_len: int, path: Path) -> Path:
    """Seconds per generated token against its position, naive vs cached; saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, s in (("naive (recompute all)", naive_s), ("cached (contiguous KV)", cached_s)):
        ax.plot(range(prompt_len + 1, prompt_len + len(s)), [t * 1e3 for t in s[1:]], label=label)
    ax.set_xlabel("position of the generated token")
    ax.set_ylabel("ms per token")
    ax.set_title("Decode step time, SmolLM2-135M, batch 1")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


@torch.inference_mode()
def step_time_at_positions(model, positions=(32, 128, 256, 512), repeats: int = 5) -> dict[str, dict[int, float]]:
    """Seconds to produce one token at each position, for each decode path (batch 1):

    * "none": a forward over all ``p`` tokens (what the naive path does at position p);
    * "dynamic": one decode step after ``p`` positions in a ``DynamicKVCache`` (copies them);
    * "contiguous": one decode step after ``p`` positions in the contiguous ``KVCache``.

    Returns {path: {position: median seconds}}.
    """
    device = model.device
    top = max(positions)
    tokens = torch.randint(100, 1000, (1, top + 1), generator=torch.Generator().manual_seed(0)).to(device)
    out = {"none": {}, "dynamic": {}, "contiguous": {}}
    for p in positions:
        out["none"][p] = time_median(lambda: model(tokens[:, :p + 1], torch.arange(p + 1, device=device)), device,
                                     repeats, warmup=1)
        for kind in ("dynamic", "contiguous"):
            cache = make_cache(kind, model.config, 1, top + 1, model.dtype, device)
            model(tokens[:, :p], torch.arange(p, device=device), cache)
            pos = torch.tensor([p], device=device)

            def step():
                cache.truncate(p)
                model(tokens[:, p:p + 1], pos, cache)

            out[kind][p] = time_median(step, device, repeats, warmup=1)
    return out


def fit_step_time(positions, seconds, degree: int = 1) -> list[float]:
    """Least-squares polynomial (highest power first) of step time against position. Summing a
    linear step time over N steps gives the naive path's quadratic total; a flat one, linear."""
    return np.polyfit(np.asarray(positions, float), np.asarray(seconds, float), degree).tolist()


def total_time(coeffs: list[float], prompt_tokens: int, new_tokens: int) -> float:
    """Seconds for ``new_tokens`` tokens after a ``prompt_tokens`` prompt under a fitted step-time model."""
    return float(np.polyval(coeffs, np.arange(prompt_tokens, prompt_tokens + new_tokens, dtype=float)).sum())



def plot_step_time_vs_position(steps: dict[str, dict[int, float]], fits: dict[str, list[float]], path) -> Path:
    """Step time against position (``step_time_at_positions``' output, points) and each path's fit (lines),
    on linear axes: all paths on the left, the two caches alone on the right with their own scale, so
    that a cache's small slope is visible beside recomputation's large one. Writes a PNG; returns its path."""
    import matplotlib.pyplot as plt

    from ..files import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    grid = np.linspace(min(min(t) for t in steps.values()), max(max(t) for t in steps.values()), 100)
    for ax, paths, title in ((axes[0], list(steps), "every path"),
                             (axes[1], [p for p in steps if p != "none"], "the caches alone (zoomed)")):
        for path_name in paths:
            color = f"C{list(steps).index(path_name)}"
            times = steps[path_name]
            ax.plot(list(times), [1e3 * s for s in times.values()], "o", color=color, label=f"{path_name} (measured)")
            ax.plot(grid, 1e3 * np.polyval(fits[path_name], grid), "-", color=color, alpha=0.6)
        ax.set_xlabel("position of the generated token")
        ax.set_ylabel("ms per token")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle("Decode step time vs position (lines: the fits)", fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path)
