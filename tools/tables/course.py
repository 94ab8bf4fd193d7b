"""The course's tables: the lessons' times (docs/course.md), estimated from the notebooks themselves, and the
numbers a student meets in more than one place (docs/course_key.md), built from the records the notebooks and
the benchmark commands write, so that the syllabus and the teachers' key cannot drift from the lessons.

The repository's notebooks and readings are found beside ``figures/`` (``folder.parent``), as ``rebuild`` passes
the repository's figures folder.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from pathlib import Path

from . import FIGURES, RecordError, _table, _trace, read_record
from . import quant as _quant

# the reading estimate: what a student does with a lesson, in minutes
WORDS_PER_MINUTE = 100  # technical prose with formulas, read to answer questions about it
CODE_CELL_MINUTES = 2  # read the code, run it, read its output
PREDICTION_MINUTES = 3  # write a prediction down, then compare
WRITTEN_MINUTES = 5  # a written question's answer
ROUND_TO = 5  # the syllabus states times in steps of 5 minutes, rounded up

LESSONS = {"00_quickstart": "", "01_roofline": "", "01a_roofline_appendix": "optional", "01b_cpu_kernels": "optional",
           "02_kv_cache": "", "03_paged_attention": "", "03a_online_serving": "",
           "04_speculative_decoding": "", "04a_speculative_appendix": "optional",
           "05_quantization": "", "05a_kquants": "", "05b_variable_bitrate": "optional", "06_all_together": "",
           "07_past_one_machine": ""}
# a lesson longer than a class is taught in parts, each starting at the markdown heading named here
PARTS = {"03_paged_attention": ["## 4. The scheduler's timeline"], "05_quantization": ["## The fast 4-bit path"]}
PREDICTION = re.compile(r"Predict before you run|\*\*[Pp]redict:?\*\*")  # 07 asks "**Predict:**" inside its text
WRITTEN = re.compile(r"\(written\)")


def _notebook(root: Path, name: str) -> dict:
    path = root / "notebooks" / f"{name}.ipynb"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: the lesson is not there (the syllabus's times are built from it)") from None
    except ValueError as e:
        raise RecordError(f"{path}: not a notebook ({e}); restore it with git") from None


def _seconds(cell: dict) -> float:
    """How long the stored run took to execute ``cell`` (nbconvert's timestamps), 0 where it did not say."""
    e = cell.get("metadata", {}).get("execution", {})
    if "iopub.execute_input" not in e or "shell.execute_reply" not in e:
        return 0.0
    start, end = (datetime.fromisoformat(e[k].replace("Z", "+00:00")) for k in ("iopub.execute_input", "shell.execute_reply"))
    return max(0.0, (end - start).total_seconds())


def effort(cells: list[dict]) -> dict:
    """What a student reads, runs and writes in ``cells``: words of prose, code cells, the stored run's seconds,
    predictions and written questions, and the estimate in minutes (unrounded)."""
    text = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    e = {"words": sum(len(t.split()) for t in text), "code_cells": sum(c["cell_type"] == "code" for c in cells),
         "run_s": sum(_seconds(c) for c in cells if c["cell_type"] == "code"),
         "predictions": sum(len(PREDICTION.findall(t)) for t in text), "written": sum(len(WRITTEN.findall(t)) for t in text)}
    e["minutes"] = (e["words"] / WORDS_PER_MINUTE + CODE_CELL_MINUTES * e["code_cells"] + e["run_s"] / 60
                    + PREDICTION_MINUTES * e["predictions"] + WRITTEN_MINUTES * e["written"])
    return e


def rounded(minutes: float) -> int:
    return ROUND_TO * max(1, math.ceil(minutes / ROUND_TO - 1e-9))


def lesson_parts(root: Path) -> list[tuple[str, dict]]:
    """(label, effort) for every lesson, and for each part of a lesson taught in parts."""
    out = []
    for name in LESSONS:
        cells = _notebook(root, name)["cells"]
        cuts = [0]
        for heading in PARTS.get(name, []):
            at = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                       and "".join(c["source"]).startswith(heading)), None)
            if at is None:
                raise RecordError(f"notebooks/{name}.ipynb: no markdown cell starts with {heading!r}, where the "
                                  "syllabus splits it (tools/tables/course.py, PARTS)")
            cuts.append(at)
        bounds = list(zip(cuts, cuts[1:] + [len(cells)]))
        for k, (a, b) in enumerate(bounds):
            label = name if len(bounds) == 1 else f"{name}, part {k + 1}"
            out.append((label, effort(cells[a:b])))
    return out


