"""Written work in the lessons: an answer cell after each prediction and written question, and the export of
each student's answers.

A lesson asks two kinds of questions in its markdown: a **prediction** ("**Predict before you run.**", answered
before the next cell runs) and a **written** question (an item ``N. *(written)* ...`` of its closing list). Each
is followed by an *answer cell*: an empty markdown cell tagged ``answer`` whose metadata names the question
(``"question": "02-p1"``: the lesson's number, ``p`` for a prediction or ``w`` for a written question, and its
number in the lesson). ``add_answer_cells`` puts them in a lesson (a closing list is split into one cell per
question, so that each answer sits under its question); ``export`` reads students' notebooks and writes each
student's answers, one Markdown file per student and one CSV for the class
(``python -m minillm exercises written SUBMISSIONS --out DIR``); ``collect`` gives the same rows to the gradebook
(``exercises check --csv``), and ``key_entries`` each question's points and answer from the teachers' key
(docs/course_key.md).
"""

from __future__ import annotations

import csv
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ANSWER_TAG = "answer"
PREDICT = re.compile(r"\*\*Predict before you run\.\*\*")
WRITTEN = re.compile(r"^(\d+)\.\s+\*\(written\)\*", re.M)
LESSONS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
KEY_PATH = Path(__file__).resolve().parents[2] / "docs" / "course_key.md"
CSV_COLUMNS = ("student", "notebook", "question", "kind", "status", "answer")
# the key's rule, for a question the key does not list (or a copy of the package without docs/)
DEFAULT_POINTS = {"prediction": 1.0, "written": 3.0}
# a question in the key: "**Predict 2 (title).** *(1 point)* answer" or "**Written 1** *(3 points)*. answer", up to
# the next question or section
KEY_QUESTION = re.compile(r"^\*\*(Predict|Written) (\d+)\b[^*]*\*\*\s*\*\((\d+(?:\.\d+)?) points?\)\*\.?[ \t]*"
                          r"(.*?)(?=^\*\*(?:Predict|Written) \d|^## |\Z)", re.M | re.S)


@dataclass(frozen=True)
class Question:
    """One question of a lesson: ``id`` (``"02-p1"``), ``kind`` ("prediction" or "written"), its text, and the
    index of the markdown cell that asks it."""
    id: str
    kind: str
    text: str
    cell: int


def lesson_number(name: str) -> str:
    """The lesson's number from its file name: ``"02_kv_cache.ipynb"`` -> ``"02"``, ``"01a_..."`` -> ``"01a"``.

    Raises:
        ValueError: a name that does not start with a lesson number.
    """
    m = re.match(r"(\d+[a-z]?)_", Path(name).name)
    if not m:
        raise ValueError(f"{name}: a lesson's file name starts with its number (as 02_kv_cache.ipynb)")
    return m.group(1)


def is_answer(cell) -> bool:
    return cell.get("cell_type") == "markdown" and ANSWER_TAG in cell.get("metadata", {}).get("tags", [])


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _paragraph(text: str, start: int) -> str:
    """The paragraph of ``text`` from ``start`` to the next blank line."""
    end = text.find("\n\n", start)
    return " ".join(text[start:None if end < 0 else end].split())


def questions(nb: dict, name: str) -> list[Question]:
    """The predictions and written questions of a lesson (a notebook's dict), in order."""
    number, found, predictions = lesson_number(name), [], 0
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown" or is_answer(cell):
            continue
        text = _source(cell)
        for m in PREDICT.finditer(text):
            predictions += 1
            found.append(Question(f"{number}-p{predictions}", "prediction", _paragraph(text, m.start()), i))
        for m in WRITTEN.finditer(text):
            found.append(Question(f"{number}-w{m.group(1)}", "written", _paragraph(text, m.start()), i))
    return found


def answer_cell(question_id: str, source: str = "") -> dict:
    """An answer cell for ``question_id`` (nbformat 4.5's markdown cell, as a dict; its id names the question)."""
    return {"cell_type": "markdown", "id": f"answer-{question_id}",
            "metadata": {"tags": [ANSWER_TAG], "question": question_id}, "source": source}


