"""A folder of submissions graded into one gradebook: ``python -m minillm exercises check submissions/ --grading
--seed N --csv grades.csv``.

Submissions are notebooks anywhere under the folder; a notebook's student is the first folder under it
(``submissions/alice/07_speculative_sampling.ipynb`` is alice's) or, for a notebook directly inside it, the
file's name without its exercise number. A teacher's cases file (``--cases``) is a Python file that sets
``CASES = {"function name": [Case(name, args, expected, points=...), ...]}``; it is the teacher's, so it runs.

The gradebook is three files (``companions``): ``grades.csv``, one row per student, notebook and exercise, its
points and its weighted score; ``grades_written.csv``, one row per student and lesson question, the answer beside
the points the key gives it and an empty ``points_awarded`` column the teacher fills; ``grades_totals.csv``, one
row per student: the weighted exercises, the written answers and predictions as awarded so far, and the total
(``totals``). ``python -m minillm exercises totals grades.csv`` recomputes the totals from the first two once the
teacher has filled ``points_awarded`` (or with other ``--weights``), without running a notebook again.

Weights are per exercise (a graded function, the CSV's ``exercise``): by default its difficulty in stars
(``STARS``), not its number of cases; the capstone notebook's rows share the capstone's weight (``"capstone"``).
A row's score is points / max_points x weight.
"""

from __future__ import annotations

import csv
import json
import math
import re
import runpy
import tomllib
from collections import defaultdict
from pathlib import Path

from ..files import atomic_write
from . import EXERCISES, STARS
from .checker import Case
from .written import DEFAULT_POINTS, collect, is_lesson, key_entries

COLUMNS = ("student", "notebook", "exercise", "points", "max_points", "status", "weight", "score")
WRITTEN_COLUMNS = ("student", "notebook", "question", "kind", "status", "question_text", "answer", "points",
                   "points_awarded", "key_answer")
TOTAL_COLUMNS = ("student", "exercises", "exercises_max", "written", "written_max", "predictions",
                 "predictions_max", "ungraded", "total_percent")
CAPSTONE = "capstone"
SPLIT = (60.0, 30.0, 10.0)  # docs/course.md's suggestion: exercises, written questions, predictions (percent)


def notebooks_in(paths: list[Path]) -> list[tuple[Path, str]]:
    """(notebook, student) for each path: a notebook as given, or every ``*.ipynb`` under a folder (sorted;
    Jupyter's checkpoints left out)."""
    found = []
    for path in paths:
        if not path.is_dir():
            found.append((path, path.parent.name or path.stem))
            continue
        for nb in sorted(path.rglob("*.ipynb")):
            rel = nb.relative_to(path)
            if ".ipynb_checkpoints" in rel.parts:
                continue
            student = rel.parts[0] if len(rel.parts) > 1 else re.sub(r"^\d+_", "", nb.stem)
            found.append((nb, student))
    return found


def load_cases(path: Path) -> dict[str, list[Case]]:
    """The teacher's extra cases: ``CASES`` from the Python file at ``path``.

    Raises:
        ValueError: no ``CASES`` dict, a name that is no exercise, or an entry that is no list of ``Case``.
    """
    cases = runpy.run_path(str(path)).get("CASES")
    if not isinstance(cases, dict):
        raise ValueError(f"--cases {path}: set CASES = {{'function name': [Case(...), ...]}} in the file")
    for name, items in cases.items():
        if name not in EXERCISES:
            raise ValueError(f"--cases {path}: {name!r} is not an exercise ({', '.join(EXERCISES)})")
        if not isinstance(items, list) or not all(isinstance(c, Case) for c in items):
            raise ValueError(f"--cases {path}: CASES[{name!r}] must be a list of minillm.exercises.Case")
    return cases


def weight_key(notebook: str, exercise: str) -> str:
    """The weight a row takes: its exercise's, or the capstone's for every row of the capstone notebook (its
    rows share one weight, so the capstone weighs as one exercise however many rows it gives)."""
    return CAPSTONE if CAPSTONE in Path(notebook).stem else exercise


def default_weights() -> dict[str, float]:
    """{exercise (and ``"capstone"``): its stars}: a harder exercise weighs more, whatever its case count."""
    return {name: float(stars) for name, stars in STARS.items()}


