"""``python -m minillm bench decode --peer llamacpp``: minillm's float32 and 4-bit decode paths beside
llama.cpp on the same GGUF, interleaved in one process, with the bytes each reads per token and the share
of the memory bandwidth (measured in the same run) it reaches; and the figure (notebook 05).

Measuring rules as ``minillm.lab.decode``: warm-ups, several repeats, the median, the machine named.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..fast.compiled import compile_decode
from ..data import BENCH_PROMPT
from ..formats.gguf import read_gguf
from ..generation import generate_cached
from ..loading import default_model_path
from ..quant import QuantLinear, Recipe, quantize_model
from ..quant.activations import quantize_activations
from ..quant.head import quantize_output
from ..roofline.ceilings import measure
from ..sampling_params import SamplingParams
from ..timing import instruction_set, machine
from .background import busy_note
from .decode import decode_bytes_per_token, run_ours
from .peers import llamacpp_build, load_llamacpp_peer


def gguf_bytes_per_token(model_path=None) -> int:
    """Bytes of weights a llama.cpp decode step reads from a GGUF: every tensor as stored (its block
    format's bytes), the token embedding only when it is also the output layer (tied)."""
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


def four_bit_paths(model, quant_head: str = "int8", compile: bool = True, progress: bool = True,
                   int8_activations: bool = False) -> dict:
    """minillm's 4-bit decode paths built from a float ``model`` (left as it is): the blocks' linear layers
    in 4 bits (RTN group 64: no calibration, and calibration changes accuracy, not speed) with the float
    output layer, then with the output layer quantized (``quant_head``), then (``int8_activations``) with the
    blocks' inputs rounded to int8 as llama.cpp does (``quant.activations``); the last one or two also compiled.

    Returns {name: model}."""
    body = copy.deepcopy(model)
    quantize_model(body, Recipe.of("rtn", bits=4, group_size=64), progress=False)
    paths = {"ours int4 (RTN g64), float head": body}
    if quant_head != "none":
        head = copy.deepcopy(body)
        quantize_output(head, quant_head)
        paths[f"ours int4 (RTN g64), {quant_head} head"] = head
    last = [list(paths)[-1]]
    if int8_activations:
        a8 = copy.deepcopy(paths[last[0]])
        quantize_activations(a8)
        last.append(last[0] + ", int8 activations")
        paths[last[1]] = a8
    if compile:
        for name in last:
            paths[name + ", compiled"] = compile_decode(copy.deepcopy(paths[name]))
    return paths


def bench_decode_llamacpp(model, tokenizer, *, prompt: str = BENCH_PROMPT, new_tokens: int = 128, repeats: int = 3,
                          model_path=None, quant_head: str = "int8", compile: bool = True, llamacpp: bool = True,
                          int8_activations: bool = True, progress: bool = True) -> dict:
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
    n_threads = torch.get_num_threads()
    prompt_tokens = tokenizer.encode(prompt)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ours = {"ours float32 (cached, eager)": model, **four_bit_paths(model, quant_head, compile, progress, int8_activations)}
    paths = {name: run_ours(generate_cached, m, prompt_tokens, params) for name, m in ours.items()}
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
                         "tokens_equal_to_float": same,
                         "kernels": sorted({m.compiled_kernel if name.endswith(", compiled") else m.kernel
                                            for m in ours[name].modules() if isinstance(m, QuantLinear)})
                         if name in ours else None}
        eager = name.removesuffix(", compiled")
        if eager != name:  # the compiled path beside its eager baseline: greedy tokens in common
            ref = runs[eager][-1]["tokens"]
            results[name]["tokens_equal_to_eager"] = next(
                (i for i, (a, b) in enumerate(zip(rs[-1]["tokens"], ref)) if a != b), len(ref))
    best = max((n for n in results if n != peer and "int4" in n), key=lambda n: results[n]["decode_tokens_per_s"])
    per_repeat = [a / b for a, b in zip(results[best]["runs"], results[peer]["runs"])] if llamacpp else None
    return {"machine": machine(), "instruction_set": instruction_set(), "device": str(model.device),
            "threads": n_threads, "batch_size": 1,
            "prompt": prompt, "prompt_tokens": len(prompt_tokens), "new_tokens": new_tokens, "repeats": repeats,
            "bandwidth": {"before": before, "after": after, "ceiling": ceiling}, "results": results,
            "llamacpp_build": llamacpp_build() if llamacpp else None,
            "best_ours": best, "best_over_llamacpp": statistics.median(per_repeat) if llamacpp else None,
            "best_over_llamacpp_per_repeat": per_repeat}


def format_bench_llamacpp(report: dict) -> str:
    bw = report["bandwidth"]
    lines = [f"machine: {report['machine']}" + (f"; llama.cpp built for {report['llamacpp_build']}"
                                                 if report.get("llamacpp_build") else "")
             + busy_note(report.get("background_load", 0)),
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
