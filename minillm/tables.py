"""The README's and docs' result tables, rebuilt from the JSON that the benchmark commands and the
notebooks write (``figures/*.json``), so that a table never drifts from the run that produced it.

    python -m minillm.tables                 rewrite every table between its markers
    python -m minillm.tables --check         exit 1 (and name the table) where a file is out of date
    python -m minillm.tables record OUT -- CMD ...
                                             run ``python -m minillm CMD ... --json`` and keep its report
                                             in OUT with the command, the date and the machine's load

A table lives in a Markdown file between ``<!-- table:NAME -->`` and ``<!-- /table -->``; ``TABLES`` says
which builder fills it from which JSON. Each builder ends its table with the command and date that
produced the JSON, so a reader can tell what was measured when. A record is
``{"command", "date", "load", "report"}``: ``report`` is what the command printed with ``--json``, or
what a notebook measured (``record`` below).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from .files import atomic_write, dumps_strict

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "figures"


# ---------------------------------------------------------------------------------------------- records

def load_average() -> str:
    """The 1/5/15-minute load averages, as ``uptime`` prints them (``"n/a"`` where the OS has none)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def record(report: dict, path: str | os.PathLike, command: str) -> Path:
    """Write ``report`` to ``path`` as a record: the command that measured it, today's UTC date and the
    machine's load average beside it. Notebooks call this with their measurements."""
    rec = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "load": load_average(), "report": report}
    with atomic_write(path) as tmp:
        tmp.write_text(dumps_strict(rec, indent=1) + "\n", encoding="utf-8")
    return Path(path)