def reading_words(root: Path) -> dict[str, int]:
    return {p.stem: len(p.read_text(encoding="utf-8").split()) for p in sorted((root / "docs" / "readings").glob("*.md"))}


def lesson_times(folder: Path = FIGURES) -> str:
    """docs/course.md's table of each lesson's estimated time, from the notebooks."""
    root = Path(folder).parent
    rows = []
    for label, e in lesson_parts(root):
        note = LESSONS.get(label.split(",")[0], "")
        # words to the hundred and no run time (it moves with every re-execution), so that an edited sentence or
        # a rerun leaves the table as it is unless the time it states changes
        rows.append([f"`{label}`" + (f" ({note})" if note else ""), f"{round(e['words'], -2):,.0f}", str(e["code_cells"]),
                     str(e["predictions"]), str(e["written"]), f"**{rounded(e['minutes'])}**"])
    lines = _table(["lesson", "words (to the 100)", "code cells", "predictions", "written questions", "time, min"],
                   ["l", "r", "r", "r", "r", "r"], rows)
    readings = reading_words(root)
    lines += ["", f"The rule: words / {WORDS_PER_MINUTE} per minute + {CODE_CELL_MINUTES} min per code cell + the stored "
              f"run's execution time (nbconvert's timestamps in the notebook) + {PREDICTION_MINUTES} min per prediction + {WRITTEN_MINUTES} min per written "
              f"question, rounded up to {ROUND_TO} min. The readings (docs/readings/, at the same "
              f"{WORDS_PER_MINUTE} words per minute): " + ", ".join(
                  f"{name.split('_')[0]} {rounded(w / WORDS_PER_MINUTE)} min" for name, w in readings.items()) + "."]
    return "\n".join(lines)


def syllabus_minutes(root: Path) -> dict[str, int]:
    """The syllabus's minutes for every lesson and part, by ``lesson_times``'s rule."""
    return {label: rounded(e["minutes"]) for label, e in lesson_parts(root)}


# ---------------------------------------------------------------------------------------------- key numbers

def _cpu(report: dict) -> str:
    """The report's CPU in a few words (its machine line up to the first comma)."""
    return report["machine"].split(",")[0]