def _split_written(text: str) -> list[str]:
    """A markdown cell holding a list of written questions, cut into its head, one piece per question and
    its tail (the first unindented paragraph after the last question), so an answer cell fits under each."""
    starts = [m.start() for m in WRITTEN.finditer(text)]
    if not starts:
        return [text]
    tail = re.search(r"\n\n(?=\S)", text[starts[-1]:])
    end = starts[-1] + tail.start() if tail else len(text)
    pieces = [text[:starts[0]]] + [text[a:b] for a, b in zip(starts, starts[1:] + [end])] + [text[end:]]
    return [p.strip("\n") for p in pieces if p.strip()]


def add_answer_cells(nb: dict, name: str) -> int:
    """Give every prediction and written question of a lesson its answer cell, right after the cell that asks
    it (a list of written questions is split into one cell per question first). An answer cell already there
    keeps what it holds; one whose question is gone is dropped. Changes ``nb`` in place; returns the number of
    answer cells added. Running it twice changes nothing."""
    kept = {c["metadata"]["question"]: _source(c) for c in nb["cells"] if is_answer(c)}
    cells = []
    for cell in nb["cells"]:
        if is_answer(cell):
            continue
        text = _source(cell) if cell["cell_type"] == "markdown" else ""
        pieces = _split_written(text) if WRITTEN.search(text) else None
        if pieces and len(pieces) > 1:  # the first piece keeps the cell's id, the others get ids of their own
            cells += [{**cell, "metadata": dict(cell.get("metadata", {})), "source": p}
                      | ({"id": f"{cell['id']}-{k}"} if k and "id" in cell else {}) for k, p in enumerate(pieces)]
        else:
            cells.append(cell)
    nb["cells"] = cells
    by_cell: dict[int, list[str]] = {}
    for q in questions(nb, name):
        by_cell.setdefault(q.cell, []).append(q.id)
    out, added = [], 0
    for i, cell in enumerate(cells):
        out.append(cell)
        for qid in by_cell.get(i, []):
            added += qid not in kept
            out.append(answer_cell(qid, kept.get(qid, "")))
    nb["cells"] = out
    return added


def answers(nb: dict) -> dict[str, str]:
    """{question id: the answer cell's text} of a notebook."""
    return {c["metadata"].get("question", ""): _source(c).strip() for c in nb["cells"] if is_answer(c)}


@dataclass(frozen=True)
class KeyEntry:
    """What the teachers' key says of one question: the points it is worth and the full answer."""
    points: float
    answer: str


def key_entries(path: Path = KEY_PATH) -> dict[str, KeyEntry]:
    """{question id (``"02-p1"``): its ``KeyEntry``} for every question the key answers, read from its lesson
    sections (``## 02 · ...``); {} where the key is not there (a copy of the package without the repository's
    docs/: ``DEFAULT_POINTS`` then apply)."""
    path = Path(path)
    if not path.is_file():
        return {}
    found = {}
    for section in re.split(r"^## ", path.read_text(encoding="utf-8"), flags=re.M)[1:]:
        lesson = section.split(" ", 1)[0]
        if not re.fullmatch(r"\d+[a-z]?", lesson):
            continue
        for m in KEY_QUESTION.finditer(section):
            qid = f"{lesson}-{'p' if m.group(1) == 'Predict' else 'w'}{m.group(2)}"
            found[qid] = KeyEntry(float(m.group(3)), " ".join(m.group(4).split()))
    return found


def is_lesson(path: Path, lessons: Path = LESSONS_DIR) -> bool:
    """Whether ``path`` is a student's copy of a lesson (a notebook of that name is among the lessons): its
    answers are exported, it is not graded as an exercise."""
    return Path(path).suffix == ".ipynb" and (Path(lessons) / Path(path).name).is_file()


