"""``python -m minillm fragmentation``: the fragmentation lab's table (or JSON) and its figures
(Kwon et al. 2023, Sec. 3, Fig. 2; ``minillm.paged.fragmentation``)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..files import check_output_path, runs_folder
from ..options import print_json
from .fragmentation import TRACES, format_table, run_lab
from .plots import plot_fork_cow, plot_memory_vs_block_size


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
