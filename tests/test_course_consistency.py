"""The lessons never contradict what the repository shows beside them.

* every figure a lesson writes into figures/ is the image that lesson stores in its own output (a run that
  rewrote the figure without saving the notebook, or the other way round, leaves two versions of one result);
* docs/speculative.md's paragraph on the draft model and the replay is the one built from notebook 04a's
  record, and the README's sentence on the int4 rows' quality is the one built from notebook 05's table;
* the records of notebooks 00 and 03, which the teachers' key's numbers are checked against, are the runs the
  notebooks store;
* the lessons' outputs show no acceptance goals and no notes about the machine's load (those belong in docs/).
"""

import json
import re
from pathlib import Path

import pytest

from minillm.lab import lesson_notes, lessons

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ["00_quickstart", "01_roofline", "01a_roofline_appendix", "02_kv_cache", "03_paged_attention",
           "03a_online_serving", "04_speculative_decoding", "04a_speculative_appendix", "05_quantization", "05a_kquants",
           "05b_variable_bitrate", "06_all_together"]
FIGURE = re.compile(r"\b(\d\d[a-z]?_\w+\.png)\b")


def _figure_cells():
    """(notebook, cell index, figure name, stored PNG) for every code cell whose source names as many figure
    files as it stores images, paired in the order they appear."""
    found = []
    for name in LESSONS:
        nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code":
                continue
            names = list(dict.fromkeys(FIGURE.findall("".join(cell["source"]))))
            images = [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
            if names and len(names) == len(images):
                found += [(name, i, fig, img) for fig, img in zip(names, images)]
    return found


FIGURE_CELLS = _figure_cells()


@pytest.mark.parametrize("notebook, cell, figure, image", FIGURE_CELLS, ids=[f"{n}-{f}" for n, _, f, _ in FIGURE_CELLS])
def test_committed_figure_is_what_its_notebook_stores(notebook, cell, figure, image):
    import base64

    stored = base64.b64decode("".join(image))
    on_disk = (ROOT / "figures" / figure).read_bytes()
    assert on_disk == stored, (
        f"figures/{figure} differs from the image notebooks/{notebook}.ipynb stores in cell {cell}: re-execute the "
        "notebook in place (jupyter nbconvert --execute --inplace) and commit both, or restore the figure with git")


def test_every_figure_a_lesson_writes_is_compared():
    compared = {fig for _, _, fig, _ in FIGURE_CELLS}
    for must in ("05_fast_4bit.png", "02_step_time_vs_position.png", "03_scheduler_timeline.png", "05b_bitrate_bits.png"):
        assert must in compared, f"{must}: no lesson cell stores it beside the file it writes"


def _outputs_text(notebook: str) -> str:
    nb = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text(encoding="utf-8"))
    return "\n".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/markdown", ""))
                     for c in nb["cells"] for o in c.get("outputs", []))


def draft_numbers() -> dict:
    """04a's draft-model and replay numbers, from its record (figures/04a_gamma_sweep.json)."""
    record = json.loads((ROOT / "figures" / "04a_gamma_sweep.json").read_text(encoding="utf-8"))["report"]
    assert "draft" in record and "replay" in record, "figures/04a_gamma_sweep.json: no draft/replay numbers; re-execute 04a"
    return record


def shown_draft_numbers() -> dict:
    """The same numbers as notebook 04a's stored outputs print them."""
    text = _outputs_text("04a_speculative_appendix")

    def grab(pattern):
        m = re.search(pattern, text, re.S)
        assert m, f"notebook 04a's outputs hold no match for {pattern!r}: re-execute it"
        return [float(g) for g in m.groups()]

    (c,) = grab(r"draft cost c = ([\d.]+)")
    steps, first, last, floor = grab(r"distillation: (\d+) steps .*? ([\d.]+) -> ([\d.]+) nats .*? entropy ([\d.]+) nats")
    a_u, s_u = grab(r"untrained self-draft\s+gamma 2: alpha ([\d.]+), .*? measured ([\d.]+)x")
    a_d, s_d = grab(r"distilled\s+gamma 2: alpha ([\d.]+), .*? measured ([\d.]+)x")
    need, need_gamma, gamma_max = grab(r"alpha of at least \*\*([\d.]+)\*\*, lowest at gamma (\d+) of\s+1\.\.(\d+)")
    cost2, perfect2 = grab(r"2c \+ verify\(3\) / verify\(1\) = ([\d.]+) decode steps\s+for 3 tokens: at most \*\*([\d.]+)x")
    (summ,) = grab(r"summarise\s+\d+\s+[\d.]+\s+([\d.]+) tokens per pass")
    (edit,) = grab(r"edit code\s+\d+\s+[\d.]+\s+([\d.]+) tokens per pass")
    rewrite, rewrite_gamma = grab(r"rewrite\s+\d+\s+[\d.]+\s+([\d.]+) tokens per pass \(smallest gamma (\d+)")
    return {"draft": {"c": c, "steps": int(steps), "loss_first": first, "loss_last": last, "floor": floor,
                      "alpha_distilled": a_d, "alpha_untrained": a_u, "speedup_distilled": s_d, "speedup_untrained": s_u,
                      "alpha_for_2x": need, "alpha_for_2x_gamma": int(need_gamma), "gamma_max": int(gamma_max),
                      "perfect_gamma2": perfect2, "perfect_gamma2_cost": cost2},
            "replay": {"gamma_max": 32, "summarise": summ, "edit_code": edit, "rewrite": rewrite,
                       "rewrite_gamma": int(rewrite_gamma)}}