def _lesson_questions(lessons: Path, notebook: str) -> list[Question]:
    """The questions the teacher's copy of ``notebook`` asks ([] for a notebook that is no lesson here)."""
    path = lessons / notebook
    try:
        return questions(json.loads(path.read_text(encoding="utf-8")), notebook) if path.is_file() else []
    except ValueError:
        return []


def collect(found: list[tuple[Path, str]],
            lessons: Path = LESSONS_DIR) -> tuple[list[tuple], dict[str, str], list[str]]:
    """The answers in students' notebooks (``found``: (notebook, student) pairs, as ``gradebook.notebooks_in``
    gives them): one row per student and question (``CSV_COLUMNS``; status ``answered``, ``empty`` or ``no answer
    cell``, the last for a question whose cell the student deleted), every question of the lessons they handed in;
    {question id: the lesson's text of it}; and one line per notebook that could not be read (the others are
    collected)."""
    rows, problems, texts = [], [], {}
    for path, student in found:
        try:
            nb = json.loads(Path(path).read_text(encoding="utf-8"))
            given = answers(nb)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            problems.append(f"{path}: not a readable notebook ({e}); its answers are not exported")
            continue
        asked = _lesson_questions(lessons, Path(path).name)
        for q in asked:
            texts[q.id] = q.text
        kinds = {q.id: q.kind for q in asked}
        for qid in [q.id for q in asked] + [i for i in given if i not in kinds]:
            answer = given.get(qid)
            status = "no answer cell" if answer is None else "answered" if answer else "empty"
            kind = kinds.get(qid) or ("prediction" if "-p" in qid else "written")
            rows.append((student, Path(path).name, qid, kind, status, answer or ""))
    return rows, texts, problems


def export(paths: list[Path], out: Path, lessons: Path = LESSONS_DIR) -> tuple[list[Path], list[str]]:
    """Each student's written answers: ``out/<student>.md`` (every question of the lessons they handed in, its
    text and their answer) and ``out/written.csv`` (``collect``'s rows). Students and their notebooks are found as
    ``exercises check`` finds them (a folder per student).

    Returns the files written and one line per notebook that could not be read (the others are exported).

    Raises:
        FileExistsError: ``out`` is a file, or a folder that already holds files (nothing is overwritten).
    """
    from .gradebook import notebooks_in

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out}: {'is a file' if not out.is_dir() else 'already holds files'}; "
                              "name a new folder (or an empty one), so that no earlier export is overwritten")
    rows, texts, problems = collect(notebooks_in(list(paths)), lessons)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for student in dict.fromkeys(r[0] for r in rows):
        lines = [f"# Written answers: {student}", ""]
        for _, notebook, qid, kind, status, answer in (r for r in rows if r[0] == student):
            lines += [f"## {qid} ({kind}, {notebook})", ""]
            if qid in texts:
                lines += ["> " + texts[qid], ""]
            lines += [answer if answer else f"*({status})*", ""]
        path = out / (re.sub(r"[^\w.-]", "_", student) + ".md")
        path.write_text("\n".join(lines), encoding="utf-8")
        written.append(path)
    table = out / "written.csv"
    with open(table, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        writer.writerows(rows)
    return written + [table], problems


def register(sub) -> None:
    """Add ``written`` to the ``exercises`` command's actions."""
    w = sub.add_parser("written", help="export each student's answers to the lessons' predictions and written "
                       "questions: a Markdown file per student and written.csv")
    w.add_argument("submissions", nargs="+", type=Path,
                   help="students' lesson notebooks (.ipynb), or folders of them (a folder per student)")
    w.add_argument("--out", type=Path, required=True, help="a new (or empty) folder for the files")
    w.set_defaults(func=run_written)


def run_written(args) -> int:
    missing = [p for p in args.submissions if not p.exists()]
    if missing:
        print(f"error: {missing[0]}: no such file or folder; name the students' notebooks or their folders",
              file=sys.stderr)
        return 2
    try:
        files, problems = export(args.submissions, args.out)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    for path in files:
        print(f"wrote {path}")
    return 2 if problems else 0
