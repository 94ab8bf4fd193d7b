"""The stack's figure: output tokens/s of each configuration against the memory it needs (weights read by a
forward plus the peak KV cache), each beside its roofline bound (``minillm.lab.stack``); and the outlook's
arithmetic: the constant state of recurrent models (Mamba-1, Mamba-2, RWKV) against a growing KV cache.

State per layer, in elements, from the papers' recurrences:
* Mamba-1 (Gu & Dao 2023, Sec. 3): the SSM state d_inner x d_state and the causal convolution's last
  d_conv - 1 inputs, d_inner x (d_conv - 1); d_inner = expand x d_model.
* Mamba-2 (Dao & Gu 2024, Sec. 7): heads x head_dim x d_state = d_inner x d_state, and the convolution's
  (d_inner + 2 x ngroups x d_state) x (d_conv - 1) (it convolves x, B and C).
* RWKV-4 (Peng et al. 2023): five vectors of d_model (the WKV numerator, denominator and running max, and
  the two token-shift inputs). RWKV-5/6 (Peng et al. 2024): a head_size x head_size matrix per head,
  d_model x head_size, plus the two token-shift vectors.
"""

from __future__ import annotations

from pathlib import Path


def plot_stack(report: dict, path: str | Path | None = None):
    """One point per row of ``report`` (``bench_stack``'s), its bound above it on a dotted line; log scales.
    Saves to ``path`` when given; returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = plt.get_cmap("tab10").colors
    for i, r in enumerate(report["rows"]):
        mb = (r["weight_bytes"] + r["peak_kv_bytes"]) / 1e6
        c = colors[i % len(colors)]
        ax.plot([mb, mb], [r["output_tokens_per_s"], r["bound_tokens_per_s"]], ":", color=c, lw=1)
        label = f"{r.get('label', i + 1)}. {r['name']}"
        ax.scatter([mb], [r["output_tokens_per_s"]], color=c, s=50, zorder=3, label=label)
        ax.scatter([mb], [r["bound_tokens_per_s"]], facecolors="none", edgecolors=c, s=50, zorder=3)
        ax.annotate(f"{r['output_tokens_per_s']:.{0 if r['output_tokens_per_s'] >= 10 else 1}f}", (mb, r["output_tokens_per_s"]), textcoords="offset points",
                    xytext=(6, -10), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("memory: weights read per forward + peak KV cache (MB)")
    ax.set_ylabel("output tokens/s (filled) and roofline bound (hollow)")
    ax.set_title(f"{report['num_requests']} requests, {report['new_tokens']} new tokens each, {report['device']}")
    ax.legend(fontsize=8, loc="best")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


#: configurations of about the embedded model's size (135M): the released small checkpoints' shapes
STATE_MODELS = {
    "Mamba-1 130M": dict(kind="mamba1", d_model=768, n_layers=24, d_state=16),
    "Mamba-2 130M": dict(kind="mamba2", d_model=768, n_layers=24, d_state=128),
    "RWKV-4 169M": dict(kind="rwkv4", d_model=768, n_layers=12),
    "RWKV-6 190M": dict(kind="rwkv6", d_model=768, n_layers=12),
}


def state_elements(kind: str, d_model: int, n_layers: int, d_state: int = 16, d_conv: int = 4, expand: int = 2,
                   ngroups: int = 1, head_size: int = 64) -> int:
    """Elements of one sequence's recurrent state, all layers (the formulas in the module docstring).

    Raises:
        ValueError: an unknown kind.
    """
    d_inner = expand * d_model
    per_layer = {"mamba1": d_inner * d_state + d_inner * (d_conv - 1),
                 "mamba2": d_inner * d_state + (d_inner + 2 * ngroups * d_state) * (d_conv - 1),
                 "rwkv4": 5 * d_model, "rwkv6": d_model * head_size + 2 * d_model}
    if kind not in per_layer:
        raise ValueError(f"kind: {kind!r} is not one of {list(per_layer)}")
    return n_layers * per_layer[kind]


def crossover_tokens(state_bytes: float, kv_bytes_per_token: float) -> float:
    """The sequence length at which a KV cache of ``kv_bytes_per_token`` bytes per token outgrows a constant
    state of ``state_bytes``."""
    return state_bytes / kv_bytes_per_token
