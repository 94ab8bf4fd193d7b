"""The gradebook ``exercises check --csv`` writes: weights by stars unless the teacher's file says otherwise, each
student's total, and the lessons' written answers beside the key's points.

* By default an exercise weighs its stars (docs/course.md's table), whatever its number of cases; the capstone
  notebook's rows share the capstone's weight.
* A weights file (TOML, JSON or CSV) changes the scores and totals as computed by hand; a name that is no exercise,
  or a weight that is no number of 0 or more, is refused with a message that names it.
* Totals: the weighted exercises over the class's exercises, the points awarded to written answers and
  predictions over the key's, and the 60/30/10 total; ``exercises totals`` recomputes them once the teacher fills
  ``points_awarded``, keeping the weights the gradebook was written with.
* The end to end (slow): two students' solution notebooks, one with a wrong function, and a lesson, graded by one
  command into the three files.
"""

import csv
import json
import re
import shutil
from pathlib import Path

import pytest

from minillm.exercises import EXERCISES, STARS, handout, written
from minillm.exercises.gradebook import (CAPSTONE, companions, default_weights, load_weights, totals, weigh,
                                         weights_in, written_rows)
from minillm.exercises.notebooks import SOLUTIONS_DIR
from test_exercises import cli

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_every_exercise_has_the_stars_the_course_gives_it():
    assert set(STARS) == set(EXERCISES) | {CAPSTONE}
    table = (ROOT / "docs" / "course.md").read_text(encoding="utf-8").split("## The exercises, easiest first")[1]
    stars = {}
    for line in table.split("\n## ")[0].splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 5 and re.fullmatch(r"\*+", cells[4]):
            names = re.findall(r"`(\w+)`", cells[3]) or ([CAPSTONE] if "capstone" in cells[2] else [])
            stars.update({name: len(cells[4]) for name in names})
    assert stars == STARS


def test_default_weights_are_stars_not_case_counts():
    # blocks_needed (one star) and gptq_quantize_columns (four) with 15 and 11 cases: the weights are 1 and 4
    rows = [("ann", "05_block_table.ipynb", "blocks_needed", "15", "15", "passed"),
            ("ann", "08_gptq_column.ipynb", "gptq_quantize_columns", "11", "11", "passed"),
            ("ann", "01_arithmetic_intensity.ipynb", "forward_flops_bytes", "3", "12", "failed"),
            ("ann", "zz.ipynb", "", 0, 0, "not a notebook")]
    assert [r[6:] for r in weigh(rows, default_weights())] == [("1", "1"), ("4", "4"), ("3", "0.75"), ("0", "0")]
    assert totals(rows, [], default_weights())[0][1:3] == ("5.75", "8")


def test_the_capstone_notebooks_rows_share_its_weight():
    rows = [("ann", "15_capstone.ipynb", name, "3" if name == "cache_update" else "0", "3", "failed")
            for name in ("cache_update", "rope_at_offset", "blocks_needed")] + [
           ("ann", "03_kv_cache_update.ipynb", "cache_update", "9", "9", "passed")]
    weighted = weigh(rows, default_weights())
    assert [r[6] for r in weighted[:3]] == ["1.3333"] * 3 and weighted[0][7] == "1.3333"  # 4 stars in 3 shares
    assert weighted[3][6:] == ("1", "1")  # exercise 03's own row keeps its own weight
    assert totals(rows, [], default_weights())[0][1:3] == ("2.3333", "5")
    assert weights_in(weighted)[CAPSTONE] == 4  # read back from the gradebook, as exercises totals does


@pytest.mark.parametrize("name, text", [
    ("w.toml", "blocks_needed = 5\nkv_cache_size = 0.5\n"),
    ("w.json", '{"blocks_needed": 5, "kv_cache_size": 0.5}'),
    ("w.csv", "exercise,weight\nblocks_needed,5\nkv_cache_size,0.5\n")])
def test_a_weights_file_changes_the_totals_as_computed_by_hand(tmp_path, name, text):
    (tmp_path / name).write_text(text, encoding="utf-8")
    weights = load_weights(tmp_path / name)
    assert weights["blocks_needed"] == 5 and weights["kv_cache_size"] == 0.5 and weights["slot_mapping"] == 1
    rows = [("ann", "05_block_table.ipynb", "blocks_needed", "6", "15", "failed"),
            ("ann", "05_block_table.ipynb", "slot_mapping", "10", "10", "passed"),
            ("bo", "02_kv_cache_size.ipynb", "kv_cache_size", "13", "13", "passed")]
    by_student = {r[0]: r for r in totals(rows, [], weights)}
    # ann: 5 x 6/15 + 1 = 3 of 5 + 1 + 0.5; bo: 0.5 of the same 6.5; the total is the exercises' share alone
    assert by_student["ann"][1:3] == ("3", "6.5") and by_student["bo"][1:3] == ("0.5", "6.5")
    assert by_student["ann"][8] == f"{100 * 3 / 6.5:.1f}" and by_student["bo"][8] == f"{100 * 0.5 / 6.5:.1f}"