def record_command(out: str | os.PathLike, argv: list[str]) -> Path:
    """Run ``python -m minillm ARGV --json`` and record its report in ``out``.

    Raises:
        RuntimeError: the command failed (its exit status and the end of its error output are named).
    """
    argv = [a for a in argv if a != "--json"] + ["--json"]
    proc = subprocess.run([sys.executable, "-m", "minillm", *argv], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m minillm {' '.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return record(json.loads(proc.stdout), out, "python -m minillm " + " ".join(argv))


def read_record(name: str, folder: Path = FIGURES) -> dict:
    """The record ``folder/name``.

    Raises:
        FileNotFoundError: the JSON is not there (the error names the command or notebook that writes it).
    """
    path = folder / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found; {WRITERS.get(name, 'its benchmark')} writes it")
    rec = json.loads(path.read_text(encoding="utf-8"))
    if not {"command", "date", "report"} <= set(rec):
        raise ValueError(f"{path}: not a record (needs command, date, report); rewrite it with {WRITERS.get(name)}")
    return rec


def _source(rec: dict) -> str:
    load = f", load average {rec['load']}" if rec.get("load") else ""
    return f"`{rec['command']}`, {rec['date']}{load}"


def _table(header: list[str], align: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


# ---------------------------------------------------------------------------------------------- builders

def headline(folder: Path = FIGURES) -> str:
    """The README's table: each technique against its baseline, from the tour and from ``bench decode``."""
    tour, bench = read_record("tour.json", folder), read_record("bench_decode.json", folder)
    rows = []
    for r in tour["report"]["rows"]:
        rows.append([r["technique"], r["baseline"], f"{r['baseline_tokens_per_s']:.1f}", f"{r['tokens_per_s']:.1f}",
                     f"{r['speedup']:.1f}x", r["check"], "tour"])
    res = bench["report"]["results"]
    if "transformers (same GGUF)" in res:
        ours, peer = res["ours cached (contiguous KV)"], res["transformers (same GGUF)"]
        rows.append(["KV cache (contiguous)", "transformers on the same GGUF weights",
                     f"{peer['decode_tokens_per_s']:.1f}", f"{ours['decode_tokens_per_s']:.1f}",
                     f"{res['cached_over_transformers']:.1f}x",
                     "greedy tokens identical" if peer["same_tokens_as_cached"] else "tokens differ", "bench decode"])
    t, b = tour["report"], bench["report"]
    lines = _table(["technique", "its baseline", "baseline tokens/s", "tokens/s", "speedup", "check", "run"],
                   ["l", "l", "r", "r", "r", "l", "l"], rows)
    lines += ["", f"{t['machine']}, {t['dtype']}, batch 1, greedy. tour: {t['prompt_tokens']}-token prompt, "
              f"{t['new_tokens']} new tokens ({_source(tour)}); bench decode: {b['prompt_tokens']}-token prompt, "
              f"{b['new_tokens']} new tokens, median of {b['repeats']} ({_source(bench)})."]
    return "\n".join(lines)


def kv_cache(folder: Path = FIGURES) -> str:
    """docs/kv_cache.md's table, from notebook 02's record."""
    rec = read_record("02_kv_cache.json", folder)
    r = rec["report"]
    steps, first, last = r["step_ms"], str(min(r["positions"])), str(max(r["positions"]))
    step = "; ".join(f"{path} {steps[path][first]:.1f} → {steps[path][last]:.1f} ms" for path in steps)
    total = ", ".join(f"{path} {s:.1f} s" for path, s in r["total_s"].items())
    kib = r["kv_kib_per_token"]
    rows = [[f"step time, position {first} → {last}", step],
            [f"{r['new_tokens']} new tokens after a {r['prompt_tokens']}-token prompt (sums of the step-time fits)",
             f"{total}: static cache **{r['total_s']['none'] / r['total_s']['contiguous']:.1f}x** faster than recomputing"],
            ["KV bytes per token", f"float32 {kib['float32']:.1f} KiB, float16 {kib['float16']:.1f} KiB, int8 + scales "
             f"{kib['int8']:.1f} KiB ({100 * kib['int8'] / kib['float16']:.0f}% of float16); with 9 KV heads instead of 3: "
             f"{kib['mha_float32']:.1f} KiB in float32"],
            [f"int8 KV step time at position {r['int8_step']['position']}",
             f"float32 cache {r['int8_step']['float32_ms']:.1f} ms, int8 cache {r['int8_step']['int8_ms']:.1f} ms "
             f"({r['int8_step']['int8_ms'] / r['int8_step']['float32_ms']:.2f}x)"],
            [f"int8 KV perplexity ({r['perplexity']['play']}, {r['perplexity']['tokens']:,} tokens, "
             f"{r['perplexity']['seqlen']}-token windows)",
             f"{r['perplexity']['float32']:.2f} → {r['perplexity']['int8']:.2f} "
             f"({100 * (r['perplexity']['int8'] / r['perplexity']['float32'] - 1):+.2f}%)"]]
    lines = _table(["notebook 02", "this run"], ["l", "l"], rows)
    lines += ["", f"{r['machine']}, float32, batch 1, greedy; {_source(rec)}."]
    return "\n".join(lines)


def roofline(folder: Path = FIGURES) -> str:
    """docs/roofline.md's table: predicted vs measured per forward, from notebook 01's record, with the
    ceiling that bounded it."""
    rec = read_record("01_roofline.json", folder)
    r = rec["report"]
    rows = []
    for row in r["rows"]:
        shape = f"B={row['batch_size']}" if row["kind"] == "decode" else f"T={row['tokens']}"
        rows.append([f"{row['kind']} {shape}", f"{row['intensity']:.1f}", row["bound"],
                     f"{row['predicted_tokens_per_s']:.1f}", f"{row['measured_tokens_per_s']:.1f}",
                     f"{row['measured_over_predicted']:.2f}"])
    c = r["ceilings"]
    lines = _table(["forward (float32)", "FLOP/byte", "bound", "predicted tokens/s", "measured tokens/s",
                    "measured / predicted time"], ["l", "r", "l", "r", "r", "r"], rows)
    lines += ["", f"Ceilings measured right before these rows: streaming read {c['read_GB_per_s']:.1f} GB/s, "
              f"copy {c['copy_GB_per_s']:.1f} GB/s, float32 matmul {c['matmul_float32_GFLOP_per_s']:.0f} GFLOP/s."]
    comp = r.get("compiled")
    if comp:
        lines += ["", *_table(["batch-1 decode, float32", "tokens/s", "share of the bound"], ["l", "r", "r"], [
            ["bound (model bytes / streaming read)", f"{comp['bound_tokens_per_s']:.1f}", "100%"],
            ["plain read of the model's own weight tensors", f"{comp['weight_read_tokens_per_s']:.1f}",
             f"{comp['weight_read_tokens_per_s'] / comp['bound_tokens_per_s']:.0%}"],
            ["compiled (`compile_decode`)", f"{comp['compiled_tokens_per_s']:.1f}",
             f"{comp['compiled_tokens_per_s'] / comp['bound_tokens_per_s']:.0%}"],
            ["eager", f"{comp['eager_tokens_per_s']:.1f}", f"{comp['eager_tokens_per_s'] / comp['bound_tokens_per_s']:.0%}"]]),
            "", f"The notebook's median compiled-decode round, with its own ceiling measured right before it: "
            f"{comp['read_GB_per_s']:.1f} GB/s."]
        share = comp["compiled_tokens_per_s"] / comp["bound_tokens_per_s"]
        eager = next(row for row in r["rows"] if row["kind"] == "decode" and row["batch_size"] == 1)
        met = {True: "met", False: "**not met**"}
        lines += ["", f"Goals: batch-1 decode within 25% of the prediction: eager {eager['measured_over_predicted']:.2f}x "
                  f"the predicted time ({met[eager['measured_over_predicted'] <= 1.25]}), compiled {1 / share:.2f}x "
                  f"({met[1 / share <= 1.25]}); at least 75% of the bound: compiled {share:.0%} ({met[share >= 0.75]})."]
    lines += ["", f"{r['machine']}, batch 1 unless stated; {_source(rec)}."]
    return "\n".join(lines)


# which builder fills which table, and which files hold it
TABLES = {"headline": headline, "kv_cache": kv_cache, "roofline": roofline}
# wired where the JSON is committed; headline (README.md) waits for figures/tour.json and figures/bench_decode.json,
# roofline (docs/roofline.md) for notebook 01's figures/01_roofline.json
FILES = {"docs/kv_cache.md": ["kv_cache"]}
WRITERS = {"tour.json": "`python -m minillm.tables record figures/tour.json -- tour`",
           "bench_decode.json": "`python -m minillm.tables record figures/bench_decode.json -- bench decode`",
           "02_kv_cache.json": "notebooks/02_kv_cache.ipynb", "01_roofline.json": "notebooks/01_roofline.ipynb"}

MARKER = re.compile(r"(<!-- table:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def rebuild_text(text: str, folder: Path = FIGURES, where: str = "") -> str:
    """``text`` with every marked table rebuilt from the JSON in ``folder``.

    Raises:
        KeyError: a marker names a table that ``TABLES`` does not know.
    """
    def fill(m: re.Match) -> str:
        name = m["name"]
        if name not in TABLES:
            raise KeyError(f"{where}: <!-- table:{name} --> names no table; known: {', '.join(TABLES)}")
        return m.group(1) + TABLES[name](folder) + "\n" + m.group(4)
    return MARKER.sub(fill, text)


def rebuild(root: Path = ROOT, folder: Path | None = None, check: bool = False) -> list[str]:
    """Rebuild the tables in ``FILES`` under ``root``; returns the files that changed (with ``check``,
    the files that would change, untouched)."""
    folder = folder or root / "figures"
    changed = []
    for rel in FILES:
        path = root / rel
        old = path.read_text(encoding="utf-8")
        new = rebuild_text(old, folder, rel)
        if new != old:
            changed.append(rel)
            if not check:
                with atomic_write(path) as tmp:
                    tmp.write_text(new, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        if len(argv) < 4 or argv[2] != "--":
            print("usage: python -m minillm.tables record OUT.json -- COMMAND [ARGS...]", file=sys.stderr)
            return 2
        print(record_command(argv[1], argv[3:]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m minillm.tables", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is out of date")
    args = parser.parse_args(argv)
    changed = rebuild(check=args.check)
    for rel in changed:
        print(f"{rel}: {'out of date' if args.check else 'rebuilt'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
