"""The course's documents agree with the lessons: the syllabus's times are the reading estimate of the notebooks
as they are, the teachers' key quotes the numbers the stored runs printed, the readings are short and assigned,
and the course counts the exercises as ``python -m minillm exercises list`` prints them."""

import json
import re
from pathlib import Path

import pytest

from tools.tables import course

ROOT = Path(__file__).resolve().parents[1]
COURSE = (ROOT / "docs" / "course.md").read_text(encoding="utf-8")
KEY = (ROOT / "docs" / "course_key.md").read_text(encoding="utf-8")
READINGS = sorted((ROOT / "docs" / "readings").glob("*.md"))
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")


def _md(text: str) -> dict:
    return {"cell_type": "markdown", "source": [text], "metadata": {}}


def _code(seconds: float) -> dict:
    start = "2026-01-01T00:00:00.000000Z"
    end = f"2026-01-01T00:{int(seconds) // 60:02d}:{int(seconds) % 60:02d}.000000Z"
    return {"cell_type": "code", "source": ["x = 1"], "outputs": [],
            "metadata": {"execution": {"iopub.execute_input": start, "shell.execute_reply": end}}}


def test_the_estimate_counts_words_cells_run_time_predictions_and_questions():
    cells = [_md("word " * 300), _md("**Predict before you run.** guess"), _md("1. *(written)* why?"),
             _code(90), _code(30)]
    e = course.effort(cells)
    assert (e["words"], e["code_cells"], e["run_s"], e["predictions"], e["written"]) == (300 + 5 + 3, 2, 120, 1, 1)
    # 308 / 100 + 2 x 2 + 2 + 3 + 5
    assert e["minutes"] == pytest.approx(3.08 + 4 + 2 + 3 + 5)
    assert course.rounded(e["minutes"]) == 20 and course.rounded(20.0) == 20 and course.rounded(0.2) == 5


def _syllabus_times() -> dict[str, int]:
    """Each lesson (or part) the class table assigns, with the minutes it states."""
    table = COURSE.split("## The classes", 1)[1].split("\n## ", 1)[0]
    found = {}
    for name, part, minutes in re.findall(r"(0\d[a-z]?_[a-z_]+)(?:, part (\d))?[^|;()]*\((\d+) min\)", table):
        found[f"{name}, part {part}" if part else name] = int(minutes)
    return found


def test_every_lesson_has_the_time_its_estimate_gives():
    stated, estimated = _syllabus_times(), course.syllabus_minutes(ROOT)
    assert set(stated) == set(estimated), f"the class table assigns {sorted(stated)}; the lessons are {sorted(estimated)}"
    wrong = {k: (stated[k], estimated[k]) for k in stated if stated[k] != estimated[k]}
    assert not wrong, ("docs/course.md's class table states other times than the reading estimate (stated, estimated): "
                       f"{wrong}; copy the estimates of its lesson_times table")


def test_a_class_fits_its_session():
    for label, minutes in course.syllabus_minutes(ROOT).items():
        optional = course.LESSONS[label.split(",")[0]] == "optional"
        assert optional or minutes <= 90, f"{label}: {minutes} min does not fit a 90-minute class; split it or mark it optional"


def test_the_course_counts_the_exercises_as_the_list_does():
    from minillm.exercises import EXERCISES

    m = re.search(r"exercises list\s+# the (\d+) functions", COURSE)
    assert m and int(m[1]) == len(EXERCISES), f"docs/course.md counts {m and m[1]} functions; `exercises list` prints {len(EXERCISES)}"
    m = re.search(r"`exercises list` prints (\d+) functions", COURSE)
    assert m and int(m[1]) == len(EXERCISES)


