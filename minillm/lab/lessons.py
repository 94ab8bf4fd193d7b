"""Helpers the lesson notebooks share, so that a lesson's cells are inference and plots.

* ``interleaved_compare``: the roofline's predicted vs measured time, each forward timed right after its
  own ceiling, round by round, reported as the median of the per-round ratios;
* ``QUALITY_BUDGET``, ``protocol``, ``vs_float``, ``quality``: one quality budget for the course, every
  perplexity named by its protocol and stated relative to the float model on that same protocol;
* ``without_goals``: a command's report without its acceptance-goal lines;
* ``report_share``: how many of a notebook's code lines build reports rather than run the model or plot
  (``python -m tools.report_share`` prints it for every lesson);
* ``draft_summary``, ``int4_quality``, ``gpu_record``: what records hold, in the words docs/speculative.md and
  the README quote (tests keep them equal), and the GPU run docs/gpu.md records, for lessons run without one;
* ``plot_allocations``, ``plot_scheduler_timeline``, ``plot_ppl_vs_bits``: lesson figures with nowhere
  else to live (the last draws ``lab.quant``'s figure).

The Markdown a lesson shows after it measures is built in ``lesson_notes``.
"""

from __future__ import annotations

import ast
import json
import statistics
from pathlib import Path

import torch

from ..fast.linear import FastLinear
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
    layers = [m for m in model.modules() if isinstance(m, (Linear, FastLinear))]
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


def gpu_record(path) -> dict:
    """The GPU run docs/gpu.md records (``path``), for a lesson that runs where there is no GPU: its device and
    command line ("Command: `.ci/gpu-check` on one NVIDIA H200, 2026-11-29.") and its table's float32 rows.

    Returns:
        {"device", "source", "rows": {forward: {"predicted_tokens_per_s", "measured_tokens_per_s"}},
         "decode_B1": rows["decode B=1"]}.

    Raises:
        ValueError: the file has no command line or no "decode B=1" row (its format changed).
    """
    import re

    text = Path(path).read_text(encoding="utf-8")
    head = re.search(r"^Command: (`[^`]+`) on (.+?), (\d{4}-\d\d-\d\d)\.", text, re.M)
    rows = {m.group(1): {"predicted_tokens_per_s": float(m.group(2).replace(",", "")),
                         "measured_tokens_per_s": float(m.group(3).replace(",", ""))}
            for m in re.finditer(r"^\| ((?:decode|prefill) [BT]=\d+(?: \w+)?) \| ([\d,.]+) \| ([\d,.]+) \|", text, re.M)}
    if not head or "decode B=1" not in rows:
        raise ValueError(f"{path}: no 'Command: ... on DEVICE, DATE.' line or no 'decode B=1' row")
    return {"device": head.group(2), "source": f"docs/{Path(path).name}, {head.group(1)}, {head.group(3)}", "rows": rows,
            "decode_B1": rows["decode B=1"]}


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


def plot_scheduler_timeline(stats, rows: dict, labels: list[str], path, budget: int = 48):
    """Which request runs in which engine step (``stats``: the engine's ``EngineStats``; ``rows``: request id ->
    row; ``labels``: one per row): prefill chunks (darker: more of the step's ``budget`` tokens), decodes,
    recomputation after preemption and each preemption; the legend sits below the axes, clear of the data.
    Writes a PNG; returns its path."""
    import matplotlib.pyplot as plt

    from ..files import save_figure

    colors = {"prefill": "tab:orange", "decode": "tab:blue", "recompute": "tab:red"}
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(labels) + 2.2))
    for rec in stats.records:
        for rid, _, n, kind in rec.runs:
            ax.barh(rows[rid], 1, left=rec.step, color=colors[kind], height=0.8, alpha=min(1.0, 0.4 + n / budget))
        for rid, _ in rec.preempted:
            ax.plot(rec.step, rows[rid], "kx", ms=9, mew=2)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("engine step")
    ax.set_title("Which request runs in which step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()] + [plt.Line2D([], [], color="k", marker="x", ls="")]
    ax.legend(handles, ["prefill chunk (darker: more tokens)", "decode", "recompute after preemption", "preempted"],
              loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
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


def plot_ppl_vs_bits(table: dict, path, method_style: dict):
    """``minillm.lab.quant.plot_ppl_vs_bits``, the figure ``python -m minillm bench quant`` draws too, saved
    to ``path``; returns the path."""
    from .quant import plot_ppl_vs_bits as draw

    draw(table, path, method_style)
    return Path(path)