def test_04a_record_is_what_the_notebook_shows():
    """The record the docs quote holds the numbers 04a's stored outputs print (to the digits printed)."""
    record, shown = draft_numbers(), shown_draft_numbers()
    for part in ("draft", "replay"):
        for key, value in shown[part].items():
            digits = len(repr(value).split(".")[1]) if isinstance(value, float) else 0
            assert abs(record[part][key] - value) <= 0.5 * 10 ** -digits + 1e-9, (
                f"figures/04a_gamma_sweep.json {part}.{key} = {record[part][key]} but notebook 04a shows {value}: "
                "the record and the notebook come from different runs; re-execute 04a")


@pytest.mark.parametrize("notebook, name, summary", [
    ("00_quickstart", "00_quickstart.json", lesson_notes.quickstart_summary),
    ("03_paged_attention", "03_paged_attention.json", lesson_notes.paged_summary)])
def test_a_lessons_record_is_what_its_closing_note_shows(notebook, name, summary):
    """docs/course_key.md's numbers from 00 and 03 are checked against these records: the records must be the
    runs the notebooks store, so the closing note built from the record is the one the notebook shows."""
    report = json.loads((ROOT / "figures" / name).read_text(encoding="utf-8"))["report"]
    assert summary(report).strip() in _outputs_text(notebook), (
        f"figures/{name} is not the run notebooks/{notebook}.ipynb stores (its closing note differs): re-execute the "
        "notebook in place and commit both")


def test_speculative_docs_quote_04a():
    doc = (ROOT / "docs" / "speculative.md").read_text(encoding="utf-8")
    start, end = "<!-- from notebook 04a -->", "<!-- /from -->"
    assert start in doc and end in doc, "docs/speculative.md: the draft model's list lost its markers"
    quoted = doc.split(start, 1)[1].split(end, 1)[0].strip()
    assert quoted == lessons.draft_summary(draft_numbers()), (
        "docs/speculative.md's draft-model list is not notebook 04a's: paste lessons.draft_summary(...) of its "
        "record between the markers")


def test_readme_int4_quality_is_notebook_05_table():
    table = json.loads((ROOT / "figures" / "05_quant_table.json").read_text(encoding="utf-8"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert lessons.int4_quality(table) in readme, "README.md: the int4 rows' quality sentence is not 05's table's"


def test_quality_budget_is_one_number():
    assert lessons.QUALITY_BUDGET == 0.02
    assert lessons.within_budget(1.019, 1.0) and not lessons.within_budget(1.021, 1.0)
    assert lessons.quality(31.68, 29.0) == "+9.2% over float (outside the 2% budget)"


# what a student should never read in a lesson: acceptance goals, the machine's load, the project's own test runs
# and history, issue numbers (the test runner's marker lines, "# NBVAL_IGNORE_OUTPUT", are not text to read)
INTERNAL = re.compile(r"(?i:\bgoal\b|NOT met|other agents|load average|\bload \d|nbval|earlier version|"
                      r"what this notebook fixed|shared 2-core|\bissues? #?\d+|\(#\d+\))|\bCI\b")
NBVAL_MARKER = re.compile(r"^[ \t]*# NBVAL_\w+[ \t]*$", re.M)
ALL_NOTEBOOKS = sorted(str(p.relative_to(ROOT / "notebooks")) for p in (ROOT / "notebooks").rglob("*.ipynb")
                       if ".ipynb_checkpoints" not in p.parts)


def internal_text(nb: dict) -> list[str]:
    """'cell N (source|output): ...' for each place a notebook's sources or outputs show project-internal text."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        texts = [("source", NBVAL_MARKER.sub("", "".join(cell["source"])))]
        texts += [("output", "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/markdown", "")))
                  for out in cell.get("outputs", [])]
        found += [f"cell {i} ({kind}): ...{text[max(0, m.start() - 40):m.end() + 40]}..."
                  for kind, text in texts for m in INTERNAL.finditer(text)]
    return found


@pytest.mark.parametrize("notebook", ALL_NOTEBOOKS)
def test_no_project_internal_text_in_notebooks(notebook):
    nb = json.loads((ROOT / "notebooks" / notebook).read_text(encoding="utf-8"))
    found = internal_text(nb)
    assert not found, (f"notebooks/{notebook}: project-internal text (an acceptance goal, the machine's load, the test "
                       "runner, the project's history or an issue number; say those in docs/records or the commit): "
                       + "; ".join(found))


def test_internal_text_is_found_in_sources_and_outputs():
    def nb(source, output=""):
        return {"cells": [{"cell_type": "code", "source": [source], "outputs": [{"text": output}]}]}

    for bad in ("load 1.38 1.37", "on this project's CI machine", "nbval does not compare them", "An earlier version",
                "**What this notebook fixed.**", "see issue 53", "goal 1.5x: NOT met", "fixed in (#35)"):
        assert internal_text(nb(bad)) and internal_text(nb("", bad)), bad
    assert not internal_text(nb("# NBVAL_IGNORE_OUTPUT\nx = 1"))  # the runner's marker line, in a source
    for fine in ("the model loads 30 layers", "`.ci/gpu-check`", "a decision"):
        assert not internal_text(nb(fine, fine)), fine


def test_report_share_counts_report_building():
    share = lessons.report_share(ROOT / "notebooks" / "04_speculative_decoding.ipynb")
    assert 0 < share["report_lines"] < share["code_lines"]


def test_without_goals_drops_only_goal_lines():
    assert lessons.without_goals("a\ngoal (x): NOT met\n b") == "a\n b"
