"""The paged memory figures: utilisation against block size (the fragmentation lab) and two block tables
sharing blocks after a fork, with the copy-on-write block marked (Kwon et al. 2023, Fig. 2 and Fig. 8).
matplotlib is imported when a figure is drawn, so that importing minillm.paged costs nothing for those
who only serve."""

from __future__ import annotations

from pathlib import Path

from ..files import save_figure
from .block_manager import BlockManager

COLOURS = {"sharegpt": "tab:blue", "alpaca": "tab:orange"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_memory_vs_block_size(report: dict, path) -> Path:
    """Share of reserved KV memory holding tokens against block size (log 2 axis), one line per trace
    of ``report`` (``fragmentation.run_lab``), the reservation schemes as horizontal lines and the
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
