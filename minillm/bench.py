"""``bench decode``: batch-1 decode tokens/s of the naive path, the KV caches and transformers on the
same weights; and the KV cache's step time against position (notebook 02). ``bench decode --peer
llamacpp``: minillm's 4-bit paths beside llama.cpp on the same GGUF, interleaved in one process, with the
bytes each reads per token and the share of the memory bandwidth (measured in the same run) it reaches.

Measuring rules (``minillm.timing``): a warm-up run, device synchronization, several repeats, the
median, and every number printed with the machine, dtype, batch size, prompt and output length.
Speed is reported here, never asserted in tests.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch

from .compiled import compile_decode
from .data import BENCH_PROMPT
from .generation import generate, generate_cached, generate_dynamic, generate_naive
from .kv_cache import make_cache
from .loading import default_model_path
from .paged import generate_paged
from .quant import QuantConfig, quantize_model
from .quant.head import quantize_output
from .quant.qlinear import QuantLinear
from .roofline.ceilings import measure
from .sampling import SamplingParams
from .timing import dtype_name, machine, synchronize, time_median



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


def _ours(gen, model, prompt_tokens, params):
    def run():
        r = gen(model, prompt_tokens, params)
        return {"decode_tokens_per_s": r.decode_tokens_per_s, "prefill_s": r.prefill_s, "tokens": r.tokens,
                "step_s": r.step_s}
    return run


def load_transformers_peer(model_path=None, dtype=torch.float32, device="cpu"):
    """transformers' LlamaForCausalLM on the same GGUF (the oracle and the speed peer).

    transformers dequantizes the GGUF itself (through the gguf package), so both run the same
    float weights.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = Path(model_path) if model_path else default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return hf.to(device).eval()


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
        with torch.inference_mode():
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
    from tqdm.auto import tqdm

    prompt_tokens = tokenizer.encode(prompt)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    wbytes = decode_bytes_per_token(model)  # quantized layers counted by what their kernels read
    paths = {"ours naive (no cache)": _ours(generate_naive, model, prompt_tokens, params),
             "ours dynamic KV (concatenation)": _ours(generate_dynamic, model, prompt_tokens, params),
             "ours cached (contiguous KV)": _ours(generate_cached, model, prompt_tokens, params),
             "ours paged KV (block_size 16)": _ours(generate_paged, model, prompt_tokens, params),
             "ours cached, int8 KV": _ours(lambda *a: generate(*a, kv_dtype="int8"), model, prompt_tokens, params)}
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
    return {"machine": machine(), "device": str(model.device), "dtype": dtype_name(model.dtype),
            "batch_size": 1, "prompt": prompt, "prompt_tokens": len(prompt_tokens), "new_tokens": new_tokens,
            "repeats": repeats, "weight_bytes": wbytes, "results": results}