@pytest.mark.parametrize("path", READINGS, ids=[p.stem for p in READINGS])
def test_a_reading_is_short_has_one_figure_and_no_history(path):
    text = path.read_text(encoding="utf-8")
    assert len(text.split()) <= 1500, f"{path.name}: {len(text.split())} words (at most 1,500)"
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(figures) == 1 and (path.parent / figures[0]).is_file(), f"{path.name}: one figure from figures/, not {figures}"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\bUTC\b|\bgoal\b|\bissue \d|not met|load average", text, re.I), \
        f"{path.name}: a benchmark history or a goal"


def test_every_class_reads_a_reading_and_no_benchmark_doc():
    table = COURSE.split("## The classes", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in table.splitlines() if re.match(r"\| \d+ \|", r)]
    assert len(rows) == len(READINGS)
    for row, reading in zip(rows, READINGS):
        read_first = row.split("|")[4]
        assert f"readings/{reading.name}" in read_first, f"class {row.split('|')[1].strip()} does not assign {reading.name}"
        assert not re.search(r"docs/(decode|paged|quantization|speculative|stack|roofline|kv_cache)\.md|README", read_first), \
            f"class {row.split('|')[1].strip()} assigns a benchmark doc: {read_first.strip()}"


def _outputs(notebook: Path) -> str:
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    return "\n".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/markdown", ""))
                     + "".join(o.get("data", {}).get("text/plain", "")) for c in nb["cells"] for o in c.get("outputs", []))


def stored_claims(key: str) -> list[tuple[str, str, str]]:
    """(lesson, number, clause) for every number the key quotes as stored: a clause from "stored" to the closing
    parenthesis, in the section of the lesson that printed it."""
    claims = []
    for section in re.split(r"^## ", key, flags=re.M)[1:]:
        lesson = section.split(" ", 1)[0]
        if not re.fullmatch(r"0\d[a-z]?", lesson):
            continue
        for m in re.finditer(r"stored[^)]*", section):
            claims += [(lesson, n, m.group(0)) for n in NUMBER.findall(m.group(0))]
    return claims


def test_stored_claims_are_found():
    key = "## 02 · x\n\n**Predict 2.** Slower (stored: float32 36.1 ms, int8 41.8 ms), about 1.2x.\n## Exercises\n(stored: 9)"
    assert [(lesson, n) for lesson, n, _ in stored_claims(key)] == [("02", "36.1"), ("02", "41.8")]  # not float32's 32


def test_the_key_quotes_what_the_stored_runs_printed():
    notebooks = {p.stem.split("_")[0]: p for p in (ROOT / "notebooks").glob("0*.ipynb")}
    outputs = {k: _outputs(p).replace(",", "") for k, p in notebooks.items()}
    missing = [(lesson, n, clause[:60]) for lesson, n, clause in stored_claims(KEY)
               if n.replace(",", "") not in outputs[lesson]]
    assert not missing, ("docs/course_key.md quotes as stored numbers that the lesson's stored outputs do not print "
                         f"(re-read the notebook and correct the key): {missing[:5]}")


# the numbers the key quotes from lessons 00 and 03, each found by its words in the lesson's section and compared
# with the lesson's record (figures/00_quickstart.json, figures/03_paged_attention.json) to the digits quoted
QUOTED = {
    "00": ("00_quickstart.json", [
        (r"stored: naive ([\d.]+), cached ([\d.]+) tokens/s, ([\d.]+)x",
         lambda r: [r["naive_tokens_per_s"], r["cached_tokens_per_s"], r["speedup"]])]),
    "03": ("03_paged_attention.json", [
        (r"maximum \(2,048 tokens\)[^(]*\(stored: ([\d.]+)%", lambda r: [100 * r["lab_sharegpt"]["max"]]),
        (r"With 16-token blocks: about \d+% \(stored: ([\d.]+)%\)", lambda r: [100 * r["lab_sharegpt"]["paged_16"]]),
        (r"\(stored: (\d+) steps, (\d+) preemptions\)", lambda r: [r["timeline_steps"], r["timeline_preemptions"]]),
        (r"\(stored: ([\d.]+) and ([\d.]+) output tokens/s\), about ([\d.]+)x",
         lambda r: [r["throughput"]["1"], r["throughput"]["16"], r["throughput"]["16"] / r["throughput"]["1"]]),
        (r"Block size 1 wastes nothing \(stored: ([\d.]+)%\)", lambda r: [100 * r["lab_sharegpt"]["paged_1"]])]),
}