@pytest.mark.parametrize("name, text, says", [
    ("w.toml", "blocks_neded = 2\n", "'blocks_neded' is not an exercise; name one of kv_cache_size"),
    ("w.json", '{"kv_cache_size": -1}', "kv_cache_size = -1: a weight is a number, 0 or more"),
    ("w.csv", "kv_cache_size,heavy\n", "kv_cache_size = 'heavy': a weight is a number, 0 or more"),
    ("w.json", '{"kv_cache_size": true}', "kv_cache_size = True: a weight is a number"),
    ("w.toml", "kv_cache_size = \n", "--weights"),
    ("w.yaml", "kv_cache_size: 1\n", "name a .toml, .json or .csv file"),
    ("w.csv", "exercise,weight\nkv_cache_size,1,2\n", "line 2 has 3 cells; write exercise,weight")])
def test_a_weights_file_that_names_no_exercise_or_no_weight_is_refused(tmp_path, name, text, says):
    (tmp_path / name).write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(says)):
        load_weights(tmp_path / name)


def test_check_refuses_a_bad_weights_file_before_grading(tmp_path):
    (tmp_path / "w.toml").write_text("blocks_neded = 2\n", encoding="utf-8")
    code, text = cli("check", str(tmp_path / "none.ipynb"), "--csv", str(tmp_path / "g.csv"), "--weights",
                     str(tmp_path / "w.toml"))
    assert code == 2 and "'blocks_neded' is not an exercise" in text and "==" not in text
    code, text = cli("check", str(tmp_path / "none.ipynb"), "--weights", str(tmp_path / "w.toml"))
    assert code == 2 and "add --csv FILE" in text
    code, text = cli("check", str(tmp_path / "none.ipynb"), "--csv", str(tmp_path / "g.csv"), "--split", "60,40")
    assert code == 2 and "--split 60,40: give three percents" in text


def test_the_key_gives_every_lessons_question_its_points():
    key = written.key_entries()
    for path in handout.lesson_paths():
        for q in written.questions(json.loads(path.read_text(encoding="utf-8")), path.name):
            assert q.id in key, f"docs/course_key.md answers no {q.id}"
            assert key[q.id].points == (1 if q.kind == "prediction" else 3) and len(key[q.id].answer) > 20
    assert key["02-p1"].answer.startswith("2 (K and V) x 30 layers x 3 KV heads x 64 x 4 bytes = 46,080 bytes")


def _lesson(folder: Path, answers: dict[str, str], lesson: str = "02_kv_cache.ipynb") -> Path:
    nb = handout.student_lesson(json.loads((ROOT / "notebooks" / lesson).read_text(encoding="utf-8")), lesson)
    for c in nb["cells"]:
        if written.is_answer(c) and c["metadata"]["question"] in answers:
            c["source"] = answers[c["metadata"]["question"]]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / lesson).write_text(json.dumps(nb), encoding="utf-8")
    return folder / lesson


def test_written_rows_carry_the_answer_the_keys_points_and_a_column_to_award(tmp_path):
    path = _lesson(tmp_path / "ann", {"02-p1": "= 45 KiB", "02-w3": "about 260k tokens"})
    rows = {r[2]: r for r in written_rows([(path, "ann"), (tmp_path / "05_block_table.ipynb", "ann")])[0]}
    assert rows["02-p1"][4:] == ("answered", rows["02-p1"][5], "= 45 KiB", "1", "", written.key_entries()[
        "02-p1"].answer) and rows["02-p1"][5].startswith("**Predict before you run.** How many KiB")
    assert rows["02-w3"][6:9] == ("about 260k tokens", "3", "") and rows["02-w1"][4] == "empty"
    assert rows["02-w1"][8] == "0"  # nothing written earns 0 without the teacher
    graded = [r[:8] + (("1",) if r[2] == "02-p1" else ("2.5",) if r[2] == "02-w3" else (r[8],)) + r[9:]
              for r in rows.values()]
    table = totals([], graded, default_weights())
    # written 2.5 of 3 x 3 questions, predictions 1 of 3 x 1: (30 x 2.5/9 + 10 x 1/3) / 40, no exercise in the class
    assert table[0][3:] == ("2.5", "9", "1", "3", 0, f"{100 * (30 * 2.5 / 9 + 10 / 3) / 40:.1f}")
    with pytest.raises(ValueError, match=r"ann, 02-w3: points_awarded '4': give a number from 0 to 3"):
        totals([], [r[:8] + ("4",) + r[9:] if r[2] == "02-w3" else r for r in graded], default_weights())