def load_weights(path: Path) -> dict[str, float]:
    """The teacher's weights: ``default_weights`` with the exercises a file names set to its numbers. The file is
    TOML (``kv_cache_size = 2``), JSON (``{"kv_cache_size": 2}``) or CSV (``exercise,weight`` rows, a header
    allowed); an exercise it leaves out keeps its stars, weight 0 leaves one out of the totals.

    Raises:
        ValueError: another suffix, a file that does not parse, a name that is no exercise (the message names it
            and lists them), a weight that is no number, negative or not finite, or every weight 0.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            given = tomllib.loads(text)
        elif path.suffix == ".json":
            given = json.loads(text)
        elif path.suffix == ".csv":
            given = {}
            for n, row in enumerate(csv.reader(text.splitlines()), 1):
                if not row or (n == 1 and row[0].strip().lower() == "exercise"):
                    continue
                if len(row) != 2:
                    raise ValueError(f"line {n} has {len(row)} cells; write exercise,weight")
                given[row[0].strip()] = row[1].strip()
        else:
            raise ValueError("name a .toml, .json or .csv file")
    except ValueError as e:  # tomllib's and json's errors are ValueErrors
        raise ValueError(f"--weights {path}: {e}") from None
    if not isinstance(given, dict):
        raise ValueError(f"--weights {path}: give a mapping of exercise to weight ({{\"kv_cache_size\": 2}})")
    weights = default_weights()
    for name, value in given.items():
        if name not in weights:
            raise ValueError(f"--weights {path}: {name!r} is not an exercise; name one of {', '.join(weights)}")
        try:
            weight = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            weight = math.nan
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"--weights {path}: {name} = {value!r}: a weight is a number, 0 or more")
        weights[name] = weight
    if not any(weights.values()):
        raise ValueError(f"--weights {path}: every weight is 0; give at least one exercise a weight")
    return weights


def _number(x: float) -> str:
    return f"{round(x, 4):g}"


def _text(x) -> str:
    """A cell a spreadsheet shows as text: one that starts as a formula would (=, +, -, @) gets a leading '."""
    x = str(x)
    return "'" + x if x[:1] in ("=", "+", "-", "@", "\t", "\r") else x


def weigh(rows: list[tuple], weights: dict[str, float]) -> list[tuple]:
    """``rows`` (student, notebook, exercise, points, max_points, status) with each row's weight and score
    (points / max_points x weight). A row that graded nothing (no exercise named) weighs 0; the capstone
    notebook's rows share the capstone's weight in proportion to their max points; an exercise without stars
    weighs 1."""
    most = defaultdict(float)
    for student, notebook, exercise, _, max_points, *_ in rows:
        most[student, notebook, weight_key(notebook, exercise)] += float(max_points)
    out = []
    for student, notebook, exercise, points, max_points, status, *_ in rows:
        group = most[student, notebook, weight_key(notebook, exercise)]
        weight = weights.get(weight_key(notebook, exercise), 1.0) * float(max_points) / group \
            if exercise and group > 0 else 0.0
        score = weight * float(points) / float(max_points) if float(max_points) > 0 else 0.0
        out.append((student, notebook, exercise, points, max_points, status, _number(weight), _number(score)))
    return out


def weights_in(rows: list[tuple]) -> dict[str, float]:
    """The weights a gradebook was written with (its rows in ``COLUMNS``): ``default_weights`` with each
    exercise's weight read back from its rows (the capstone's summed over its notebook's rows), so that
    recomputing the totals keeps the teacher's ``--weights``."""
    group = defaultdict(float)
    for student, notebook, exercise, _, _, _, weight, _ in rows:
        if exercise:
            group[student, notebook, weight_key(notebook, exercise)] += float(weight)
    weights = default_weights()
    for (_, _, key), weight in group.items():
        weights[key] = round(weight, 3)  # the capstone's shares, written to 4 decimals, sum back to its weight
    return weights


def written_rows(found: list[tuple[Path, str]], key_path: Path | None = None) -> tuple[list[tuple], list[str]]:
    """The students' answers to the lessons among ``found`` ((notebook, student) pairs), as rows of
    ``WRITTEN_COLUMNS``: the question's text, the answer, the points the key gives it, ``points_awarded`` empty
    for an answer the teacher reads (0 for an empty or deleted one), and the key's full answer. Returns the rows
    and one line per lesson notebook that could not be read."""
    key = key_entries() if key_path is None else key_entries(key_path)
    rows, texts, problems = collect([(p, s) for p, s in found if is_lesson(p)])
    out = []
    for student, notebook, qid, kind, status, answer in rows:
        entry = key.get(qid)
        points = entry.points if entry else DEFAULT_POINTS[kind]
        out.append((student, notebook, qid, kind, status, texts.get(qid, ""), answer, _number(points),
                    "" if status == "answered" else "0", entry.answer if entry else ""))
    return out, problems


