"""The figures of notebook 04 and its appendix 04a: the target's verify cost against the tokens it
verifies, acceptance by draft position (with how many passes each rate rests on), predicted against
measured speedup, where the closed form's tokens per pass go, the gamma sweep, and the replay's tokens
per pass against gamma. Each function draws one figure from a ``bench spec`` report (or its parts),
writes it as a PNG at ``path`` and returns the path. matplotlib is imported when a figure is drawn.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..files import save_figure
from ..speculative.analysis import acceptance_counts


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def short_name(workload: str) -> str:
    """``"rewrite (input-grounded)"`` -> ``"rewrite"``: labels that fit beside a point."""
    return workload.split(" (")[0]


def plot_verify_cost(verify_s: dict[int, float], path) -> Path:
    """Seconds of one target forward over k tokens, in decode steps (verify_s[k] / verify_s[1]),
    against k, beside k decode steps (what k forwards of one token would cost)."""
    plt = _pyplot()
    ks = sorted(verify_s)
    ratio = [verify_s[k] / verify_s[1] for k in ks]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ks, ratio, "o-", label="one forward over k tokens (measured)")
    ax.plot(ks, ks, ":", color="gray", label="k forwards of one token (k decode steps)")
    # with many k, label one decode step and the points where the drafts double (2, 4, 8, ...); tick every fourth k
    marked = ks if len(ks) <= 17 else [k for k in ks if k == 1 or (k > 2 and (k - 1) & (k - 2) == 0)]
    for k in marked:
        r = verify_s[k] / verify_s[1]
        ax.annotate(f"{r:.2f}", (k, r), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7)
    ax.set_xticks(ks if len(ks) <= 17 else ks[::4])
    ax.set_ylim(0, max(ratio) * 1.6)
    ax.set_xlabel("tokens in one target forward, k (the pending token + k - 1 drafts)")
    ax.set_ylabel("cost in decode steps")
    ax.set_title("Verify cost: one target forward over k tokens, batch 1", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_acceptance_by_position(rows: list[dict], path, gamma: int | None = None) -> Path:
    """One panel per workload: for draft position j = 1..gamma, the share of passes that tested draft j
    and accepted it, with the counts (accepted / tested) above each bar. ``rows`` are ``bench_spec``
    rows (with their per-pass ``drafted`` and ``accepted``)."""
    plt = _pyplot()
    gamma = gamma or max(max(r["drafted"], default=0) for r in rows)
    cols = min(4, len(rows))
    nrows = math.ceil(len(rows) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3 * cols, 2.6 * nrows), sharey=True, squeeze=False)
    positions = list(range(1, gamma + 1))
    for ax, r in zip(axes.flat, rows):
        reached, ok = acceptance_counts(r["drafted"], r["accepted"])
        reached += [0] * (gamma - len(reached))
        ok += [0] * (gamma - len(ok))
        share = [o / n if n else 0.0 for o, n in zip(ok, reached)]
        ax.bar(positions, share, color="tab:blue")
        for j, s, o, n in zip(positions, share, ok, reached):
            ax.text(j, s + 0.03, f"{o}/{n}" if n else "none", ha="center", fontsize=7)
        ax.set_xticks(positions)
        ax.set_ylim(0, 1.18)
        ax.set_title(short_name(r["workload"]), fontsize=9)
    for ax in axes.flat[len(rows):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("accepted / tested")
    for ax in axes[-1]:
        ax.set_xlabel("draft position j")
    fig.suptitle("Acceptance by draft position (draft j is tested only when drafts 1..j-1 were accepted)",
                 fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_predicted_vs_measured(rows: list[dict], path) -> Path:
    """Per workload, one row: Leviathan et al.'s closed form (free verification, gamma drafts every pass),
    the closed form with the measured verify cost, the proposer-aware prediction (each pass's drafts,
    tokens and verify cost) and the measured speedup on one axis, joined by a line, so that no two
    workloads' labels share a place (a predicted-against-measured scatter stacks the slow ones at 1x)."""
    plt = _pyplot()
    kinds = (("leviathan_speedup", "x", "closed form (free verification)"),
             ("leviathan_speedup_with_verify_cost", "+", "closed form with the measured verify cost"),
             ("predicted_speedup", "o", "proposer-aware prediction"),
             ("measured_speedup", "*", "measured"))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.8))
    for i, r in enumerate(rows):
        ax.plot([min(r[k] for k, _, _ in kinds), max(r[k] for k, _, _ in kinds)], [i, i], color="0.8", lw=1, zorder=0)
    for j, (key, marker, label) in enumerate(kinds):
        ax.plot([r[key] for r in rows], range(len(rows)), marker, ls="", ms=12 if marker == "*" else 8,
                color="k" if key == "measured_speedup" else f"C{j}", label=label)
    ax.axvline(1, color="k", ls=":", lw=1)
    ax.set_yticks(range(len(rows)), [short_name(r["workload"]) for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.08 * max(r[k] for r in rows for k, _, _ in kinds))
    ax.set_xlabel("speedup over plain cached decoding (x); dotted: 1x")
    ax.set_title("Speculative decoding: three predictions and the measurement, per workload", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_tokens_per_pass(rows: list[dict], path, gamma: int) -> Path:
    """Per workload, tokens per target pass three ways: the closed form's (1 - alpha^(gamma+1)) /
    (1 - alpha) with gamma drafts in every pass, the same formula with each pass's actual drafts k
    (0 where prompt lookup found no match), and measured; the share of passes without a draft is
    written above."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.27
    xs = range(len(rows))
    bars = (("expected_tokens_per_pass", f"closed form: gamma = {gamma} drafts every pass"),
            ("tokens_per_pass_alpha", "closed form with each pass's drafts"),
            ("tokens_per_target_pass", "measured"))
    for i, (key, label) in enumerate(bars):
        ax.bar([x + (i - 1) * width for x in xs], [r[key] for r in rows], width, label=label)
    for x, r in zip(xs, rows):
        ax.text(x, max(r[k] for k, _ in bars) + 0.1, f"{r['passes_without_draft']:.0%} no draft", ha="center",
                fontsize=7)
    ax.set_xticks(list(xs), [short_name(r["workload"]) for r in rows], fontsize=8)
    ax.set_ylabel("tokens per target pass")
    ax.set_ylim(0, gamma + 1.6)
    ax.set_title(f"Where the closed form's tokens go (n-gram drafts, gamma {gamma})", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return save_figure(fig, path)


def plot_speedup_vs_gamma(sweep: dict, path) -> Path:
    """Measured (solid) and predicted (dashed) speedup against gamma per workload of a ``sweep_gamma``
    report, the best measured gamma starred; where the rows hold it, also the prediction on the
    measurement's accounting (dotted: ``predicted_speedup_after_first_token``)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, best in sweep["best"].items():
        rows = [r for r in sweep["rows"] if r["workload"] == name]
        gammas = [r["gamma"] for r in rows]
        line, = ax.plot(gammas, [r["measured_speedup"] for r in rows], "o-", label=f"{short_name(name)}, measured")
        ax.plot(gammas, [r["predicted_speedup"] for r in rows], "x--", color=line.get_color(),
                label=f"{short_name(name)}, predicted")
        if all("predicted_speedup_after_first_token" in r for r in rows):
            ax.plot(gammas, [r["predicted_speedup_after_first_token"] for r in rows], "+:", color=line.get_color(),
                    label=f"{short_name(name)}, predicted after the first token")
        top = next(r for r in rows if r["gamma"] == best["measured"])
        ax.plot([top["gamma"]], [top["measured_speedup"]], "*", ms=14, color=line.get_color())
    gammas = sorted({r["gamma"] for r in sweep["rows"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(gammas, [str(g) for g in gammas])
    ax.axhline(1, color="gray", lw=1)
    ax.set_xlabel("gamma (num_speculative_tokens)")
    ax.set_ylabel("speedup over plain cached decoding (x)")
    ax.set_title("n-gram drafts, greedy, batch 1 (star: best measured gamma)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_replay_tokens_per_pass(grids: dict[str, dict[int, dict[int, float]]], path) -> Path:
    """Tokens per target pass against gamma from ``analysis.replay_grid``: one panel per workload, one
    line per shortest match min_n (no verify cost: an upper bound on the speedup), and a line at 2."""
    plt = _pyplot()
    cols = min(3, len(grids))
    nrows = math.ceil(len(grids) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 2.8 * nrows), sharey=True, squeeze=False)
    styles = {1: ("-", "o"), 2: ("--", "s"), 3: (":", "^")}
    top = max(t for grid in grids.values() for by_gamma in grid.values() for t in by_gamma.values())
    for ax, (name, grid) in zip(axes.flat, grids.items()):
        for n, by_gamma in grid.items():
            ls, marker = styles.get(n, ("-.", None))
            ax.plot(list(by_gamma), list(by_gamma.values()), ls=ls, marker=marker, ms=3, label=f"min_n = {n}")
        ax.axhline(2, color="gray", lw=1)
        gammas = sorted({g for by_gamma in grid.values() for g in by_gamma})
        ax.set_xticks([g for g in gammas if g in (1, 2, 4, 8, 16, 24, 32) or g == gammas[-1]])
        ax.set_ylim(0.8, top * 1.1)
        ax.set_title(short_name(name), fontsize=9)
    for ax in axes.flat[len(grids):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("tokens per target pass")
    for ax in axes[-1]:
        ax.set_xlabel("gamma (most drafts per pass)")
    axes.flat[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Prompt lookup replayed on the greedy answers (gray: 2 tokens per pass)", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
