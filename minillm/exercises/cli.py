"""``python -m minillm exercises build | check NOTEBOOK_OR_FOLDER... [--grading --seed N --csv FILE --weights FILE]
| totals GRADES_CSV | list``.

``register(subparsers)`` adds the command to minillm's parser; each action's ``func(args)`` returns
the exit code (``check``: 0 only when every function of every notebook passes; 128 + the signal's
number when SIGINT or SIGTERM stops it). ``python -m minillm.exercises.cli ACTION ...`` runs the same
actions on their own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import EXERCISES, handout, written


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``exercises`` (with ``build``, ``check``, ``totals`` and ``list``) to an argparse subparsers object."""
    p = subparsers.add_parser("exercises", help="classroom exercises: build the student notebooks, check a student's")
    sub = p.add_subparsers(dest="exercises_action", required=True)
    b = sub.add_parser("build", help="write the student notebooks from the solution notebooks")
    # the defaults are resolved when the action runs, so that registering imports no notebook machinery
    b.add_argument("--solutions", type=Path, default=None, help="default: notebooks/exercises/solutions")
    b.add_argument("--out", type=Path, default=None, help="default: notebooks/exercises/student")
    b.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the student notebooks are out of date")
    b.set_defaults(func=run_build)
    c = sub.add_parser("check", help="execute students' notebooks and print the report of each function in them; "
                       "exit 0 when every check passes, 1 when one fails, 2 when a path is not a notebook, "
                       "128 + the signal's number when SIGINT or SIGTERM stops it (its kernel killed)")
    c.add_argument("notebooks", nargs="+", type=Path, help="student notebooks (.ipynb), or folders of them")
    c.add_argument("--timeout", type=int, default=120,
                   help="seconds per cell, and for all the cases of each graded function; a cell that runs longer "
                        "is stopped (its kernel killed) and the notebook run without it, and a function that was "
                        "running then is not called again (default 120)")
    c.add_argument("--grading", action="store_true",
                   help="add cases the students have never seen (from --seed and/or --cases) to the practice ones")
    c.add_argument("--seed", type=int, default=None, help="with --grading: the teacher's seed of the hidden "
                   "random cases (keep it to yourself; not 0, the practice seed)")
    c.add_argument("--cases", type=Path, default=None, help="with --grading: a Python file of the teacher's "
                   "own cases, CASES = {'function name': [Case(...)]} (kept outside the students' reach)")
    c.add_argument("--csv", type=Path, default=None, help="write the gradebook: FILE (student, notebook, exercise, "
                   "points, max_points, status, weight, score), FILE's _written.csv (the lessons' answers beside "
                   "their points, a column to award them) and _totals.csv (each student's total)")
    c.add_argument("--weights", type=Path, default=None, help="with --csv: a .toml, .json or .csv file of "
                   "exercise -> weight (default: each exercise's stars; 'capstone' weighs the capstone)")
    c.add_argument("--split", default=None, help="with --csv: the total's percent for exercises, written "
                   "questions and predictions (default 60,30,10)")
    c.add_argument("--max-output", type=int, default=None, help="characters a notebook may print in all; a cell "
                   "that prints more is stopped and skipped (default 1,000,000)")
    c.set_defaults(func=run_check)
    t = sub.add_parser("totals", help="recompute each student's total (FILE's _totals.csv) from the gradebook "
                       "check --csv wrote and the points awarded in its _written.csv, without grading again")
    t.add_argument("csv", type=Path, help="the gradebook check --csv wrote (grades.csv)")
    t.add_argument("--weights", type=Path, default=None, help="a .toml, .json or .csv file of exercise -> weight "
                   "(default: the weights grades.csv was written with); its weight and score columns follow them")
    t.add_argument("--split", default=None, help="the total's percent for exercises, written questions and "
                   "predictions (default 60,30,10)")
    t.set_defaults(func=run_totals)
    ls = sub.add_parser("list", help="the exercises: function, signature, notebook")
    ls.set_defaults(func=run_list)
    handout.register(sub)
    written.register(sub)
    return p


