"""Helpers the lesson notebooks share, so that a lesson's cells are inference and plots.

* ``interleaved_compare``: the roofline's predicted vs measured time, each forward timed right after its
  own ceiling, round by round, reported as the median of the per-round ratios;
* ``QUALITY_BUDGET``, ``protocol``, ``vs_float``, ``quality``: one quality budget for the course, every
  perplexity named by its protocol and stated relative to the float model on that same protocol;
* ``without_goals``: a command's report without its acceptance-goal lines;
* ``report_share``: how many of a notebook's code lines build reports rather than run the model or plot;
* ``draft_summary``, ``int4_quality``: what records hold, in the words docs/speculative.md and the README
  quote (tests keep them equal);
* ``plot_*``: the lessons' figures that the lab's plots crowd (labels on points, empty axes).
"""

from __future__ import annotations

import ast
import json
import statistics
from pathlib import Path

import torch

from ..linear import Linear
from ..roofline import ceilings as roofline_ceilings
from ..timing import dtype_name, measure_decode, time_median

QUALITY_BUDGET = 0.02  # the course's one budget: at most 2% more perplexity than float on the same protocol


# ---------------------------------------------------------------- the roofline, interleaved


def interleaved_compare(model, batch_sizes=(1,), prompt_lengths=(), rounds: int = 3, megabytes: int = 256) -> list[dict]:
    """``roofline.compare``'s rows, each forward timed right after the ceiling that judges it.

    Every round measures the matmul peak once, then, for each forward in turn, the bandwidth and that
    forward (a prefill, which the peak bounds, remeasures the peak too); a row reports the median over the
    rounds of measured / predicted time (the median of ratios, never a ratio of medians taken under
    different ceilings), beside the per-round ratios and bandwidths.

    Returns:
        rows in ``compare``'s shape (kind, batch_size, tokens, intensity, bound, predicted_s, measured_s,
        predicted_tokens_per_s, measured_tokens_per_s, measured_over_predicted) from the round whose ratio
        is the median, plus ``ratios`` and ``bandwidths_GB_per_s`` (one per round) and ``rounds``.
    """
    if rounds < 1:
        raise ValueError(f"rounds: {rounds}; give at least 1 (3 or more for a median that ignores one bad round)")
    dtype = dtype_name(model.dtype)
    jobs = [((b,), ()) for b in batch_sizes] + [((), (t,)) for t in prompt_lengths]
    per_job = [[] for _ in jobs]
    for _ in range(rounds):
        peak = roofline_ceilings.measure("cpu", dtypes=(dtype,), megabytes=16, repeats=3).matmul_flops
        for i, (bs, ts) in enumerate(jobs):
            ceil = roofline_ceilings.measure("cpu", dtypes=(dtype,) if ts else (), megabytes=megabytes, repeats=5)
            ceil.matmul_flops = ceil.matmul_flops or dict(peak)
            row = roofline_ceilings.compare(model, ceil, batch_sizes=bs, prompt_lengths=ts)[0]
            per_job[i].append({**row, "bandwidth_GB_per_s": ceil.bandwidth / 1e9})
    rows = []
    for runs in per_job:
        ratios = [r["measured_over_predicted"] for r in runs]
        mid = sorted(runs, key=lambda r: r["measured_over_predicted"])[len(runs) // 2]
        rows.append({**mid, "ratios": ratios, "bandwidths_GB_per_s": [r["bandwidth_GB_per_s"] for r in runs],
                     "measured_over_predicted": statistics.median(ratios), "rounds": len(runs)})
    return rows


def median_ratio(rounds: list[dict], key: str) -> float:
    """The median over rounds of ``round[key]['measured_over_predicted']``: each round's own ceiling."""
    return statistics.median(r[key]["measured_over_predicted"] for r in rounds)


def step_outside_linear(model, rounds: int = 3) -> dict:
    """Batch-1 decode step and its linear layers alone (minillm's ``Linear``, one row each), timed back to
    back per round, so that both timings of a round share the machine's state of that minute.

    Returns:
        {"step_s": [...], "linear_s": [...], "outside_share": the median over rounds of (step - linear) / step}.
    """
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    xs = {n: torch.randn(1, n, dtype=model.dtype, device=model.device) for n in {m.in_features for m in layers}}
    steps, linears = [], []
    with torch.inference_mode():
        for _ in range(rounds):
            steps.append(measure_decode(model, 1))
            linears.append(time_median(lambda: [m(xs[m.in_features]) for m in layers], model.device, 5))
    shares = [(s - lin) / s for s, lin in zip(steps, linears)]
    return {"step_s": steps, "linear_s": linears, "outside_share": statistics.median(shares)}


# ---------------------------------------------------------------- quality, one budget, named protocols


def protocol(play: str, tokens: int, seqlen: int) -> str:
    """The name of a perplexity protocol, e.g. 'hamlet, 4,088 tokens in windows of 512'."""
    return f"{play}, {tokens:,} tokens in windows of {seqlen}"


def vs_float(ppl: float, float_ppl: float) -> float:
    """Perplexity relative to the float model on the same protocol: +0.05 means 5% higher."""
    return ppl / float_ppl - 1


def within_budget(ppl: float, float_ppl: float, budget: float = QUALITY_BUDGET) -> bool:
    """Whether ``ppl`` is at most ``budget`` above the float model's on the same protocol."""
    return vs_float(ppl, float_ppl) <= budget


def quality(ppl: float, float_ppl: float, budget: float = QUALITY_BUDGET) -> str:
    """'+9.2% over float (outside the 2% budget)': a perplexity as the course states it."""
    change = vs_float(ppl, float_ppl)
    inside = "within" if change <= budget else "outside"
    return f"{100 * change:+.1f}% over float ({inside} the {budget:.0%} budget)"


# ---------------------------------------------------------------- reports for students


def without_goals(text: str) -> str:
    """A command's text report without its acceptance-goal lines (lines that start with 'goal')."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().lower().startswith("goal"))


_REPORT_CALLS = {"Markdown", "record"}


def report_share(notebook: str | Path) -> dict:
    """How many of a notebook's code lines build reports: calls to ``Markdown(...)`` or ``record(...)``
    (the whole call, however many lines), and statements that only assemble strings for them
    (an f-string anywhere in a statement other than ``print``). Blank and comment lines are not counted.

    Returns:
        {"code_lines", "report_lines", "share"}.
    """
    nb = json.loads(Path(notebook).read_text(encoding="utf-8"))
    code = report = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        lines = src.splitlines()
        counted = {i + 1 for i, line in enumerate(lines) if line.strip() and not line.strip().startswith(("#", "%"))}
        code += len(counted)
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        marked: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in _REPORT_CALLS:
                marked.update(range(node.lineno, node.end_lineno + 1))
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Expr)) and _builds_text(node.value):
                marked.update(range(node.lineno, node.end_lineno + 1))
        report += len(marked & counted)
    return {"code_lines": code, "report_lines": report, "share": report / code if code else 0.0}


def _builds_text(value) -> bool:
    """A statement that assembles text: an f-string anywhere in it, outside a ``print`` call."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "print":
        return False
    return any(isinstance(n, ast.JoinedStr) for n in ast.walk(value))


# ---------------------------------------------------------------- what notebooks store


def draft_summary(report: dict) -> str:
    """docs/speculative.md's paragraph on 04a's draft model and replay, from 04a's record (``report["draft"]``
    and ``report["replay"]``), so that the docs quote the record and nothing else."""
    d, rp = report["draft"], report["replay"]
    need = (f"alpha of at least {d['alpha_for_2x']:.2f} (gamma {d['alpha_for_2x_gamma']} of 1..{d['gamma_max']})"
            if d["alpha_for_2x"] is not None else f"more than a perfect draft at any gamma up to {d['gamma_max']}")
    return "\n".join([
        f"* cost c = {d['c']:.2f} target decode steps per drafted token (4 of 30 layers, but the whole "
        "28 M-parameter output layer);",
        f"* cross-entropy to the target's top-64 distribution {d['loss_first']:.2f} -> {d['loss_last']:.2f} nats "
        f"({d['steps']} steps; floor: the target's own top-64 entropy, {d['floor']:.2f} nats);",
        f"* on a chat answer at gamma 2: alpha {d['alpha_distilled']:.2f} (untrained early exit: "
        f"{d['alpha_untrained']:.2f}), {d['speedup_distilled']:.2f}x plain decoding ({d['speedup_untrained']:.2f}x);",
        f"* what 2x would take at this c: {need}; a perfect draft at gamma 2 would give {d['perfect_gamma2']:.2f}x "
        f"(2c + verify(3) / verify(1) = {d['perfect_gamma2_cost']:.2f} decode steps for 3 tokens);",
        f"* replaying the greedy answers over gamma 1..{rp['gamma_max']} and shortest matches of 1..3 tokens: at most "
        f"{rp['summarise']:.2f} tokens per pass for the summary and {rp['edit_code']:.2f} for the code, before any "
        f"verify cost (rewrite: {rp['rewrite']:.2f} at gamma {rp['rewrite_gamma']}).",
    ])


# ---------------------------------------------------------------- figures


def plot_allocations(result: dict, path, option_bpw):
    """The bits per weight chosen for every layer at every budget, for both measurements side by side:
    errors of the block's output (``result["variable"]``) and KL on the logits (``result["variable_kl"]``).
    ``option_bpw(bits, group_size)`` gives an option's bits per weight. Writes a PNG; returns its path."""
    import matplotlib.pyplot as plt

    from ..files import save_figure

    opts = [tuple(o) for o in result["measurement"]["options"]]
    lo, hi = min(option_bpw(*o) for o in opts), max(option_bpw(*o) for o in opts)
    panels = [(key, title) for key, title in (("variable", "measured by block-output error"),
                                              ("variable_kl", "measured by KL on the logits")) if result.get(key)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.4 + 0.45 * sum(len(result[k]) for k, _ in panels)),
                             squeeze=False, layout="constrained")
    for ax, (key, title) in zip(axes[:, 0], panels):
        rows = sorted(result[key], key=lambda r: r["target_bpw"])
        names = list(rows[0]["choice"])
        grid = [[option_bpw(*r["choice"][n]) for n in names] for r in rows]
        im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest", vmin=lo, vmax=hi)
        ax.set_yticks(range(len(rows)), [f"{r['target_bpw']:g}: ppl {r['perplexity']:,.0f}" for r in rows], fontsize=8)
        ticks = [k for k, n in enumerate(names) if n.endswith("attn.wqkv")]
        ax.set_xticks(ticks, [n.split(".")[1] for n in names if n.endswith("attn.wqkv")], fontsize=7)
        ax.set_title(f"bits chosen per layer, {title}", fontsize=10)
        ax.set_ylabel("budget (bpw)")
    axes[-1, 0].set_xlabel("block (4 layers each: qkv, o, gate/up, down)")
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="bits per weight of the chosen option")
    return save_figure(fig, path)