def totals(rows: list[tuple], written: list[tuple], weights: dict[str, float],
           split: tuple[float, float, float] = SPLIT) -> list[tuple]:
    """One row per student (``TOTAL_COLUMNS``).

    exercises: the sum of the student's weighted scores (an exercise handed in twice counts its better copy);
    exercises_max: the sum of the weights of every exercise anyone in the class was graded on (one a student did
    not hand in counts 0). written / predictions: the ``points_awarded`` so far; their max: the key's points of
    every question of the lessons anyone handed in. ungraded: the student's answers with no points awarded yet.
    total_percent = 100 x (split[0] x exercises / exercises_max + split[1] x written / written_max + split[2] x
    predictions / predictions_max) / (split[0] + split[1] + split[2]), leaving out a part whose max is 0 (nobody
    handed it in) from both sums.

    Raises:
        ValueError: a ``points_awarded`` that is no number from 0 to the question's points (the message names
            the student and the question).
    """
    weighted = weigh(rows, weights)
    keys = {weight_key(nb, ex) for _, nb, ex, *_ in rows if ex}
    exercises_max = sum(weights.get(k, 1.0) for k in keys)
    best: dict[tuple[str, str], float] = defaultdict(float)
    group: dict[tuple[str, str, str], float] = defaultdict(float)
    for student, notebook, exercise, *_, score in weighted:
        if exercise:
            group[student, notebook, weight_key(notebook, exercise)] += float(score)
    for (student, _, key), score in group.items():
        best[student, key] = max(best[student, key], score)
    asked: dict[str, tuple[str, float]] = {}
    got = defaultdict(float)
    ungraded = defaultdict(int)
    for student, notebook, qid, kind, status, _, _, points, awarded, _ in written:
        asked[qid] = (kind, float(points))
        if str(awarded).strip() == "":
            ungraded[student] += 1
            continue
        try:
            value = float(awarded)
        except ValueError:
            value = math.nan
        if not 0 <= value <= float(points):
            raise ValueError(f"{student}, {qid}: points_awarded {awarded!r}: give a number from 0 to {points} "
                             "(the question's points), or leave it empty")
        got[student, kind] += value
    maxima = {kind: sum(p for k, p in asked.values() if k == kind) for kind in ("written", "prediction")}
    students = dict.fromkeys([r[0] for r in rows] + [r[0] for r in written])
    out = []
    for student in students:
        exercises = sum(score for (s, _), score in best.items() if s == student)
        parts = [(split[0], exercises, exercises_max), (split[1], got[student, "written"], maxima["written"]),
                 (split[2], got[student, "prediction"], maxima["prediction"])]
        shares = sum(share for share, _, most in parts if most > 0)
        total = 100 * sum(share * x / most for share, x, most in parts if most > 0) / shares if shares > 0 else None
        out.append((_text(student), _number(exercises), _number(exercises_max), _number(got[student, "written"]),
                    _number(maxima["written"]), _number(got[student, "prediction"]), _number(maxima["prediction"]),
                    ungraded[student], "" if total is None else f"{total:.1f}"))
    return out


def companions(path: Path) -> tuple[Path, Path]:
    """The totals and the written answers beside the gradebook: ``grades.csv`` -> ``grades_totals.csv``,
    ``grades_written.csv``."""
    path = Path(path)
    return (path.with_name(f"{path.stem}_totals{path.suffix or '.csv'}"),
            path.with_name(f"{path.stem}_written{path.suffix or '.csv'}"))


def _write(path: Path, columns: tuple[str, ...], rows: list[tuple]) -> None:
    # a temporary file renamed (files.atomic_write): an interrupted run never leaves half a file over the last one
    with atomic_write(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows(rows)


def write_gradebook(path: Path, rows: list[tuple], written: list[tuple] | None, weights: dict[str, float],
                    split: tuple[float, float, float] = SPLIT, *, keep_written: bool = False) -> list[Path]:
    """``grades.csv`` (``COLUMNS``), ``grades_totals.csv`` (``totals``) and ``grades_written.csv``
    (``WRITTEN_COLUMNS``; not with ``keep_written``, which reads the teacher's points from it), each written to a
    temporary file and renamed. Returns the paths written. ``exercises check`` checks the paths before grading
    starts (``files.check_output_path``).

    Raises:
        ValueError: from ``totals``, before anything is written.
    """
    totals_path, written_path = companions(path)
    table = totals(rows, written or [], weights, split)
    _write(path, COLUMNS, [(_text(s), _text(nb), *rest) for s, nb, *rest in weigh(rows, weights)])
    files = [path]
    if written is not None and not keep_written:
        _write(written_path, WRITTEN_COLUMNS, [tuple(_text(x) if i in (0, 1, 5, 6, 9) else x
                                                     for i, x in enumerate(r)) for r in written])
        files.append(written_path)
    _write(totals_path, TOTAL_COLUMNS, table)
    return files + [totals_path]


def read_csv(path: Path, columns: tuple[str, ...]) -> list[tuple]:
    """The rows of a gradebook file, in ``columns``' order (a cell written with a leading ' as it was written).

    Raises:
        ValueError: a column missing (the message names it and the file).
    """
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: no column {missing[0]!r}; is it a file `exercises check --csv` wrote?")
        return [tuple(r[c] if r[c] is not None else "" for c in columns) for r in reader]
