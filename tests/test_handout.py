"""What students get (``exercises handout``) and the written work they hand back (``exercises written``).

* the handout holds every lesson with no stored output anywhere (so none before or after a prediction), an
  empty answer cell under every question, every exercise notebook without its solution, the readings, and
  never the solutions, the key or the tests; it refuses a folder that already holds files;
* the teacher's lessons have an answer cell after each prediction and written question;
* ``exercises written`` exports each student's answers, one file per student and a CSV, and says which
  question a student left empty or whose cell they deleted.
"""

import csv
import json
import re
from pathlib import Path

import pytest

from minillm.exercises import handout, written
from minillm.exercises.cli import main

ROOT = Path(__file__).resolve().parents[1]
# the lessons whose teacher's copies carry their answer cells (03 and 06 get theirs in the handout)
WITH_ANSWER_CELLS = ["00_quickstart", "01_roofline", "01a_roofline_appendix", "02_kv_cache", "03a_online_serving",
                     "04_speculative_decoding", "04a_speculative_appendix", "05_quantization", "05a_kquants",
                     "05b_variable_bitrate"]


def _nb(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _src(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("handout") / "class"
    handout.write_handout(out)
    return out


def test_the_handout_holds_every_lesson_exercise_and_reading(out):
    lessons = {p.name for p in handout.lesson_paths()}
    assert lessons and {p.name for p in (out / "notebooks").glob("*.ipynb")} == lessons
    solutions = {p.name for p in (ROOT / "notebooks" / "exercises" / "solutions").glob("*.ipynb")}
    assert {p.name for p in (out / "notebooks" / "exercises" / "student").glob("*.ipynb")} == solutions
    for reading in handout.readings():
        assert (out / reading.relative_to(ROOT)).read_bytes() == reading.read_bytes()
    for record in handout.RECORDS:
        assert (out / "figures" / record).is_file()
    assert (out / handout.GUIDE).is_file() and (out / "figures").is_dir()


def test_the_handout_has_no_solution_no_key_and_no_tests(out):
    names = {p.relative_to(out).as_posix() for p in out.rglob("*")}
    assert not [n for n in names if "solutions" in n or n.startswith("tests") or n.endswith("course_key.md")
                or n.endswith("conftest.py")], names
    key_lines = [line for line in (ROOT / "docs" / "course_key.md").read_text(encoding="utf-8").splitlines()
                 if len(line) > 60]
    for path in out.rglob("*"):
        if path.is_file() and path.suffix in (".ipynb", ".md"):
            text = path.read_text(encoding="utf-8")
            assert "### BEGIN SOLUTION" not in text, path
            assert not [line for line in key_lines if line in text], f"{path}: holds a line of the teachers' key"
    for path in (out / "notebooks" / "exercises" / "student").glob("*.ipynb"):
        code = "\n".join(_src(c) for c in _nb(path)["cells"] if c["cell_type"] == "code")
        assert 'raise NotImplementedError("write this' in code, path


def test_no_stored_output_anywhere_in_the_handouts_lessons(out):
    prompts = 0
    for path in (out / "notebooks").glob("*.ipynb"):
        cells = _nb(path)["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, (path.name, i)
                assert "execution" not in cell["metadata"] and "NBVAL" not in _src(cell), (path.name, i)
            if written.PREDICT.search(_src(cell)) and not written.is_answer(cell):
                prompts += 1
                after = cells[i + 1:i + 3]
                assert written.is_answer(after[0]) and _src(after[0]) == "", (path.name, i)
                for near in [cells[i - 1]] + after:
                    assert not near.get("outputs"), f"{path.name} cell {i}: a stored output beside a prediction"
    assert prompts >= 30


def test_every_question_of_every_lesson_has_an_empty_answer_cell_in_the_handout(out):
    for path in handout.lesson_paths():
        student = _nb(out / "notebooks" / path.name)
        asked = [q.id for q in written.questions(student, path.name)]
        cells = {c["metadata"]["question"]: c for c in student["cells"] if written.is_answer(c)}
        assert sorted(cells) == sorted(asked), path.name
        assert all(_src(c) == "" for c in cells.values()), path.name


@pytest.mark.parametrize("lesson", WITH_ANSWER_CELLS)
def test_each_prediction_and_written_question_is_followed_by_its_answer_cell(lesson):
    cells = _nb(ROOT / "notebooks" / f"{lesson}.ipynb")["cells"]
    qs = written.questions({"cells": cells}, f"{lesson}.ipynb")
    assert any(q.kind == "prediction" for q in qs) and any(q.kind == "written" for q in qs)
    for q in qs:
        ids_after = []
        for cell in cells[q.cell + 1:]:
            if not written.is_answer(cell):
                break
            ids_after.append(cell["metadata"]["question"])
        assert q.id in ids_after, f"notebooks/{lesson}.ipynb: no answer cell right after {q.id} ({q.text[:60]})"


def test_answer_cells_are_added_once_under_each_question_and_keep_what_they_hold():
    nb = {"cells": [
        {"cell_type": "markdown", "id": "a", "metadata": {}, "source": "Intro.\n\n**Predict before you run.** How fast?"},
        {"cell_type": "code", "id": "b", "metadata": {}, "source": "x = 1", "outputs": [], "execution_count": None},
        {"cell_type": "markdown", "id": "c", "metadata": {},
         "source": "## Questions\n\n1. *(written)* Why?\n   Say it.\n2. *(written)* How?\n\n**Now do exercise 2**."},
    ]}
    assert written.add_answer_cells(nb, "07_x.ipynb") == 3
    kinds = [("A:" + c["metadata"]["question"]) if written.is_answer(c) else _src(c)[:14] for c in nb["cells"]]
    assert kinds == ["Intro.\n\n**Pred", "A:07-p1", "x = 1", "## Questions", "1. *(written)*", "A:07-w1",
                     "2. *(written)*", "A:07-w2", "**Now do exerc"]
    assert len({c["id"] for c in nb["cells"]}) == len(nb["cells"])
    nb["cells"][5]["source"] = "Because."
    assert written.add_answer_cells(nb, "07_x.ipynb") == 0 and len(nb["cells"]) == 9
    assert written.answers(nb) == {"07-p1": "", "07-w1": "Because.", "07-w2": ""}
    assert [q.text for q in written.questions(nb, "07_x.ipynb")][1] == "1. *(written)* Why? Say it."


def test_the_handout_refuses_a_folder_that_holds_files(tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep me")
    assert main(["handout", str(full)]) == 2
    err = capsys.readouterr().err
    assert str(full) in err and "already holds files" in err and "new folder" in err
    assert [p.name for p in full.iterdir()] == ["mine.txt"] and (full / "mine.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["handout", str(empty)]) == 0
    assert (empty / "notebooks" / "00_quickstart.ipynb").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind


def _submit(folder: Path, lesson: str, answers: dict[str, str], drop: str | None = None) -> None:
    nb = handout.student_lesson(_nb(ROOT / "notebooks" / lesson), lesson)
    nb["cells"] = [c for c in nb["cells"] if not (written.is_answer(c) and c["metadata"]["question"] == drop)]
    for c in nb["cells"]:
        if written.is_answer(c) and c["metadata"]["question"] in answers:
            c["source"] = answers[c["metadata"]["question"]]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / lesson).write_text(json.dumps(nb), encoding="utf-8")


def test_written_exports_each_students_answers(tmp_path, capsys):
    subs = tmp_path / "submissions"
    _submit(subs / "alice", "02_kv_cache.ipynb", {"02-p1": "45 KiB, 135 KiB", "02-w3": "about 330k tokens"},
            drop="02-w2")
    _submit(subs / "bob", "02_kv_cache.ipynb", {})
    out = tmp_path / "answers"
    assert main(["written", str(subs), "--out", str(out)]) == 0
    with open(out / "written.csv", newline="", encoding="utf-8") as f:
        rows = {(r["student"], r["question"]): r for r in csv.DictReader(f)}
    ids = [q.id for q in written.questions(_nb(ROOT / "notebooks" / "02_kv_cache.ipynb"), "02_kv_cache.ipynb")]
    assert set(rows) == {(s, q) for s in ("alice", "bob") for q in ids}
    assert rows["alice", "02-p1"]["answer"] == "45 KiB, 135 KiB" and rows["alice", "02-p1"]["status"] == "answered"
    assert rows["alice", "02-p1"]["kind"] == "prediction" and rows["alice", "02-w3"]["kind"] == "written"
    assert rows["alice", "02-w2"]["status"] == "no answer cell"
    assert rows["alice", "02-w1"]["status"] == "empty" and rows["bob", "02-w3"]["status"] == "empty"
    alice = (out / "alice.md").read_text(encoding="utf-8")
    assert "about 330k tokens" in alice and "Llama-2-70B has 8 KV heads" in alice and "*(no answer cell)*" in alice
    assert "45 KiB" not in (out / "bob.md").read_text(encoding="utf-8")
    assert "wrote" in capsys.readouterr().out
    # a second export into the same folder is refused, and the first stays as it was
    before = (out / "written.csv").read_bytes()
    assert main(["written", str(subs), "--out", str(out)]) == 2
    assert "already holds files" in capsys.readouterr().err and (out / "written.csv").read_bytes() == before


def test_written_names_an_unreadable_notebook_and_exports_the_others(tmp_path, capsys):
    subs = tmp_path / "submissions"
    _submit(subs / "carol", "00_quickstart.ipynb", {"00-p1": "yes"})
    (subs / "dave").mkdir()
    (subs / "dave" / "00_quickstart.ipynb").write_text("{not json", encoding="utf-8")
    assert main(["written", str(subs), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"dave.00_quickstart\.ipynb: not a readable notebook", err)
    assert (tmp_path / "out" / "carol.md").is_file() and not (tmp_path / "out" / "dave.md").exists()
    assert main(["written", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out2")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