def int4_quality(table: dict, budget: float = QUALITY_BUDGET) -> str:
    """The README's sentence on what the int4 rows cost in quality, from notebook 05's results table
    (``figures/05_quant_table.json``): RTN and GPTQ at 4 bits, group 64, and the best 4-bit entry, each
    against the float model on the table's protocol and the course's budget."""
    rows = {(r["method"], r["bits"], r["group_size"]): r for r in table["rows"]}
    flt, setup = table["float"]["perplexity"], table["float"]
    best = min((r for r in table["rows"] if r["bits"] == 4), key=lambda r: r["perplexity"])
    name = protocol("Hamlet", setup["tokens"], setup["seqlen"])
    return (f"What the int4 rows cost in quality (notebook 05's results table: {name}, perplexity against the float "
            f"model on the same protocol; the course's budget is {budget:.0%}): RTN group 64 "
            f"{100 * vs_float(rows[('rtn', 4, 64)]['perplexity'], flt):+.1f}%, GPTQ group 64 "
            f"{100 * vs_float(rows[('gptq', 4, 64)]['perplexity'], flt):+.1f}%, the best 4-bit entry "
            f"({best['method'].upper()} group {best['group_size']}) {100 * vs_float(best['perplexity'], flt):+.1f}%: "
            f"{'none' if not within_budget(best['perplexity'], flt, budget) else 'not every one'} within the budget. "
            "On this 135M model, 4 bits buy speed and size, not free quality.")


