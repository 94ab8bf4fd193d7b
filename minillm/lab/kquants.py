"""Our Q4_K_M file beside llama.cpp's and the shipped Q4_1: block bytes, size and perplexity.

``python -m minillm.lab.kquants --out figures/05_kquants.json`` writes minillm's Q4_K_M of the
embedded model (``formats.gguf_quant.write_gguf``), has llama.cpp quantize the same file to Q4_K_M (through
llama-cpp-python's ``llama_model_quantize``, an optional extra: without it the llama.cpp rows are left
out), compares the two tensor by tensor (type and bytes), and scores all the files with minillm in one
run: perplexity on the held-out play, KL from the shipped model, size and bits per weight.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
from collections import Counter
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..data import HELD_OUT_PLAY, play_text
from ..evaluation import perplexity, reference_logprobs, windows
from ..files import atomic_write, dumps_strict, runs_folder
from ..formats.gguf import read_gguf
from ..formats.gguf_quant import write_gguf
from ..loading import default_model_path, load_model


def llamacpp_quantize(src: str | Path, dst: str | Path, ftype: str = "Q4_K_M", nthread: int = 1) -> Path:
    """Quantize a GGUF file with llama.cpp itself (``llama-quantize --allow-requantize``, no imatrix).

    Raises:
        ImportError: llama-cpp-python is not installed (``pip install llama-cpp-python``).
        RuntimeError: llama.cpp reports a failure.
    """
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.allow_requantize = True
    params.nthread = nthread
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype} (return code {rc})")
    return Path(dst)


def compare_blocks(ours: str | Path, theirs: str | Path) -> dict:
    """Tensor by tensor: same names and shapes, the type each file chose, and the bytes that differ.

    Returns {"tensors", "same_names", "same_shapes", "type_mismatches": [names], "bytes": {type: n},
    "bytes_differing": {type: n}, "tensors_differing": [names]} (bytes compared where the types agree).
    """
    a = {t.name: t for t in read_gguf(ours).tensors}
    b = {t.name: t for t in read_gguf(theirs).tensors}
    shared = [n for n in a if n in b]
    out = {"tensors": len(a), "same_names": set(a) == set(b),
           "same_shapes": all(a[n].shape.tolist() == b[n].shape.tolist() for n in shared),
           "type_mismatches": [], "bytes": Counter(), "bytes_differing": Counter(), "tensors_differing": []}
    for n in shared:
        if a[n].tensor_type != b[n].tensor_type:
            out["type_mismatches"].append(n)
            continue
        x = np.asarray(a[n].data).view(np.uint8).reshape(-1)
        y = np.asarray(b[n].data).view(np.uint8).reshape(-1)
        kind = a[n].tensor_type.name
        out["bytes"][kind] += x.size
        differ = int((x != y).sum()) if x.size == y.size else x.size
        out["bytes_differing"][kind] += differ
        if differ:
            out["tensors_differing"].append(n)
    out["bytes"], out["bytes_differing"] = dict(out["bytes"]), dict(out["bytes_differing"])
    return out


def type_counts(path: str | Path) -> dict[str, int]:
    """{type name: number of tensors} of a GGUF file."""
    return dict(Counter(t.tensor_type.name for t in read_gguf(path).tensors))


def bits_per_weight(path: str | Path) -> float:
    """Bits of tensor data per parameter of a GGUF file (norms included, metadata not)."""
    tensors = read_gguf(path).tensors
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def score_files(files: dict[str, str | Path], max_tokens: int = 4096, seqlen: int = 512,
                progress: bool = False) -> list[dict]:
    """Perplexity of each file's model on the held-out play, and KL from the first file's model.

    All files are scored with minillm's forward (float32, dequantized weights) on the same tokens
    (the first file's tokenizer) and windows, exactly as ``evaluation.perplexity`` scores them; the
    reference log-probabilities are made one window at a time, so that at most two models and one
    window's reference are in memory (the full reference of 8 windows alone is 0.8 GB). Returns one
    row per file: label, file (its name), bytes, bits_per_weight, types, and
    ``evaluation.perplexity``'s keys.
    """
    labels = list(files)
    reference, tokenizer = load_model(files[labels[0]], n_shards=1)
    tokens = tokenizer.encode(play_text(HELD_OUT_PLAY))
    ws = [w.tolist() for w in windows(tokens, seqlen, max_tokens, reference.config.max_seq_len)]
    rows = []
    for label in labels:
        model = reference if label == labels[0] else load_model(files[label], n_shards=1)[0]
        sums = {"nll": 0.0, "kl": 0.0, "top1_agreement": 0.0}
        for w in tqdm(ws, desc=f"perplexity, {label}", disable=not progress, leave=False):
            score = perplexity(model, w, seqlen, reference=reference_logprobs(reference, w, seqlen))
            for k in sums:  # every window scores seqlen - 1 tokens: the means over windows are the means
                sums[k] += score[k] / len(ws)
        rows.append({"label": label, "file": Path(files[label]).name, "bytes": os.path.getsize(files[label]),
                     "bits_per_weight": bits_per_weight(files[label]), "types": type_counts(files[label]),
                     "perplexity": math.exp(sums["nll"]), **sums, "tokens": len(ws) * (seqlen - 1),
                     "windows": len(ws), "seqlen": seqlen, "text_tokens": len(tokens)})
        del model
    return rows


def run(out: str | Path, work: str | Path | None = None, max_tokens: int = 4096, progress: bool = True) -> dict:
    """Write both Q4_K_M files into ``work``, compare them, score all three; the report goes to ``out`` (JSON)."""
    src = default_model_path()
    work = Path(work or runs_folder())
    work.mkdir(parents=True, exist_ok=True)
    ours = write_gguf(src, work / "smollm2-q4_k_m.minillm.gguf", "q4_k_m", progress=progress)
    files = {"shipped Q4_1": src, "minillm Q4_K_M": ours}
    report = {"date": datetime.date.today().isoformat(), "command": "python -m minillm.lab.kquants",
              "load": os.getloadavg()[0], "text": HELD_OUT_PLAY, "max_tokens": max_tokens, "seqlen": 512}
    try:
        import llama_cpp

        theirs = llamacpp_quantize(src, work / "smollm2-q4_k_m.llamacpp.gguf")
        files["llama.cpp Q4_K_M"] = theirs
        report["llama_cpp_version"] = llama_cpp.__version__
        report["blocks"] = compare_blocks(ours, theirs)
    except ImportError:
        report["llama_cpp_version"] = None  # the optional peer is not installed: its rows are left out
    report["rows"] = score_files(files, max_tokens, progress=progress)
    report["load_after"] = os.getloadavg()[0]
    with atomic_write(out) as tmp:
        Path(tmp).write_text(dumps_strict(report, indent=1))
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.lab.kquants", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(runs_folder() / "05_kquants.json"), help="the report (JSON)")
    p.add_argument("--work", default=None, help="folder for the two Q4_K_M files (default: figures/runs)")
    p.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens taken (whole windows of 512)")
    args = p.parse_args(argv)
    report = run(args.out, args.work, args.max_tokens)
    for r in report["rows"]:
        print(f"{r['label']:18s} {r['bytes'] / 1e6:7.1f} MB  {r['bits_per_weight']:.2f} bpw  "
              f"perplexity {r['perplexity']:.3f}  KL {r['kl']:.4f}  top-1 {r['top1_agreement']:.3f}")
    if "blocks" in report:
        b = report["blocks"]
        print(f"our blocks vs llama.cpp's: {len(b['type_mismatches'])} type mismatches, "
              f"{sum(b['bytes_differing'].values())} of {sum(b['bytes'].values())} bytes differ")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def plot_q4_k_layout():
    """The Q4_K super-block drawn byte by byte (llama.cpp's ``block_q4_K``): the float16 ``d`` and
    ``dmin``, the 12 bytes of packed 6-bit scales and mins, the 128 bytes of 4-bit codes and which
    sub-block of 32 weights each nibble group holds. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(12, 4.2))

    def box(x, y, w, h, label, color="white", fontsize=8):
        ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=0.8))
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize)

    # row 1: the 16 header bytes, one unit per byte, coloured by the sub-block they scale
    box(0, 3, 2, 1, "d\n(f16)", "#dddddd")
    box(2, 3, 2, 1, "dmin\n(f16)", "#dddddd")
    for k in range(12):
        label = [f"sc{k}\n+hi sc{k + 4}", f"m{k - 4}\n+hi m{k}", f"lo sc{k - 4}\nlo m{k - 4}"][k // 4]
        box(4 + k, 3, 1, 1, label, colors[k % 4] if k < 8 else colors[k - 4], fontsize=6)
    ax.text(10, 4.25, "scales[12]: eight 6-bit sc[j] and eight 6-bit m[j]", ha="center", fontsize=9)
    ax.text(2, 4.25, "super-block scales", ha="center", fontsize=9)
    # row 2: the 128 code bytes in 4 groups of 32, each byte = low nibble | high nibble
    for g in range(4):
        x = 0.5 + 7 * g
        box(x, 1.6, 6, 0.45, f"low nibbles of qs[{32 * g}..{32 * g + 31}]", colors[2 * g], fontsize=7)
        box(x, 1.15, 6, 0.45, "high nibbles", colors[2 * g + 1], fontsize=7)
    ax.text(14, 2.25, "qs[128]: 4-bit codes q, two per byte", ha="center", fontsize=9)
    # row 3: the 256 weights as 8 sub-blocks of 32
    for j in range(8):
        box(3.5 * j, 0, 3.5, 0.6, f"sub-block {j}\nw{32 * j}..w{32 * j + 31}", colors[j], fontsize=7)
        g, high = divmod(j, 2)
        ax.annotate("", xy=(3.5 * j + 1.75, 0.6), xytext=(0.5 + 7 * g + (4.5 if high else 1.5), 1.15),
                    arrowprops=dict(arrowstyle="->", linewidth=0.6, color="gray"))
    ax.text(14, -0.45, "w = d * sc[j] * q - dmin * m[j]   (j = sub-block, q = 0..15)", ha="center", fontsize=10)
    ax.set_xlim(-0.5, 28.5)
    ax.set_ylim(-0.8, 4.6)
    ax.axis("off")
    ax.set_title("Q4_K: 256 weights in 144 bytes (4.5 bits per weight)")
    fig.tight_layout()
    return fig