def key_numbers(folder: Path = FIGURES) -> str:
    """docs/course_key.md's "numbers you will meet": the values a student sees in more than one place, each with
    the protocol that makes it differ from the others and where it is printed."""
    folder = Path(folder)
    tour, stack = read_record("tour.json", folder)["report"], read_record("stack.json", folder)["report"]
    kv, roof = read_record("02_kv_cache.json", folder)["report"], read_record("01_roofline.json", folder)["report"]
    spec, sweep = read_record("04_speculative.json", folder)["report"], read_record("04a_gamma_sweep.json", folder)["report"]
    serve, table = read_record("serve_bench.json", folder)["report"], _quant.read_report("05_quant_table.json", folder)
    quick, paged = read_record("00_quickstart.json", folder)["report"], read_record("03_paged_attention.json", folder)["report"]
    tour_rows = {r["technique"]: r for r in tour["rows"]}
    rows = []

    def row(value, what, protocol, where):
        rows.append([value, what, protocol, where])

    def recomputes(prompt: float, new: int) -> str:  # a naive step runs the prompt and every token generated before it
        return f"the baseline recomputes {prompt:.0f} to {prompt + new - 1:.0f} tokens a step"

    P, N = quick["prompt_tokens"], quick["new_tokens"]
    row(f"{quick['speedup']:.1f}x", "KV cache over recomputing", f"batch 1, {P}-token prompt, {N} new tokens, decode "
        f"tokens/s (prefill excluded): {recomputes(P, N)} (naive {quick['naive_tokens_per_s']:.1f}, cached "
        f"{quick['cached_tokens_per_s']:.1f} tokens/s); {_cpu(quick)}", "00")
    c = tour_rows["KV cache (contiguous)"]
    row(f"{c['speedup']:.2f}x", "KV cache over recomputing", f"batch 1, {tour['prompt_tokens']}-token prompt, "
        f"{tour['new_tokens']} new tokens, decode tokens/s: {recomputes(tour['prompt_tokens'], tour['new_tokens'])} "
        f"(the longer the answer, the more it recomputes); {_cpu(tour)}", "README (the tour)")
    gains = stack["gains"]["KV cache"]
    row(f"{gains['alone']:.2f}x", "KV cache over recomputing", f"chat requests of about {stack['mean_prompt']:.0f} "
        f"prompt tokens one at a time, {stack['new_tokens']} new tokens each, output tokens/s over the wall time "
        f"(prefill included): {recomputes(stack['mean_prompt'], stack['new_tokens'])} (without a cache: the first "
        f"{stack['naive_requests']} requests); {_cpu(stack)}", "06")
    total = kv["total_s"]
    row(f"{total['none'] / total['contiguous']:.1f}x", "KV cache over recomputing", f"{kv['new_tokens']} new tokens after a "
        f"{kv['prompt_tokens']}-token prompt, summed from fits of step time against position: "
        f"{recomputes(kv['prompt_tokens'], kv['new_tokens'])} (quadratic against flat, so the ratio grows with the "
        f"length); {_cpu(kv)}", "02")
    row(f"{kv['kv_kib_per_token']['float32']:.1f} KiB", "KV cache per token, float32", "2 x 30 layers x 3 KV heads x 64 x "
        f"4 bytes; {kv['kv_kib_per_token']['mha_float32']:.1f} KiB with 9 KV heads (no GQA)", "02, exercise 2")
    eager = next(r for r in roof["rows"] if r["kind"] == "decode" and r["batch_size"] == 1)
    comp = roof["compiled"]
    row(f"{eager['measured_over_predicted']:.2f}x", "eager batch-1 decode's time over the roofline's prediction",
        "the median of the rounds' own ratios, each forward timed right after its own bandwidth measurement "
        f"({eager['bandwidth_GB_per_s']:.1f} GB/s in the median round); {_cpu(roof)}", "01, the first table")
    row(f"{comp['eager_tokens_per_s'] / comp['bound_tokens_per_s']:.0%}", "eager batch-1 decode's share of the bound",
        f"tokens/s over the bound of the compiled-decode cell, whose ceiling was measured minutes later "
        f"({comp['read_GB_per_s']:.1f} GB/s): another minute's ceiling, so not 1 / the ratio above", "01, the compiled table")
    rewrite = next(r for r in spec["rows"] if r["workload"].startswith("rewrite"))
    row(f"{rewrite['measured_speedup']:.2f}x", "prompt lookup on the rewrite, gamma 4",
        f"one timed run of each path, up to {spec['new_tokens']} new tokens, stopping at EOS ({rewrite['new_tokens']} "
        f"tokens); {_cpu(spec)}", "04")
    g4 = next(r for r in sweep["sweep"]["rows"] if r["workload"].startswith("rewrite") and r["gamma"] == 4)
    row(f"{g4['measured_speedup']:.2f}x", "prompt lookup on the rewrite, gamma 4", f"the gamma sweep, {sweep['sweep']['repeats']} "
        f"timed repeats of each path, up to {sweep['new_tokens']} new tokens; {_cpu(sweep)}", "04a")
    s = tour_rows["speculative (n-gram)"]
    row(f"{s['speedup']:.2f}x", "prompt lookup on a rewrite", f"the tour's own prompt, {tour['new_tokens']} new tokens; "
        f"{_cpu(tour)}", "README (the tour)")
    best = max((r for r in sweep["sweep"]["rows"] if r["workload"].startswith("rewrite")), key=lambda r: r["measured_speedup"])
    row(f"{best['measured_speedup']:.2f}x", "prompt lookup on the rewrite, its best gamma",
        f"gamma {best['gamma']}: {best['passes']} target passes of {best['tokens_per_target_pass']:.0f} tokens on an "
        "answer that copies the passage; it says nothing of answers in the model's own words", "04a")
    flt = table["float"]["perplexity"]
    q = {(r["method"], r["bits"], r["group_size"]): r for r in table["rows"]}
    row(f"{100 * (q[('rtn', 4, 64)]['perplexity'] / flt - 1):+.1f}%", "RTN 4-bit group 64 perplexity over float",
        f"Hamlet, {table['float']['tokens']:,} tokens in windows of {table['float']['seqlen']}; the budget is +2%",
        "05, README")
    row(f"{stack['full_stack_over_row2']:.2f}x", "the whole stack over the KV cache alone",
        f"{stack['num_requests']} chat requests at once, {stack['new_tokens']} new tokens each; {_cpu(stack)}", "06")
    modes = serve["modes"]
    row(f"{modes['engine']['output_tokens_per_s'] / modes['sequential']['output_tokens_per_s']:.2f}x",
        "the paged engine over one request at a time", f"{serve['num_requests']} requests at once, "
        f"{_trace(serve['trace'])}-like lengths x {serve['scale']}; {_cpu(serve)}", "README (`serve-bench`)")
    tp = paged["throughput"]
    top = max(tp, key=lambda k: int(k))
    row(f"{tp[top] / tp['1']:.1f}x", "the paged engine over one request at a time", f"16 requests of 32 + 32 tokens, at "
        f"most {top} running against at most 1 ({tp['1']:.1f} and {tp[top]:.1f} output tokens/s); {_cpu(paged)}",
        "03, section 6")
    small = paged["serve_bench"]
    sm = small["modes"]
    row(f"{sm['engine']['output_tokens_per_s'] / sm['sequential']['output_tokens_per_s']:.1f}x",
        "the paged engine over one request at a time", f"{small['num_requests']} requests at once, ShareGPT-like lengths "
        f"x {small['scale']:g} (about {small['mean_prompt']:.0f} + {small['mean_output']:.0f} tokens each), so at most "
        f"{small['num_requests']} rows share a step's weight read; {_cpu(paged)}", "03, section 7")
    engine = stack["gains"]["paged engine"]
    row(f"{engine['alone']:.2f}x", "the paged engine over one request at a time", f"{stack['num_requests']} chat "
        f"requests at once, {stack['new_tokens']} new tokens each, against row 2 (the KV cache one at a time); "
        f"{_cpu(stack)}", "06")
    lines = _table(["value", "what", "protocol", "lesson or page"], ["r", "l", "l", "l"], rows)
    lines += ["", "Built by `python -m tools.tables` from `figures/`: " + ", ".join(READS["key_numbers"]) + "."]
    return "\n".join(lines)


TABLES = {"lesson_times": lesson_times, "key_numbers": key_numbers}
FILES = {"docs/course.md": ["lesson_times"], "docs/course_key.md": ["key_numbers"]}
READS = {"lesson_times": [], "key_numbers": ["00_quickstart.json", "tour.json", "stack.json", "02_kv_cache.json",
                                             "01_roofline.json", "03_paged_attention.json", "04_speculative.json",
                                             "04a_gamma_sweep.json", "serve_bench.json", "05_quant_table.json"]}