def run_build(args) -> int:
    # nbformat and the kernel client load only for the commands that run notebooks
    from .notebooks import SOLUTIONS_DIR, STUDENT_DIR, MarkerError, build, out_of_date

    solutions, out = args.solutions or SOLUTIONS_DIR, args.out or STUDENT_DIR
    for option, folder, fix in (("--solutions", solutions, "name the folder that holds the solution notebooks"),
                                ("--out", out, "name a folder (it is created if missing), or move the file away")):
        file_above = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        if file_above is not None:  # checked first, so that nothing is written
            print(f"error: {option} {folder}: {file_above} is a file, not a folder; {fix}", file=sys.stderr)
            return 2
    try:
        if args.check:
            stale = out_of_date(solutions, out)
            for name in stale:
                print(f"out of date: {out / name}; run python -m minillm exercises build", file=sys.stderr)
            return 1 if stale else 0
        for path in build(solutions, out):
            print(f"wrote {path}")
    except (FileNotFoundError, MarkerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a folder we may not write into, say
        print(f"error: --out {out}: cannot write the student notebooks there ({e.strerror}); name a folder you "
              f"can write into", file=sys.stderr)
        return 2
    return 0


def run_check(args) -> int:
    from ..files import check_output_path
    from .gradebook import companions, load_cases, notebooks_in, write_gradebook, written_rows
    from .grading import NotANotebookError, check_notebook
    from .kernel import MAX_OUTPUT, GradingStopped

    def refuse(message: str) -> int:
        print(f"error: {message}", file=sys.stderr)
        return 2

    if args.timeout <= 0:
        return refuse(f"--timeout {args.timeout}: give the seconds a cell may run, a whole number above 0 "
                      "(default 120)")
    if args.grading and args.seed is None and args.cases is None:
        return refuse("--grading needs cases the students have not seen: --seed N (a number you keep to "
                      "yourself) and/or --cases FILE")
    if not args.grading and (args.seed is not None or args.cases is not None):
        return refuse("--seed and --cases choose the hidden cases of --grading; add --grading")
    if args.seed == 0:
        return refuse("--seed 0 draws the practice cases the students see; choose another number")
    if not args.csv and (args.weights is not None or args.split is not None):
        return refuse("--weights and --split weigh the gradebook's totals; add --csv FILE")
    if args.csv:
        try:  # before any grading: a class's worth of work must not end in a path that cannot be written
            for path in (args.csv, *companions(args.csv)):
                check_output_path(path, "--csv")
            weights, split = _weighting(args)
        except (OSError, ValueError) as e:
            return refuse(str(e) if isinstance(e, ValueError) else f"--weights {args.weights}: cannot be read ({e})")
    try:
        extra = load_cases(args.cases) if args.cases else None
    except (OSError, ValueError, SyntaxError) as e:
        return refuse(f"{e}" if isinstance(e, ValueError) else f"--cases {args.cases}: cannot be read ({e})")
    ok, unreadable, rows = True, False, []
    found = notebooks_in(args.notebooks)
    for path, student in found:
        print(f"== {path}", flush=True)
        if written.is_lesson(path):  # a lesson hands in answers, not functions
            print(f"{path}: a lesson: its predictions and written answers go to the gradebook's _written.csv "
                  "(--csv), not run", flush=True)
            continue
        try:
            result = check_notebook(path, args.timeout, grading=args.grading, seed=args.seed, extra=extra,
                                    max_output=args.max_output or MAX_OUTPUT)
        except NotANotebookError as e:  # bad input, not a failing grade; the row says so
            print(f"error: {e}", file=sys.stderr)
            rows.append((student, path.name, "", 0, 0, "not a notebook"))
            unreadable = True
            continue
        except GradingStopped as e:  # the shell's convention: 128 + the signal's number
            print(f"{path}: {e}; no grade", file=sys.stderr)
            return 128 + e.signum
        except ValueError as e:  # a notebook without the exercises: a failing grade
            print(f"error: {e}")
            rows.append((student, path.name, "", 0, 0, "no exercise"))
            ok = False
            continue
        except Exception as e:  # whatever one notebook does, the others are graded and the gradebook written
            print(f"error: {path}: grading broke off ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); "
                  "its rows score 0", flush=True)
            rows.append((student, path.name, "", 0, 0, "grading failed"))
            ok = False
            continue
        for text, _ in result.reports.values():
            print(text)
        for line in result.cell_errors:
            print(line)
        for line in filter(None, result.stopped.splitlines()):
            print(f"stopped: {line}")
        print(f"{path}: {'PASSED' if result.passed else 'FAILED'}", flush=True)
        rows += [(student, path.name, name, f"{p:g}", f"{m:g}", status)
                 for name, (p, m, status) in result.scores.items()]
        ok &= result.passed
    if args.csv:
        answers, problems = written_rows(found)
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        unreadable |= bool(problems)
        for path in write_gradebook(args.csv, rows, answers, weights, split):
            print(f"wrote {path}")
    return 2 if unreadable else 0 if ok else 1


def _weighting(args) -> tuple[dict[str, float], tuple[float, float, float]]:
    """``--weights`` (or the stars) and ``--split`` (or 60,30,10). Raises ValueError naming the option."""
    from .gradebook import SPLIT, default_weights, load_weights

    weights = load_weights(args.weights) if args.weights is not None else default_weights()
    if args.split is None:
        return weights, SPLIT
    try:
        split = tuple(float(x) for x in args.split.split(","))
    except ValueError:
        split = ()
    if len(split) != 3 or not all(0 <= x < float("inf") for x in split) or not any(split):
        raise ValueError(f"--split {args.split}: give three percents for exercises, written questions and "
                         "predictions, as 60,30,10")
    return weights, split


def run_totals(args) -> int:
    from .gradebook import COLUMNS, WRITTEN_COLUMNS, companions, read_csv, weights_in, write_gradebook

    def refuse(message: str) -> int:
        print(f"error: {message}", file=sys.stderr)
        return 2

    written_path = companions(args.csv)[1]
    try:
        weights, split = _weighting(args)
        table = read_csv(args.csv, COLUMNS)
        if args.weights is None:  # the weights the gradebook was written with, not the stars
            weights = weights_in(table)
        rows = [r[:6] for r in table]
        answers = read_csv(written_path, WRITTEN_COLUMNS) if written_path.is_file() else None
        # grades_written.csv is the teacher's (the points awarded): read, never rewritten
        files = write_gradebook(args.csv, rows, answers, weights, split, keep_written=True)
    except FileNotFoundError as e:
        return refuse(f"{e.filename}: no such file; name the gradebook `exercises check --csv` wrote")
    except (OSError, ValueError) as e:
        return refuse(str(e))
    for path in files:
        print(f"wrote {path}")
    return 0


def run_list(args) -> int:
    for ex in EXERCISES.values():
        print(f"{ex.notebook:32} {ex.signature}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m minillm.exercises.cli ACTION ...``: the actions without minillm's own parser."""
    parser = argparse.ArgumentParser(prog="python -m minillm")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["exercises", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