def plot_speedups(rows: list[dict], path):
    """Speculative decoding per workload, one row each: the three predictions (closed form, closed form
    with the measured verify cost, proposer-aware) and the measured speedup on one axis, so that no two
    workloads' labels share a place. Writes a PNG; returns its path."""
    import matplotlib.pyplot as plt

    from ..files import save_figure

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
    ax.set_yticks(range(len(rows)), [r["workload"].split(" (")[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.08 * max(r[k] for r in rows for k, _, _ in kinds))
    ax.set_xlabel("speedup over plain cached decoding (x); dotted: 1x")
    ax.set_title("Speculative decoding: three predictions and the measurement, per workload", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_ppl_vs_bits(table: dict, path, method_style: dict):
    """Perplexity against bits per weight, one line per method and bit width; each x position is one
    (bits, group size) setting, named on the axis instead of beside every point. Writes a PNG; returns its path."""
    import matplotlib.pyplot as plt

    from ..files import save_figure

    fig, ax = plt.subplots(figsize=(8, 4.8))
    settings = {}
    for method, (color, marker) in method_style.items():
        for bits, ls in ((4, "-"), (3, "--")):
            rows = sorted((r for r in table["rows"] if r["method"] == method and r["bits"] == bits),
                          key=lambda r: r["bits_per_weight"])
            if rows:
                ax.plot([r["bits_per_weight"] for r in rows], [r["perplexity"] for r in rows], ls=ls, marker=marker,
                        color=color, label=f"{method} {bits}-bit")
            for r in rows:
                group = "per channel" if r["group_size"] == -1 else f"g{r['group_size']}"
                settings[round(r["bits_per_weight"], 3)] = f"{bits}-bit {group}\n{r['bits_per_weight']:.2f}"
    ax.axhline(table["float"]["perplexity"], color="k", ls=":", lw=1, label="float (dequantized Q4_1)")
    ax.set_yscale("log")
    ax.set_xticks(list(settings), list(settings.values()), fontsize=8)
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("bits per weight (code + float16 scale + zero per group, linear layers)")
    ax.set_ylabel(f"perplexity ({table['setup']['eval_text']}, log scale)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title("SmolLM2-135M: perplexity vs bits per weight")
    fig.tight_layout()
    return save_figure(fig, path)


def plot_linear_layouts(layouts: dict[int, dict[str, float]], weight_bytes: float, ceiling: float, path):
    """GB/s at which each weight layout streams one decode step's linear layers, per batch size, against the
    ceiling measured beside them; the x axis ends just past the longest bar and the legend sits below the
    plot. ``layouts``: {batch: {layout: seconds}}; ``ceiling`` in bytes/s. Writes a PNG; returns its path."""
    import matplotlib.pyplot as plt

    from ..files import save_figure

    names = list(dict.fromkeys(n for per in layouts.values() for n in per))
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(names) * len(layouts) + 2.2))
    height = 0.8 / len(layouts)
    for i, (batch, per) in enumerate(layouts.items()):
        gbs = [weight_bytes / per[n] / 1e9 if n in per else 0 for n in names]
        bars = ax.barh([k + i * height for k in range(len(names))], gbs, height, label=f"batch {batch}")
        ax.bar_label(bars, [f"{v:.1f}" for v in gbs], fontsize=7, padding=2)
    ax.axvline(ceiling / 1e9, color="k", ls="--", lw=1, label=f"ceiling (larger of copy and read): {ceiling / 1e9:.1f} GB/s")
    top = max(max(weight_bytes / s / 1e9 for per in layouts.values() for s in per.values()), ceiling / 1e9)
    ax.set_xlim(0, 1.15 * top)
    ax.set_yticks([k + height * (len(layouts) - 1) / 2 for k in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s of weights streamed by one decode step's linear layers")
    ax.set_title("Same weights, same bytes: the kernel sets the bandwidth", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_decode_waterfall(steps: dict[str, float], path, title: str | None = None):
    """Batch-1 decode from the bound down (``{label: seconds}``, the bound first): each bar labelled inside
    with its milliseconds and its share of the bound's speed, so the x axis ends at the slowest stage.
    Writes a PNG; returns its path."""
    import matplotlib.pyplot as plt

    from ..files import save_figure

    labels, seconds = list(steps), list(steps.values())
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(labels) + 1.4))
    bars = ax.barh(range(len(labels)), [1e3 * s for s in seconds], color=["k"] + [f"C{i}" for i in range(len(labels) - 1)])
    ax.bar_label(bars, [f"{1e3 * s:.1f} ms" + (f" ({seconds[0] / s:.0%} of the bound's speed)" if i else "")
                        for i, s in enumerate(seconds)], fontsize=8, label_type="center", color="w")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1e3 * max(seconds) * 1.02)
    ax.set_xlabel("ms per decode step (batch 1, float32)")
    ax.set_title(title or "From the roofline bound to eager decode", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