@pytest.mark.slow
def test_one_command_grades_two_students_into_totals_and_written_answers(tmp_path):
    subs = tmp_path / "submissions"
    for student in ("alice", "bob"):
        (subs / student).mkdir(parents=True)
        shutil.copy(SOLUTIONS_DIR / "02_kv_cache_size.ipynb", subs / student)
    shutil.copy(SOLUTIONS_DIR / "05_block_table.ipynb", subs / "alice")
    nb = json.loads((SOLUTIONS_DIR / "05_block_table.ipynb").read_text(encoding="utf-8"))
    for cell in nb["cells"]:  # bob forgets the partly filled last block
        source = "".join(cell["source"])
        cell["source"] = source.replace("return (num_tokens + block_size - 1) // block_size",
                                        "return num_tokens // block_size")
    (subs / "bob" / "05_block_table.ipynb").write_text(json.dumps(nb), encoding="utf-8")
    _lesson(subs / "alice", {"02-p1": "45 KiB", "02-w3": "=about 260k tokens"})
    (tmp_path / "w.toml").write_text("blocks_needed = 5\nkv_cache_size = 0.5\n", encoding="utf-8")
    grades = tmp_path / "grades.csv"
    code, text = cli("check", str(subs), "--grading", "--seed", "7", "--csv", str(grades), "--weights",
                     str(tmp_path / "w.toml"), "--timeout", "120")
    assert code == 1, text  # bob's blocks_needed fails
    assert "02_kv_cache.ipynb: a lesson: its predictions and written answers go to" in text
    totals_path, written_path = companions(grades)
    assert (totals_path.name, written_path.name) == ("grades_totals.csv", "grades_written.csv")
    rows = {(r["student"], r["exercise"]): r for r in _rows(grades)}
    assert set(rows) == {(s, e) for s in ("alice", "bob") for e in ("kv_cache_size", "blocks_needed",
                                                                   "slot_mapping", "needs_new_block")}
    bob = rows["bob", "blocks_needed"]
    assert bob["status"] == "failed" and 0 < float(bob["points"]) < float(bob["max_points"])
    assert (bob["weight"], rows["alice", "kv_cache_size"]["weight"]) == ("5", "0.5")
    by_hand = {s: sum(float(r["points"]) / float(r["max_points"]) * {"blocks_needed": 5, "kv_cache_size": 0.5}.get(
        e, 1) for (t, e), r in rows.items() if t == s) for s in ("alice", "bob")}
    assert by_hand["alice"] == 7.5 and by_hand["bob"] < 7.5
    table = {r["student"]: r for r in _rows(totals_path)}
    for s in ("alice", "bob"):
        assert float(table[s]["exercises"]) == pytest.approx(by_hand[s], abs=1e-4)
        assert table[s]["exercises_max"] == "7.5" and (table[s]["written_max"], table[s]["predictions_max"]) == \
            ("9", "3")
    assert table["alice"]["ungraded"] == "2" and table["alice"]["total_percent"] == "60.0"
    answers = {r["question"]: r for r in _rows(written_path)}
    assert set(answers) == {"02-p1", "02-p2", "02-p3", "02-w1", "02-w2", "02-w3"}
    assert answers["02-w3"]["answer"] == "'=about 260k tokens"  # a spreadsheet shows it as text, not a formula
    assert (answers["02-p1"]["answer"], answers["02-p1"]["points"], answers["02-p1"]["student"]) == \
        ("45 KiB", "1", "alice")
    # the teacher awards the two answers, and the totals follow without grading again, with the same weights
    awarded = _rows(written_path)
    for r in awarded:
        r["points_awarded"] = {"02-p1": "1", "02-w3": "2"}.get(r["question"], r["points_awarded"])
    with open(written_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(awarded[0]))
        writer.writeheader()
        writer.writerows(awarded)
    code, text = cli("totals", str(grades))
    assert code == 0, text
    table = {r["student"]: r for r in _rows(totals_path)}
    assert (table["alice"]["written"], table["alice"]["predictions"], table["alice"]["ungraded"]) == ("2", "1", "0")
    assert table["alice"]["total_percent"] == f"{60 + 30 * 2 / 9 + 10 / 3:.1f}"
    assert table["bob"]["total_percent"] == f"{60 * by_hand['bob'] / 7.5:.1f}"
    assert _rows(written_path) == awarded  # the teacher's file is read, never rewritten
    code, text = cli("totals", str(grades), "--split", "100,0,0")
    assert code == 0 and {r["student"]: r["total_percent"] for r in _rows(totals_path)}["alice"] == "100.0"
