"""The roofline's figures: the roofline itself with each forward placed on it, and predicted against
measured tokens/s (notebook 01, ``python -m minillm roofline``). matplotlib is imported when a figure
is drawn, so that importing the roofline costs nothing for those who only measure."""

from __future__ import annotations

from .ceilings import Ceilings


def plot_roofline(ceilings: Ceilings, rows: list[dict], path, dtype: str = "float32", title: str | None = None):
    """The classic log-log roofline (attainable FLOP/s vs arithmetic intensity) with measured points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    bw, peak = ceilings.bandwidth, ceilings.matmul_flops[dtype]
    x = np.logspace(-1, 4, 200)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.loglog(x, np.minimum(peak, bw * x), "k-", lw=2, label=f"roofline ({dtype}, measured)")
    ax.axvline(peak / bw, color="gray", ls=":", lw=1)
    ax.text(peak / bw, peak * 1.15, f"ridge {peak / bw:.0f} FLOP/B", ha="center", fontsize=8)
    for kind, marker in (("decode", "o"), ("prefill", "s")):
        pts = [r for r in rows if r["kind"] == kind and r["dtype"] == dtype]
        if pts:
            ax.loglog([r["intensity"] for r in pts], [r["achieved_flops"] for r in pts], marker, ls="",
                      label=f"{kind} (measured)")
            for r in pts:
                label = f"B={r['batch_size']}" if kind == "decode" else f"T={r['tokens']}"
                ax.annotate(label, (r["intensity"], r["achieved_flops"]), fontsize=7, xytext=(3, -9),
                            textcoords="offset points")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or "Roofline, SmolLM2-135M on this machine")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_predicted_vs_measured(rows: list[dict], path, title: str | None = None):
    """Predicted and measured milliseconds per token for each row of ``compare``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['kind']}\n{r['dtype']}\n{'B=' + str(r['batch_size']) if r['kind'] == 'decode' else 'T=' + str(r['tokens'])}"
              for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [1e3 * r["predicted_s"] / r["tokens"] for r in rows], 0.4, label="predicted")
    ax.bar([i + 0.2 for i in x], [1e3 * r["measured_s"] / r["tokens"] for r in rows], 0.4, label="measured")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms per token")
    ax.set_title(title or "Predicted vs measured time per token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
