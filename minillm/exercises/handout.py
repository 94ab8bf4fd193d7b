"""The students' handout: ``python -m minillm exercises handout OUT``.

What a class gets, and nothing it should not: the lessons (``notebooks/0*.ipynb``) with every output and
execution count cleared, so no stored result sits under a "predict before you run" prompt, and every answer
cell empty; the exercise notebooks, built from the solutions as ``exercises build`` builds them (each answer
replaced by ``raise NotImplementedError``); the short readings (``docs/readings/``, or where there are none
yet, the docs the syllabus in docs/course.md assigns); and the measurement records the lessons read but a
class cannot redo (``RECORDS``: runs of hours). Never the solution notebooks, the teachers' key, the
teachers' guide or the tests. The teacher's copy in the repository keeps its stored outputs.

The handout is written into a new folder beside ``OUT`` and renamed into place when complete, so a failed
run leaves nothing half-written; an existing ``OUT`` that holds anything is refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from .written import add_answer_cells, is_answer

ROOT = Path(__file__).resolve().parents[2]
# records of runs a class cannot repeat (the whole quantization table, llama.cpp's run, the bitrate
# measurement, the stack), which the lessons read as their input
RECORDS = ("05_quant_table.json", "05_gptq_avenues.json", "bench_decode_llamacpp.json", "05_kquants.json",
           "05b_bitrate.json", "stack.json")
NBVAL_MARKER = re.compile(r"^[ \t]*# NBVAL_\w+[ \t]*\n?", re.M)
LINK = re.compile(r"\b((?:docs/)?[\w./-]+\.md)\b")
NEVER = ("course_key.md", "course.md")  # the key, and the teachers' plan that points at it
GUIDE = Path("START_HERE.md")


def lesson_paths(root: Path = ROOT) -> list[Path]:
    """The lessons, in the course's order (their file names sort that way)."""
    return sorted((root / "notebooks").glob("[0-9]*.ipynb"))


def student_lesson(nb: dict, name: str) -> dict:
    """The student's copy of the lesson ``name`` (a notebook's dict): outputs, execution counts and timing
    metadata cleared, an empty answer cell under every question (added where the teacher's copy has none), and
    the test runner's markers (``# NBVAL_...`` lines) dropped."""
    nb = json.loads(json.dumps(nb))  # a deep copy
    add_answer_cells(nb, name)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            cell["source"] = NBVAL_MARKER.sub("", source)
            cell["outputs"], cell["execution_count"] = [], None
        elif is_answer(cell):
            cell["source"] = ""
        cell.get("metadata", {}).pop("execution", None)
    return nb


def readings(root: Path = ROOT) -> list[Path]:
    """The students' readings: every ``docs/readings/*.md`` where that folder has any; otherwise the repository
    files the syllabus's "Read first" column names (README.md, docs/*.md), never the key."""
    own = sorted((root / "docs" / "readings").glob("*.md"))
    if own:
        return own
    syllabus = (root / "docs" / "course.md").read_text(encoding="utf-8")
    found = []
    for line in syllabus.splitlines():
        cells = line.split("|")
        if len(cells) < 6 or not cells[1].strip().isdigit():
            continue
        for name in LINK.findall(cells[4]):
            path = root / name
            if path.is_file() and path.name not in NEVER and path not in found:
                found.append(path)
    return found


def _handout_files(root: Path) -> dict[Path, bytes]:
    """{path inside the handout: its bytes}, built before anything is written."""
    from .notebooks import student_text

    files: dict[Path, bytes] = {}
    for path in lesson_paths(root):
        nb = student_lesson(json.loads(path.read_text(encoding="utf-8")), path.name)
        files[Path("notebooks") / path.name] = (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()
    solutions = root / "notebooks" / "exercises" / "solutions"
    exercises = sorted(solutions.glob("*.ipynb"))
    if not exercises:
        raise FileNotFoundError(f"no exercise notebooks in {solutions}: the handout needs them")
    for path in exercises:
        files[Path("notebooks") / "exercises" / "student" / path.name] = student_text(path).encode()
    for path in readings(root):
        files[path.relative_to(root)] = path.read_bytes()
    for name in RECORDS:
        record = root / "figures" / name
        if not record.is_file():
            raise FileNotFoundError(f"figures/{name}: a lesson reads this record and the handout needs it; "
                                    "restore it from git (or rerun the command that writes it)")
        files[Path("figures") / name] = record.read_bytes()
    files[GUIDE] = _guide(files).encode()
    return files


def _guide(files: dict[Path, bytes]) -> str:
    """START_HERE.md: what the handout holds and how to work in it."""
    lessons = [p.name for p in files if p.parent == Path("notebooks")]
    docs = [str(p) for p in files if p.suffix == ".md"]
    return "\n".join([
        "# Fast LLM inference, measured: the students' handout", "",
        "Install minillm as the teacher says (`pip install` of the course's package), then run `jupyter lab` in",
        "this folder. Each class has a lesson in `notebooks/` and exercises in `notebooks/exercises/student/`.",
        "Before a cell that follows **Predict before you run**, write your prediction in the answer cell under",
        "the prompt; the closing *(written)* questions have an answer cell each too. Run the cells in order:",
        "the numbers are your machine's, measured as you go, and the lessons write their figures into",
        "`figures/`.", "",
        "Lessons: " + ", ".join(lessons) + ".", "",
        "Readings: " + (", ".join(docs) if docs else "none") + ".", "",
    ])


def write_handout(out: Path, root: Path = ROOT) -> list[Path]:
    """Write the handout into the folder ``out`` (new, or empty); returns the files written, under ``out``.

    Raises:
        FileExistsError: ``out`` is a file or a folder that holds anything.
        FileNotFoundError: no exercise notebook, or a record the lessons read is missing.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        kind = "is a file" if not out.is_dir() else "already holds files"
        raise FileExistsError(f"{out} {kind}; name a new folder (or an empty one) for the handout")
    files = _handout_files(Path(root))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        (tmp / "figures").mkdir(exist_ok=True)
        os.chmod(tmp, 0o777 & ~_umask())
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / rel for rel in files]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def register(sub) -> None:
    """Add ``handout`` to the ``exercises`` command's actions."""
    h = sub.add_parser("handout", help="write what students get: the lessons without outputs, the exercise "
                       "notebooks, the readings (never the solutions, the key or the tests)")
    h.add_argument("out", type=Path, help="a new (or empty) folder")
    h.set_defaults(func=run_handout)


def run_handout(args) -> int:
    try:
        files = write_handout(args.out)
    except (FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {args.out}: cannot write the handout there ({e.strerror}); name a folder you can write "
              "into", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} files into {args.out}: {sum(p.suffix == '.ipynb' for p in files)} notebooks, "
          f"{sum(p.suffix == '.md' for p in files) - 1} readings; students start at {args.out / GUIDE}")
    return 0
