"""``python -m minillm fragmentation``: the fragmentation lab (Kwon et al. 2023, vLLM, Sec. 3 and Fig. 2): how
much of the reserved KV memory holds tokens under reservation and paging, on the traces of
``minillm.paged.fragmentation`` (which defines the schemes and the measure, ``kv_utilization``), for
block sizes 1 to 256, beside the paper's numbers; its table, its two figures (utilisation against block
size, and two block tables sharing blocks after a fork, with the copy-on-write block marked: Fig. 8) and
the command. matplotlib is imported when a figure is drawn.

What the lab leaves out: external fragmentation (a contiguous allocator's free memory in gaps too small
for the next request), which the paper's Fig. 2 counts for Orca (8.9 / 41.6 / 36.6% of memory for Max /
Pow2 / Oracle). Our reservation numbers are therefore higher than the paper's; the report's
"paper_without_external" takes it out of the paper's (token states / (1 - external)), which is what the
lab measures. Paging has no external fragmentation, so its numbers compare directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..files import check_output_path, runs_folder, save_figure
from ..options import print_json
from ..paged.block_manager import BlockManager
from ..paged.fragmentation import MAX_SEQ_LEN, TRACES, kv_utilization, make_trace

BLOCK_SIZES = tuple(2 ** i for i in range(9))  # 1, 2, 4, ..., 256
PAPER = {"max": 0.204, "pow2": 0.268, "oracle": 0.382, "paged_16": 0.963}  # Fig. 2: token states
PAPER_EXTERNAL = {"max": 0.089, "pow2": 0.416, "oracle": 0.366}  # Fig. 2: external fragmentation
COLOURS = {"sharegpt": "tab:blue", "alpaca": "tab:orange"}


def run_lab(trace_names=tuple(TRACES), block_sizes=BLOCK_SIZES, max_seq_len: int = MAX_SEQ_LEN) -> dict:
    """The lab's report: ``{"traces": {name: {"schemes": {"max": x, "pow2": x, "oracle": x,
    "paged_1": x, ...}, "num_requests", "mean_prompt", "mean_output", "distribution"}}, "paper": {...},
    "max_seq_len", "block_sizes"}``, shares in 0..1 (see the module docstring).

    Raises:
        ValueError: an unknown trace name.
    """
    without_external = {s: PAPER[s] / (1 - PAPER_EXTERNAL[s]) for s in PAPER_EXTERNAL}
    report = {"traces": {}, "paper": dict(PAPER), "paper_without_external": without_external,
              "max_seq_len": max_seq_len, "block_sizes": list(block_sizes),
              "measure": "time-averaged share of reserved KV slots holding tokens"}
    for name in trace_names:
        if name not in TRACES:
            raise ValueError(f"trace: {name!r} is not one of {list(TRACES)}")
        spec = TRACES[name]
        prompt, output = make_trace(spec, max_seq_len)
        schemes = {s: kv_utilization(prompt, output, s, max_seq_len) for s in ("max", "pow2", "oracle")}
        for bs in block_sizes:
            schemes[f"paged_{bs}"] = kv_utilization(prompt, output, f"paged_{bs}", max_seq_len)
        report["traces"][name] = {
            "schemes": schemes, "num_requests": spec.num_requests,
            "mean_prompt": float(prompt.mean()), "mean_output": float(output.mean()),
            "distribution": f"log-normal, sigma {spec.sigma}, untruncated means {spec.mean_prompt} / "
                            f"{spec.mean_output}, seed {spec.seed}, cut to {max_seq_len} tokens",
        }
    return report


def format_table(report: dict) -> str:
    """The report as a text table: one row per scheme, one column per trace, the paper's Fig. 2 beside."""
    names = list(report["traces"])
    schemes = list(next(iter(report["traces"].values()))["schemes"]) if names else []
    head = f"{'scheme':<12}" + "".join(f"{n:>12}" for n in names) + f"{'paper':>12}{'w/o ext.':>12}"
    lines = ["Share of reserved KV memory holding tokens (time-averaged over each request's life)", head,
             "-" * len(head)]
    for s in schemes:
        paper = [f"{100 * report[k][s]:.1f}%" if s in report[k] else "" for k in ("paper", "paper_without_external")]
        lines.append(f"{s:<12}" + "".join(f"{100 * report['traces'][n]['schemes'][s]:>11.1f}%" for n in names)
                     + f"{paper[0]:>12}{paper[1]:>12}")
    for n in names:
        t = report["traces"][n]
        lines.append(f"{n}: {t['num_requests']} requests, mean prompt {t['mean_prompt']:.1f}, mean output "
                     f"{t['mean_output']:.1f} tokens ({t['distribution']})")
    lines.append("paper: Kwon et al. 2023, Fig. 2 (token states; Orca rows include external fragmentation, "
                 "which the lab does not model; w/o ext.: token states / (1 - external))")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_memory_vs_block_size(report: dict, path) -> Path:
    """Share of reserved KV memory holding tokens against block size (log 2 axis), one line per trace
    of ``report`` (``run_lab``), the reservation schemes as horizontal lines and the
    paper's Fig. 2 values as markers. Writes a PNG at ``path``; returns the path."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sizes = report["block_sizes"]
    for name, trace in report["traces"].items():
        c = COLOURS.get(name)
        ax.plot(sizes, [100 * trace["schemes"][f"paged_{bs}"] for bs in sizes], "o-", color=c, label=f"paged, {name}")
        for scheme, ls in (("oracle", "--"), ("pow2", "-."), ("max", ":")):
            ax.axhline(100 * trace["schemes"][scheme], color=c, ls=ls, lw=1)
            ax.text(sizes[-1] * 1.15, 100 * trace["schemes"][scheme], f"{scheme} ({name})", va="center",
                    fontsize=7, color=c)
    paper = report["paper"]
    ax.plot([16], [100 * paper["paged_16"]], "k*", ms=11, label="paper: vLLM, block 16 (96.3%)")
    for scheme in ("max", "pow2", "oracle"):
        ax.plot([1], [100 * paper[scheme]], "kx", ms=7)
        ax.text(1.15, 100 * paper[scheme], f"paper Orca ({scheme})", fontsize=7, va="center")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(bs) for bs in sizes])
    ax.set_xlim(0.8, sizes[-1] * 4)
    ax.set_ylim(0, 102)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("reserved KV memory holding tokens (%)")
    ax.set_title("Paging vs reservation (time-averaged over each request's life)", fontsize=10)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def fork_example(block_size: int = 4, prompt_len: int = 10) -> tuple[BlockManager, list[tuple[int, int]]]:
    """A manager after: sequence 0 holds ``prompt_len`` tokens, fork to sequence 1, sequence 1 writes
    one token (its first write into the shared, partly filled last block copies it). Returns the
    manager and the copies made."""
    m = BlockManager(num_blocks=8, block_size=block_size, enable_prefix_caching=False)
    m.allocate(0)
    m.grow(0, prompt_len)
    m.fork(0, 1)
    return m, m.grow(1, prompt_len + 1)


def plot_fork_cow(path, block_size: int = 4, prompt_len: int = 10) -> Path:
    """Two block tables sharing physical blocks after a fork (``fork_example``): logical blocks of each
    sequence, arrows to the physical pool, shared blocks and the copy-on-write block marked, each
    physical block with its reference count and filled slots. Writes a PNG; returns the path."""
    plt = _pyplot()
    m, copies = fork_example(block_size, prompt_len)
    cow = {dst for _, dst in copies}
    fig, ax = plt.subplots(figsize=(8, 4))
    n_phys = m.num_blocks
    phys_x = {b: 0.5 + 1.2 * b for b in range(n_phys)}
    filled = {}
    for seq in (0, 1):
        for i, b in enumerate(m.block_table(seq)):
            filled[b] = max(filled.get(b, 0), min(block_size, m.num_tokens(seq) - i * block_size))
    for b in range(n_phys):
        refs = m.ref_counts[b]
        colour = "gold" if b in cow else "lightgreen" if refs > 1 else "lightblue" if refs else "white"
        ax.add_patch(plt.Rectangle((phys_x[b] - 0.5, 1.6), 1.0, 0.8, fc=colour, ec="k"))
        for j in range(block_size):  # one tick per slot, dark when it holds a token
            ax.add_patch(plt.Rectangle((phys_x[b] - 0.45 + j * 0.9 / block_size, 1.65), 0.9 / block_size - 0.02, 0.15,
                                       fc="dimgray" if j < filled.get(b, 0) else "white", ec="gray", lw=0.5))
        source = [src for src, dst in copies if dst == b]
        label = f"block {b}\nref {refs}" + (f"\ncopy of {source[0]}" if source else "")
        ax.text(phys_x[b], 2.12, label, ha="center", va="center", fontsize=7 if source else 8)
    for seq, y in ((0, 3.4), (1, 0.2)):
        table = m.block_table(seq)
        ax.text(-0.9, y + 0.3, f"sequence {seq}\nblock table", ha="right", va="center", fontsize=9)
        for i, b in enumerate(table):
            x = 0.5 + 1.2 * i
            ax.add_patch(plt.Rectangle((x - 0.5, y), 1.0, 0.6, fc="white", ec="k"))
            ax.text(x, y + 0.3, f"logical {i}\n-> {b}", ha="center", va="center", fontsize=7)
            y0, y1 = (y, 2.4) if y > 2 else (y + 0.6, 1.6)
            ax.annotate("", xy=(phys_x[b], y1), xytext=(x, y0),
                        arrowprops=dict(arrowstyle="->", color="darkorange" if b in cow else "k", lw=1.2))
    for src, dst in copies:
        ax.annotate("", xy=(phys_x[dst] - 0.3, 2.4), xytext=(phys_x[src] + 0.3, 2.4),
                    arrowprops=dict(arrowstyle="->", color="darkorange", lw=1.5, connectionstyle="arc3,rad=-0.6"))
        ax.text(phys_x[dst], 2.8, "copy-on-write", ha="center", fontsize=8, color="darkorange")
    handles = [plt.Rectangle((0, 0), 1, 1, fc=c, ec="k") for c in ("lightgreen", "lightblue", "gold", "white")]
    ax.legend(handles, ["shared (ref 2)", "one owner", "copy (copy-on-write)", "free"], loc="lower right",
              fontsize=7, ncol=4, bbox_to_anchor=(1.0, -0.08))
    ax.set_xlim(-2.6, phys_x[n_phys - 1] + 0.8)
    ax.set_ylim(-0.1, 4.3)
    ax.axis("off")
    ax.set_title(f"Fork after {prompt_len} tokens (block size {block_size}); sequence 1 then writes token "
                 f"{prompt_len}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def cmd_fragmentation(args) -> int:
    """Print the lab's table (``--json``: one line of strict JSON) and write its two figures under
    ``--out``; returns the exit code (0)."""
    out = Path(args.out) if args.out is not None else runs_folder()
    if args.out is None:
        out.mkdir(parents=True, exist_ok=True)
    check_output_path(out, "--out", folder=True)  # before the lab runs
    out.mkdir(exist_ok=True)
    report = run_lab([args.trace] if args.trace else list(TRACES))
    figures = [plot_memory_vs_block_size(report, out / "paged_memory_vs_block_size.png"),
               plot_fork_cow(out / "paged_fork_cow.png")]
    report["figures"] = [str(f) for f in figures]
    if args.json:
        print_json(report)
    else:
        print(format_table(report))
        print("figures: " + ", ".join(report["figures"]), file=sys.stderr)
    return 0


def register(sub) -> None:
    """Add the ``fragmentation`` subcommand to an argparse subparsers object."""
    f = sub.add_parser("fragmentation", help="share of reserved KV memory holding tokens: reservation vs paging")
    f.add_argument("--trace", choices=sorted(TRACES), default=None,
                   help="one request trace (default: both); lengths drawn with a fixed seed")
    f.add_argument("--json", action="store_true", help="print one line of strict JSON instead of the table")
    f.add_argument("--out", default=None, help="folder for the figures (default: $MINILLM_FIGURES, else "
                   "figures/runs, which git ignores; figures/ holds notebook 03's own)")
    f.set_defaults(func=cmd_fragmentation)