def _same(quoted: str, value: float) -> bool:
    """``value`` rounds to ``quoted`` at the digits quoted."""
    digits = len(quoted.split(".")[1]) if "." in quoted else 0
    return abs(float(quoted) - value) <= 0.5 * 10 ** -digits + 1e-9


def test_same_rounds_at_the_digits_quoted():
    assert _same("2.9", 2.94) and not _same("2.9", 2.96) and _same("98", 98) and not _same("98", 99)


@pytest.mark.parametrize("lesson", sorted(QUOTED))
def test_the_key_quotes_the_records_of_lessons_without_a_benchmark_doc(lesson):
    name, quotes = QUOTED[lesson]
    report = json.loads((ROOT / "figures" / name).read_text(encoding="utf-8"))["report"]
    section = " ".join(next(s for s in re.split(r"^## ", KEY, flags=re.M) if s.startswith(f"{lesson} ")).split())
    for pattern, fields in quotes:
        m = re.search(pattern, section)
        assert m, f"docs/course_key.md's {lesson} section no longer quotes {pattern!r}; keep the words or update QUOTED"
        wrong = [(q, round(v, 3)) for q, v in zip(m.groups(), fields(report)) if not _same(q, v)]
        assert not wrong, (f"docs/course_key.md's {lesson} section quotes {m.group(0)!r}, but figures/{name} holds "
                           f"(quoted, recorded) {wrong}: copy the record's numbers into the key")


def test_every_question_in_the_key_has_its_points():
    for line in KEY.splitlines():
        if re.match(r"\*\*(Predict|Written) \d", line):
            assert re.search(r"\*\((1|3) points?\)\*", line), f"docs/course_key.md: no points on {line[:60]}"


def test_the_numbers_a_student_meets_carry_their_protocols():
    text = course.key_numbers(ROOT / "figures")
    kv = [r for r in text.splitlines() if "| KV cache over recomputing |" in r]
    assert len(kv) == 4 and len({r.split("|")[1] for r in kv}) == 4  # four protocols, four values
    assert "| 00 |" in text and "| 02 |" in text and "| 06 |" in text
    # each of the four names what its baseline recomputes a step: the protocol difference a student asks about
    assert all(re.search(r"recomputes \d+ to \d+ tokens a step", r) for r in kv)
    engine = [r for r in text.splitlines() if "| the paged engine over one request at a time |" in r]
    assert len(engine) == 4 and {r.rsplit("|", 2)[1].strip() for r in engine} >= {"03, section 6", "03, section 7", "06"}
    quick = json.loads((ROOT / "figures" / "00_quickstart.json").read_text(encoding="utf-8"))["report"]
    assert f"| {quick['speedup']:.1f}x | KV cache over recomputing | batch 1, {quick['prompt_tokens']}-token prompt" in text
    assert "<!-- table:key_numbers -->\n" + text + "\n<!-- /table -->" in KEY, "run `python -m tools.tables`"


def test_the_key_answers_every_question_of_every_lesson():
    sections = {s.split(" ", 1)[0]: s for s in re.split(r"^## ", KEY, flags=re.M)[1:]}
    for name in course.LESSONS:
        nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))
        text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        asked = (len(course.PREDICTION.findall(text)), len(course.WRITTEN.findall(text)))
        section = sections.get(name.split("_")[0], "")
        answered = (len(re.findall(r"^\*\*Predict \d", section, re.M)), len(re.findall(r"^\*\*Written \d", section, re.M)))
        assert asked == answered, (f"notebooks/{name}.ipynb asks {asked[0]} predictions and {asked[1]} written questions; "
                                   f"docs/course_key.md answers {answered[0]} and {answered[1]}")
