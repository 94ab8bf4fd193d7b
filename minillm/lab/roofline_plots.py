"""The roofline's figures (notebook 01 and its appendix): the roofline with each forward placed on it,
measured over predicted time per forward, the linear layers' bandwidth per weight layout against the
read ceiling, and the compiled decode's waterfall from the bound down to eager.

Each function draws with matplotlib's object-oriented API (no pyplot state, so a notebook shows only
what it displays), saves the figure through ``minillm.files.save_figure`` and returns the path.
matplotlib is imported when a figure is drawn, so that importing the lab costs nothing for those who
only measure.
"""

from __future__ import annotations

import numpy as np

from ..files import save_figure
from ..roofline.ceilings import Ceilings


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.add_subplot()


def _label(r: dict) -> str:
    return f"B={r['batch_size']}" if r["kind"] == "decode" else f"T={r['tokens']}"


def plot_roofline(ceilings: Ceilings, rows: list[dict], path, dtype: str = "float32", title: str | None = None):
    """The classic log-log roofline (attainable FLOP/s vs arithmetic intensity in FLOP/byte) with the
    measured forwards of ``compare`` placed on it. Decode labels sit below their points and prefill labels
    above, so that neighbours of the two kinds (decode B=16 and prefill T=16 have nearly the same
    intensity) do not overlap."""
    bw, peak = ceilings.bandwidth, ceilings.matmul_flops[dtype]
    x = np.logspace(-1, 3.5, 200)
    fig, ax = _figure(7, 4.5)
    ax.loglog(x, np.minimum(peak, bw * x), "k-", lw=2,
              label=f"roofline: {bw / 1e9:.1f} GB/s, {peak / 1e9:.0f} GFLOP/s ({dtype})")
    ax.axvline(peak / bw, color="gray", ls=":", lw=1)
    ax.text(peak / bw, 0.03, f" ridge point {peak / bw:.1f} FLOP/B", transform=ax.get_xaxis_transform(), rotation=90,
            fontsize=8, color="gray", va="bottom", ha="right")
    for kind, marker, offset, va in (("decode", "o", (0, -13), "top"), ("prefill", "s", (0, 9), "bottom")):
        pts = [r for r in rows if r["kind"] == kind and r["dtype"] == dtype]
        if not pts:
            continue
        ax.loglog([r["intensity"] for r in pts], [r["achieved_flops"] for r in pts], marker, ls="",
                  label=f"{kind} (measured)")
        for r in pts:
            ax.annotate(_label(r), (r["intensity"], r["achieved_flops"]), xytext=offset, textcoords="offset points",
                        fontsize=7, ha="center", va=va)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attained FLOP/s")
    ax.set_title(title or "Roofline, SmolLM2-135M on this machine")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return save_figure(fig, path)


def plot_predicted_vs_measured(rows: list[dict], path, title: str | None = None):
    """Measured over predicted time for each row of ``compare``, with a line at 1 (the prediction met):
    a bar at 2 means the forward took twice the roofline's bound."""
    labels = [f"{r['kind']}\n{_label(r)}" + ("" if r["dtype"] == "float32" else f"\n{r['dtype']}") for r in rows]
    ratios = [r["measured_over_predicted"] for r in rows]
    colors = ["C0" if r["kind"] == "decode" else "C1" for r in rows]
    fig, ax = _figure(max(6, 0.75 * len(rows)), 4)
    bars = ax.bar(range(len(rows)), ratios, color=colors)
    ax.bar_label(bars, [f"{v:.2f}" for v in ratios], fontsize=7)
    ax.axhline(1, color="k", lw=1, label="1: the forward ran at its bound")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylim(0, max(ratios + [1]) * 1.25)
    ax.set_ylabel("measured / predicted time")
    ax.set_title(title or "How far each forward is from its roofline bound (1 = at the bound)")
    fig.tight_layout()
    return save_figure(fig, path)


def plot_linear_layouts(layouts: dict[int, dict[str, float]], weight_bytes: float, read_bandwidth: float, path,
                        title: str | None = None):
    """The bandwidth (GB/s) at which each weight layout streams one decode step's linear layers, per batch
    size, against the bandwidth ceiling measured beside it (``Ceilings.bandwidth``: the larger of a streaming
    copy and a streaming read). The x axis ends just past the longest bar or the ceiling; the legend sits
    below the axes.

    Args:
        layouts: {batch size: {layout: seconds}}, as ``measure_linear_layouts`` returns per batch size.
        weight_bytes: bytes of the linear weights read per step.
        read_bandwidth: the ceiling, bytes/s (``Ceilings.bandwidth``, whichever of copy and read was faster).
    """
    names = list(dict.fromkeys(n for per in layouts.values() for n in per))
    fig, ax = _figure(7.5, 0.45 * len(names) * len(layouts) + 2.2)
    height = 0.8 / len(layouts)
    y = np.arange(len(names))
    for i, (batch, per) in enumerate(layouts.items()):
        gbs = [weight_bytes / per[n] / 1e9 if n in per else 0 for n in names]
        bars = ax.barh(y + i * height, gbs, height, label=f"batch {batch}")
        ax.bar_label(bars, [f"{v:.1f}" for v in gbs], fontsize=7, padding=2)
    ax.axvline(read_bandwidth / 1e9, color="k", ls="--", lw=1, label=f"ceiling (larger of copy and read): {read_bandwidth / 1e9:.1f} GB/s")
    top = max(weight_bytes / s / 1e9 for per in layouts.values() for s in per.values())
    ax.set_xlim(0, 1.15 * max(top, read_bandwidth / 1e9))  # room for the bars' labels, no empty half
    ax.set_yticks(y + height * (len(layouts) - 1) / 2, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s of weights streamed by one decode step's linear layers")
    ax.set_title(title or "Same weights, same bytes: the kernel sets the bandwidth", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_decode_waterfall(steps: dict[str, float], path, title: str | None = None):
    """Batch-1 decode from the bound down: milliseconds per step for each stage (``{label: seconds}``, in
    the order given: e.g. the roofline bound, a plain read of the model's own weights, compiled, eager).
    Each stage's share of the bound's speed goes under its name, so the x axis ends just past the slowest
    stage."""
    labels, seconds = list(steps), list(steps.values())
    fig, ax = _figure(7, 0.55 * len(labels) + 1.6)
    bars = ax.barh(range(len(labels)), [1e3 * s for s in seconds], color=["k"] + [f"C{i}" for i in range(len(labels) - 1)])
    ax.bar_label(bars, [f"{1e3 * s:.1f} ms" for s in seconds], fontsize=8, padding=3)
    ax.set_yticks(range(len(labels)), [f"{name}\n({seconds[0] / s:.0%} of the bound's speed)" if i else name
                                       for i, (name, s) in enumerate(zip(labels, seconds))], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1e3 * max(seconds) * 1.15)
    ax.set_xlabel("ms per decode step (batch 1, float32)")
    ax.set_title(title or "From the roofline bound to eager decode", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
