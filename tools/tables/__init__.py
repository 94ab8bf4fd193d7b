"""The README's and docs' result tables, rebuilt from the JSON that the benchmark commands and the
notebooks write (``figures/*.json``), so that a table never drifts from the run that produced it.
Repository tooling: it rewrites files of this repository, so it is not part of the ``minillm`` package
(nor of its wheel). Run it from the repository's root (or give ``--root``):

    python -m tools.tables                   rewrite every table between its markers
    python -m tools.tables --check           exit 1 (and name the file) where a file is out of date
    (either)                                 exit 2, naming the record and what is wrong with it, where a
                                             record cannot be read (cut short, not JSON, binary, NUL bytes)
                                             or holds a value its table cannot use (a null, another type)
    python -m tools.tables record OUT -- CMD ...
                                             run ``python -m minillm CMD ... --json`` and keep its report
                                             in OUT with the command, the date and the machine's load

A table lives in a Markdown file between ``<!-- table:NAME -->`` and ``<!-- /table -->``; ``TABLES`` says
which builder fills it from which JSON: the README's headline here, the decode tables in ``tables.decode``
(docs/kv_cache.md, roofline.md, decode.md, speculative.md), the engine's in ``tables.paged``
(docs/paged.md), the stack's in ``tables.stack`` (README, docs/stack.md), the quantization tables in
``tables.quant`` (docs/quantization.md, built from the commands' own reports, not records), and the course's in
``tables.course`` (docs/course.md's lesson times from the notebooks, docs/course_key.md's numbers). Each builder
ends its table with the command and date that produced the JSON, so a reader can tell what was measured when. A record is
``{"command", "date", "load", "report"}``: ``report`` is what the command printed with ``--json``, or
what a notebook measured (``minillm.lab.records``, which writes and reads them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from minillm.files import atomic_write
from minillm.lab import records
from minillm.lab.records import RecordError, read_json, record

ROOT = Path(".")  # the repository: the current directory, unless --root says otherwise
FIGURES = ROOT / "figures"


def record_command(out: str | Path, argv: list[str], root: Path = ROOT) -> Path:
    """Run ``python -m minillm ARGV --json`` in ``root`` and record its report in ``out``.

    Raises:
        RuntimeError: the command failed (its exit status and the end of its error output are named).
        ValueError: ``out``'s folder does not exist (checked before the command runs, so no run is lost).
    """
    if not Path(out).parent.is_dir():
        raise ValueError(f"{out}: the folder {Path(out).parent} does not exist; create it first (the command's "
                         "report would be lost after the run)")
    argv = [a for a in argv if a != "--json"] + ["--json"]
    proc = subprocess.run([sys.executable, "-m", "minillm", *argv], capture_output=True, text=True, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m minillm {' '.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    # a cap on the instruction set is part of the command: the same command without it measures another machine
    cap = "".join(f"{name}={os.environ[name]} " for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
                  if os.environ.get(name))
    return record(json.loads(proc.stdout), out, cap + "python -m minillm " + " ".join(argv))


def read_record(name: str, folder: Path = FIGURES) -> dict:
    """The record ``folder/name`` (``minillm.lab.records.read_record``), its errors naming the command or
    notebook that rewrites it (``WRITERS``).

    Raises:
        FileNotFoundError, RecordError: as ``minillm.lab.records.read_record``.
    """
    return records.read_record(name, folder, WRITERS.get(name, "its benchmark"))


def _source(rec: dict) -> str:
    load = f", load average {rec['load']} (1/5/15 min) when it finished" if rec.get("load") else ""
    return f"`{rec['command']}`, {rec['date']}{load}"


def _table(header: list[str], align: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


TRACE_NAMES = {"sharegpt": "ShareGPT", "alpaca": "Alpaca"}


def _trace(name: str) -> str:
    return TRACE_NAMES.get(name, name)


def _first_equal(n: int, total: int, of: str) -> str:
    return f"all {total} greedy tokens equal {of}" if n == total else f"first {n}/{total} greedy tokens equal {of}"


# ---------------------------------------------------------------------------------------------- builders

def headline(folder: Path = FIGURES) -> str:
    """The README's table: each technique against its baseline, each pair from one run: the tour, ``bench
    decode`` (transformers), ``bench decode --peer llamacpp`` (llama.cpp) and ``serve-bench`` (the engine)."""
    tour, bench = read_record("tour.json", folder), read_record("bench_decode.json", folder)
    peer, serve = read_record("bench_decode_llamacpp.json", folder), read_record("serve_bench.json", folder)
    rows = []

    def row(technique, baseline, base, tps, speedup, check, run):
        rows.append([technique, baseline, f"{base:.1f}", f"{tps:.1f}", f"{speedup:.2f}x", check, run])

    for r in tour["report"]["rows"]:
        row(r["technique"], r["baseline"], r["baseline_tokens_per_s"], r["tokens_per_s"], r["speedup"], r["check"],
            "tour")
    res = bench["report"]["results"]
    if "transformers (same GGUF)" in res:
        ours, hf = res["ours cached (contiguous KV)"], res["transformers (same GGUF)"]
        row("KV cache (contiguous)", "transformers on the same GGUF weights", hf["decode_tokens_per_s"],
            ours["decode_tokens_per_s"], res["cached_over_transformers"],
            "greedy tokens identical" if hf["same_tokens_as_cached"] else "tokens differ", "bench decode")
    p = peer["report"]
    best, cpp = p["results"][p["best_ours"]], p["results"]["llama.cpp (same GGUF)"]
    row(p["best_ours"].removeprefix("ours "), "llama.cpp's Q4_1 on the same GGUF", cpp["decode_tokens_per_s"],
        best["decode_tokens_per_s"], p["best_over_llamacpp"],
        _first_equal(best["tokens_equal_to_float"], p["new_tokens"], "float32's")
        + f" (llama.cpp: first {cpp['tokens_equal_to_float']})", "bench decode --peer llamacpp")
    avx2 = read_record("bench_decode_llamacpp_avx2.json", folder)  # both sides held to AVX2 (docs/decode.md)
    a = avx2["report"]
    best, cpp = a["results"][a["best_ours"]], a["results"]["llama.cpp (same GGUF)"]
    row(a["best_ours"].removeprefix("ours ") + ", AVX2", "llama.cpp's Q4_1 built for AVX2", cpp["decode_tokens_per_s"],
        best["decode_tokens_per_s"], a["best_over_llamacpp"],
        _first_equal(best["tokens_equal_to_float"], a["new_tokens"], "float32's")
        + f" (llama.cpp: first {cpp['tokens_equal_to_float']})", "bench decode --peer llamacpp, AVX2")
    s = serve["report"]
    modes, n = s["modes"], s["num_requests"]
    engine = modes["engine"]
    for name, baseline in (("sequential", "one request at a time"), ("static", f"static batches of {s['max_num_seqs']}"),
                           ("transformers", "transformers' continuous batching")):
        if name in modes:
            row(f"paged engine, continuous batching, {n} requests", baseline, modes[name]["output_tokens_per_s"],
                engine["output_tokens_per_s"], engine["output_tokens_per_s"] / modes[name]["output_tokens_per_s"],
                f"{engine['same_tokens_as_sequential']}/{n} requests' greedy tokens equal one at a time's"
                + ("" if name == "sequential" else f" ({name}: {modes[name]['same_tokens_as_sequential']}/{n})"),
                "serve-bench")
    if "engine+spec" in modes and "transformers" in modes:
        spec, hf = modes["engine+spec"], modes["transformers"]
        row(f"the same engine + prompt-lookup speculation (auto), {n} requests", "transformers' continuous batching",
            hf["output_tokens_per_s"], spec["output_tokens_per_s"], spec["output_tokens_per_s"] / hf["output_tokens_per_s"],
            f"{spec['same_tokens_as_sequential']}/{n} requests' greedy tokens equal one at a time's", "serve-bench")
    t, b = tour["report"], bench["report"]
    lines = _table(["technique", "its baseline", "baseline tokens/s", "tokens/s", "speedup", "check", "run"],
                   ["l", "l", "r", "r", "r", "l", "l"], rows)
    # sessions run on different CPUs: one machine line when every run shares it, else each run names its own
    one_machine = len({r["machine"] for r in (t, b, p, s)}) == 1
    where = (lambda r: "") if one_machine else (lambda r: f"{r['machine']}; ")
    lines += ["", (f"{t['machine']}, " if one_machine else "") + f"{t['dtype']}, greedy. Each row's two numbers come "
              "from one run (the runs below" + ("" if one_machine else ", each on the machine it names")
              + "); the machine's bandwidth moves from minute to minute, so compare within a row.", "",
              f"* tour: batch 1, {t['prompt_tokens']}-token prompt, {t['new_tokens']} new tokens; {where(t)}"
              f"{_source(tour)}",
              f"* bench decode: batch 1, {b['prompt_tokens']}-token prompt, {b['new_tokens']} new tokens, median of "
              f"{b['repeats']}; {where(b)}{_source(bench)}",
              f"* bench decode --peer llamacpp: {p['threads']} threads each, {p['new_tokens']} new tokens, the median "
              f"of {p['repeats']} interleaved repeats; speedup = median of the per-repeat ratios; {where(p)}"
              f"{_source(peer)}",
              f"* bench decode --peer llamacpp, AVX2: the same, torch, inductor and minillm's kernels held to AVX2 "
              f"(`ATEN_CPU_CAPABILITY=avx2`), llama.cpp built for {a['llamacpp_build']}; {a['machine']}; {_source(avx2)}",
              f"* serve-bench: {n} requests at once, {_trace(s['trace'])}-like lengths x {s['scale']}, output tokens/s "
              f"over the wall time; {where(s)}{_source(serve)}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- registry

# the builders of the submodules read the helpers above, so they are imported once those exist
from . import decode as _decode  # noqa: E402
from . import paged as _paged  # noqa: E402
from . import quant as _quant  # noqa: E402
from . import stack as _stack  # noqa: E402
from . import course as _course  # noqa: E402  (reads notebooks and records: after the registry's helpers)

# which builder fills which table, and which files hold it (each checked by tests/test_tables.py)
TABLES = {"headline": headline, **_decode.TABLES, **_paged.TABLES, **_stack.TABLES}
FILES = {"README.md": ["headline", "stack_short"], **_decode.FILES, **_paged.FILES, **_stack.FILES}
READS = {"headline": ["tour.json", "bench_decode.json", "bench_decode_llamacpp.json", "serve_bench.json",
                      "bench_decode_llamacpp_avx2.json"],
         **_decode.READS, **_paged.READS, **_stack.READS}
WRITERS = {name: f"`python -m tools.tables record figures/{name} -- {cmd}`" for name, cmd in (
    ("tour.json", "tour"), ("bench_decode.json", "bench decode"),
    ("bench_decode_llamacpp.json", "bench decode --peer llamacpp"), ("serve_bench.json", "serve-bench --peer"),
    ("fragmentation.json", "fragmentation"), ("stack.json", "bench stack --quant-file FILE"))}
WRITERS["bench_decode_llamacpp_avx2.json"] = (
    "`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 PYTHONPATH=<llama-cpp-python built without AVX-512> "
    "python -m tools.tables record "
    "figures/bench_decode_llamacpp_avx2.json -- bench decode --peer llamacpp` (docs/decode.md)")
WRITERS.update({"00_quickstart.json": "notebooks/00_quickstart.ipynb",
                "03_paged_attention.json": "notebooks/03_paged_attention.ipynb",
                "02_kv_cache.json": "notebooks/02_kv_cache.ipynb", "01_roofline.json": "notebooks/01_roofline.ipynb",
                "04_speculative.json": "notebooks/04_speculative_decoding.ipynb",
                "04a_gamma_sweep.json": "notebooks/04a_speculative_appendix.ipynb"})

MARKER = re.compile(r"(<!-- table:(?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def _nulls(obj, at: str = ""):
    """The paths (``report.modes.engine.wall_s``) of the nulls in a JSON value."""
    if obj is None:
        yield at
    elif isinstance(obj, (dict, list)):
        for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            yield from _nulls(v, f"{at}[{k}]" if isinstance(obj, list) else f"{at}.{k}" if at else str(k))


def _try_read(path: Path):
    """The JSON in ``path``, or {} where it cannot be read (only to list nulls in an error)."""
    try:
        return read_json(path, "")
    except (OSError, ValueError):
        return {}


def rebuild_text(text: str, folder: Path = FIGURES, where: str = "") -> str:
    """``text`` with every marked table rebuilt from the JSON in ``folder``.

    Raises:
        KeyError: a marker names a table that ``TABLES`` does not know.
        FileNotFoundError: a record a table reads is not there.
        RecordError (a ValueError): a record cannot be read (``read_json``), lacks a key its table needs
            (written by another version of its command), or holds a value of another type than its table
            uses (a null where a number belongs: ``record`` writes a NaN measurement as null); the error
            names the table, the records it reads (with their nulls) and the commands that rewrite them.
    """
    builders, reads = {**TABLES, **_quant.TABLES, **_course.TABLES}, {**READS, **_quant.READS, **_course.READS}
    writers = {**WRITERS, **_quant.WRITERS}

    def fill(m: re.Match) -> str:
        name = m["name"]
        if name not in builders:
            raise KeyError(f"{where}: <!-- table:{name} --> names no table; known: {', '.join(builders)}")
        rerecord = f"re-record it with the command that writes it ({'; '.join(writers[r] for r in reads[name])})"
        try:
            table = builders[name](folder)
        except RecordError:
            raise  # already names its file
        except KeyError as e:
            raise RecordError(f"{where}: table {name}: a record it reads lacks the key {e}; {rerecord}") from None
        except (TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as e:
            # the builder read a value of another type (a null, a string, a list) or a zero it divides by; the
            # nulls are listed since a NaN measurement is recorded as null (some nulls are expected: "not measured")
            nulls = [f"{folder / r} at {p}" for r in reads[name] for p in _nulls(_try_read(folder / r))]
            held = f"; its records' nulls: {', '.join(nulls[:5])}" + (" ..." if len(nulls) > 5 else "") if nulls else ""
            raise RecordError(f"{where}: table {name}: a value in {', '.join(str(folder / r) for r in reads[name])} "
                              f"cannot be tabulated ({type(e).__name__}: {e}){held}; {rerecord}") from None
        return m.group(1) + table + "\n" + m.group(4)
    return MARKER.sub(fill, text)


def rebuild(root: Path = ROOT, folder: Path | None = None, check: bool = False) -> list[str]:
    """Rebuild the tables in ``FILES`` under ``root``; returns the files that changed (with ``check``,
    the files that would change, untouched). Every table is built before any file is written, so a bad
    record leaves every file as it was.

    Raises:
        as ``rebuild_text``; OSError: a Markdown file cannot be read.
    """
    folder = folder or Path(root) / "figures"
    new_texts = {}
    for rel in {**FILES, **_quant.FILES, **_course.FILES}:
        old = (Path(root) / rel).read_text(encoding="utf-8")
        new = rebuild_text(old, folder, rel)
        if new != old:
            new_texts[rel] = new
    if not check:
        for rel, new in new_texts.items():
            with atomic_write(Path(root) / rel) as tmp:
                tmp.write_text(new, encoding="utf-8")
    return list(new_texts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        if len(argv) < 4 or argv[2] != "--":
            print("usage: python -m tools.tables record OUT.json -- COMMAND [ARGS...]", file=sys.stderr)
            return 2
        try:
            print(record_command(argv[1], argv[3:]))
        except ValueError as e:  # a folder that does not exist: refused before the command runs
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    parser = argparse.ArgumentParser(prog="python -m tools.tables", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is out of date "
                        "(2, with or without --check, where a record cannot be read or tabulated)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository whose README and docs to rebuild, "
                        "from its figures/ (default: the current directory)")
    args = parser.parse_args(argv)
    try:
        changed = rebuild(args.root, check=args.check)
    except KeyError as e:  # an unknown table marker; its message without KeyError's quotes
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # a record missing, unreadable or untabulable (RecordError)
        print(f"error: {e}", file=sys.stderr)
        return 2
    for rel in changed:
        print(f"{rel}: {'out of date' if args.check else 'rebuilt'}")
    return 1 if args.check and changed else 0