def format_bench(report: dict) -> str:
    lines = [f"machine: {report['machine']}",
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
    import numpy as np

    return np.polyfit(np.asarray(positions, float), np.asarray(seconds, float), degree).tolist()


def total_time(coeffs: list[float], prompt_tokens: int, new_tokens: int) -> float:
    """Seconds for ``new_tokens`` tokens after a ``prompt_tokens`` prompt under a fitted step-time model."""
    import numpy as np

    return float(np.polyval(coeffs, np.arange(prompt_tokens, prompt_tokens + new_tokens, dtype=float)).sum())


# ---- bench decode --peer llamacpp: minillm's 4-bit paths beside llama.cpp on the same GGUF -----------

LLAMACPP_INSTALL = "pip install llama-cpp-python==0.3.36 (it compiles llama.cpp from source: several minutes)"


def llamacpp_available() -> bool:
    """Whether the optional peer ``llama_cpp`` (llama-cpp-python) imports."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def load_llamacpp_peer(model_path, n_threads: int, n_ctx: int):
    """llama.cpp (through llama-cpp-python) on a GGUF file, CPU only, ``n_threads`` for decode and prefill.

    Raises:
        ValueError: ``llama_cpp`` is not installed (the message says how to install it).
    """
    try:
        import llama_cpp
    except ImportError:
        raise ValueError(f"peer: llamacpp needs the optional package llama-cpp-python; {LLAMACPP_INSTALL}") from None
    path = Path(model_path) if model_path else default_model_path()
    return llama_cpp.Llama(model_path=str(path), n_threads=n_threads, n_threads_batch=n_threads, n_ctx=n_ctx,
                           n_gpu_layers=0, verbose=False)


def gguf_bytes_per_token(model_path=None) -> int:
    """Bytes of weights a llama.cpp decode step reads from a GGUF: every tensor as stored (its block
    format's bytes), the token embedding only when it is also the output layer (tied)."""
    from .formats.gguf import read_gguf

    reader = read_gguf(Path(model_path) if model_path else default_model_path())
    names = {t.name for t in reader.tensors}
    return sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight" or "output.weight" not in names)


def _llamacpp(llm, prompt_tokens, params):
    n = params.max_new_tokens

    def run():
        llm.reset()  # no prefix reuse: every run prefills the prompt, as ours do
        times, tokens = [], []
        t0 = time.perf_counter()
        for token in llm.generate(prompt_tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            times.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == n:
                break
        return {"decode_tokens_per_s": (len(times) - 1) / (times[-1] - times[0]), "prefill_s": times[0] - t0,
                "tokens": tokens}
    return run


def four_bit_paths(model, quant_head: str = "int8", compile: bool = True, progress: bool = True) -> dict:
    """minillm's 4-bit decode paths built from a float ``model`` (left as it is): the blocks' linear layers
    in 4 bits (RTN group 64: no calibration, and calibration changes accuracy, not speed) with the float
    output layer, then with the output layer quantized (``quant_head``), eager and compiled.

    Returns {name: model}."""
    body = copy.deepcopy(model)
    quantize_model(body, "rtn", QuantConfig(4, 64), progress=False)
    paths = {"ours int4 (RTN g64), float head": body}
    if quant_head != "none":
        head = copy.deepcopy(body)
        quantize_output(head, quant_head)
        paths[f"ours int4 (RTN g64), {quant_head} head"] = head
    if compile:
        best = copy.deepcopy(list(paths.values())[-1])
        name = list(paths)[-1] + ", compiled"
        paths[name] = compile_decode(best)
    return paths


def bench_decode_llamacpp(model, tokenizer, *, prompt: str = BENCH_PROMPT, new_tokens: int = 128, repeats: int = 3,
                          model_path=None, quant_head: str = "int8", compile: bool = True, llamacpp: bool = True,
                          progress: bool = True) -> dict:
    """Batch-1 greedy decode tokens/s of minillm's float and 4-bit paths (``four_bit_paths``) and of llama.cpp
    on the same GGUF file, same prompt tokens, same thread count (``torch.get_num_threads()``), in this
    process, interleaved: each repeat runs every path once in turn, after one warm-up run each (which also
    compiles the compiled path). The memory bandwidth is measured in the same run (``roofline``'s streaming
    copy and read of 512 MB, before and after the decode runs).

    Returns:
        dict with machine, threads, prompt_tokens, new_tokens, repeats, bandwidth (bytes/s: "before",
        "after", "ceiling" = their max), and per path: decode_tokens_per_s (median), runs (each repeat's
        tokens/s), prefill_s, bytes_per_token (weights read per decode step), achieved_GB_per_s, share_of_bound
        (achieved / ceiling), tokens_equal_to_float (greedy tokens in common with minillm float32's, from
        the first), and for the compiled path tokens_equal_to_eager (the same against its eager twin);
        ratios: best minillm 4-bit path over llama.cpp, as the median of the per-repeat ratios and each
        repeat's ratio. With ``llamacpp=False`` only minillm's paths run (where the optional peer is not
        installed: notebook 05 in CI) and the ratios are None.

    Raises:
        ValueError: llama_cpp is not installed (and ``llamacpp`` is True).
    """
    from tqdm.auto import tqdm

    n_threads = torch.get_num_threads()
    prompt_tokens = tokenizer.encode(prompt)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ours = {"ours float32 (cached, eager)": model, **four_bit_paths(model, quant_head, compile, progress)}
    paths = {name: _ours(generate_cached, m, prompt_tokens, params) for name, m in ours.items()}
    nbytes = {name: decode_bytes_per_token(m) for name, m in ours.items()}
    peer = "llama.cpp (same GGUF)"
    if llamacpp:
        llm = load_llamacpp_peer(model_path, n_threads, n_ctx=len(prompt_tokens) + new_tokens + 8)
        paths[peer] = _llamacpp(llm, prompt_tokens, params)
        nbytes[peer] = gguf_bytes_per_token(model_path)
    before = measure(str(model.device), dtypes=()).bandwidth
    for fn in tqdm(paths.values(), desc="warm-up", disable=not progress, leave=False):
        fn()
    runs = {name: [] for name in paths}
    for _ in tqdm(range(repeats), desc="bench decode --peer llamacpp", disable=not progress, leave=False):
        for name, fn in paths.items():
            runs[name].append(fn())
    after = measure(str(model.device), dtypes=()).bandwidth
    ceiling = max(before, after)
    float_tokens = runs["ours float32 (cached, eager)"][-1]["tokens"]
    results = {}
    for name, rs in runs.items():
        tps = statistics.median(r["decode_tokens_per_s"] for r in rs)
        same = next((i for i, (a, b) in enumerate(zip(rs[-1]["tokens"], float_tokens)) if a != b), len(float_tokens))
        results[name] = {"decode_tokens_per_s": tps, "runs": [r["decode_tokens_per_s"] for r in rs],
                         "prefill_s": statistics.median(r["prefill_s"] for r in rs), "bytes_per_token": nbytes[name],
                         "achieved_GB_per_s": nbytes[name] * tps / 1e9, "share_of_bound": nbytes[name] * tps / ceiling,
                         "tokens_equal_to_float": same}
        eager = name.removesuffix(", compiled")
        if eager != name:  # the compiled path beside its eager baseline: greedy tokens in common
            ref = runs[eager][-1]["tokens"]
            results[name]["tokens_equal_to_eager"] = next(
                (i for i, (a, b) in enumerate(zip(rs[-1]["tokens"], ref)) if a != b), len(ref))
    best = max((n for n in results if n != peer and "int4" in n), key=lambda n: results[n]["decode_tokens_per_s"])
    per_repeat = [a / b for a, b in zip(results[best]["runs"], results[peer]["runs"])] if llamacpp else None
    return {"machine": machine(), "device": str(model.device), "threads": n_threads, "batch_size": 1,
            "prompt": prompt, "prompt_tokens": len(prompt_tokens), "new_tokens": new_tokens, "repeats": repeats,
            "bandwidth": {"before": before, "after": after, "ceiling": ceiling}, "results": results,
            "best_ours": best, "best_over_llamacpp": statistics.median(per_repeat) if llamacpp else None,
            "best_over_llamacpp_per_repeat": per_repeat}


def format_bench_llamacpp(report: dict) -> str:
    bw = report["bandwidth"]
    lines = [f"machine: {report['machine']}",
             f"{report['threads']} threads, batch 1, prompt {report['prompt_tokens']} tokens, "
             f"{report['new_tokens']} new "
             f"tokens, greedy; median of {report['repeats']} interleaved runs after a warm-up each; bandwidth bound "
             f"{bw['ceiling'] / 1e9:.1f} GB/s (streaming 512 MB: {bw['before'] / 1e9:.1f} before, "
             f"{bw['after'] / 1e9:.1f} after)",
             f"{'path':48s} {'tok/s':>7s} {'MB/token':>9s} {'GB/s':>6s} {'of bound':>8s}  tokens = float's"]
    for name, r in report["results"].items():
        lines.append(f"{name:48s} {r['decode_tokens_per_s']:7.1f} {r['bytes_per_token'] / 1e6:9.1f} "
                     f"{r['achieved_GB_per_s']:6.1f} {r['share_of_bound']:8.0%}  first {r['tokens_equal_to_float']}"
                     + (f" (= its eager twin's: first {r['tokens_equal_to_eager']})"
                        if "tokens_equal_to_eager" in r else ""))
    if report["best_over_llamacpp"] is not None:
        per = ", ".join(f"{x:.2f}" for x in report["best_over_llamacpp_per_repeat"])
        lines.append(f"{report['best_ours']} / llama.cpp: {report['best_over_llamacpp']:.2f}x (per repeat: {per})")
    return "\n".join(lines)


def plot_bench_llamacpp(report: dict):
    """A ``bench_decode_llamacpp`` report as a figure: each path's decode tokens/s (bars) beside the
    tokens/s its bytes per token allow at the run's bandwidth ceiling (the bound, a tick), labelled with
    its megabytes per token and the share of the bound it reaches. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    names = list(report["results"])
    res = [report["results"][n] for n in names]
    ceiling = report["bandwidth"]["ceiling"]
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(names) + 1.4))
    y = range(len(names))
    ax.barh(y, [r["decode_tokens_per_s"] for r in res], color=["C1" if n.startswith("llama") else "C0" for n in names])
    bounds = [ceiling / r["bytes_per_token"] for r in res]
    ax.plot(bounds, list(y), linestyle="none", marker="|", markersize=22, markeredgewidth=2, color="k")
    right = max(bounds + [r["decode_tokens_per_s"] for r in res]) * 1.04
    for i, r in enumerate(res):  # one aligned column of labels, clear of the bars and the bounds
        ax.text(right, i, f"{r['decode_tokens_per_s']:.1f} tok/s, {r['bytes_per_token'] / 1e6:.0f} MB/token, "
                f"{r['share_of_bound']:.0%} of bound", va="center", fontsize=8)
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, right * 1.75)
    ax.set_xlabel(f"decode tokens/s, batch 1, {report['threads']} threads (bars)\n"
                  f"ticks: the bound = ceiling {ceiling / 1e9:.1f} GB/s / bytes per token")
    ax.set_title("4-bit decode: bytes read per token and tokens/s")
    fig.tight_layout()
    return fig
