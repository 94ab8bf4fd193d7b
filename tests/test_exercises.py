"""The exercise notebooks and their command: student notebooks generated from the solutions (and
committed up to date), each stopping at its first blank, and ``exercises check`` grading a notebook
(students who break the rules: tests/test_grader.py)."""

import argparse
import contextlib
import io
import re
from pathlib import Path

import nbformat
import pytest

from minillm.exercises import EXERCISES
from minillm.exercises.cli import main, register
from minillm.exercises.notebooks import (SOLUTIONS_DIR, STUDENT_DIR, MarkerError, build, exercise_names, out_of_date,
                                         strip_solution)

SOLUTIONS = sorted(SOLUTIONS_DIR.glob("*.ipynb"))
CAPSTONE = "15_capstone.ipynb"


def cli(*argv) -> tuple[int, str]:
    """Run ``python -m minillm exercises ...`` through ``register``: (exit code, stdout + stderr)."""
    parser = argparse.ArgumentParser(prog="python -m minillm")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["exercises", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = args.func(args)
    return code, out.getvalue()


def run_in_process(path: Path) -> tuple[BaseException | None, int]:
    """Execute a notebook's code cells in order in a fresh namespace (in the notebook's folder, output
    captured); returns (the first exception, index of the code cell that raised it)."""
    ns: dict = {"__name__": "__main__"}
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    with contextlib.chdir(path.parent), contextlib.redirect_stdout(io.StringIO()):
        for i, cell in enumerate(cells):
            try:
                exec(compile(cell.source, f"<{path.name} cell {i}>", "exec"), ns)
            except Exception as e:  # the exception is the result under test
                return e, i
    return None, len(cells)


def test_ten_exercises_in_story_order_with_their_notebooks():
    notebooks = sorted({ex.notebook for ex in EXERCISES.values()})
    # the capstone reuses the exercises' functions: it is no exercise's own notebook
    assert len(notebooks) >= 14 and [p.name for p in SOLUTIONS if p.name != CAPSTONE] == notebooks
    for name, ex in EXERCISES.items():
        assert ex.signature.startswith(f"{name}(")
        assert name in exercise_names(nbformat.read(SOLUTIONS_DIR / ex.notebook, as_version=4))


def test_strip_solution_replaces_each_marked_region():
    source = ("import torch\n\ndef f(x):\n    \"\"\"Doc.\"\"\"\n    ### BEGIN SOLUTION\n    y = x + 1\n    return y\n"
              "    ### END SOLUTION\n\n\ndef g():\n    ### BEGIN SOLUTION\n    return 2\n    ### END SOLUTION")
    assert strip_solution(source) == ("import torch\n\ndef f(x):\n    \"\"\"Doc.\"\"\"\n"
                                      "    raise NotImplementedError(\"write this function: f\")\n\n\ndef g():\n"
                                      "    raise NotImplementedError(\"write this function: g\")")
    with pytest.raises(MarkerError, match="never closed"):
        strip_solution("def f():\n    ### BEGIN SOLUTION\n    return 1")
    with pytest.raises(MarkerError, match="without"):
        strip_solution("def f():\n    return 1\n    ### END SOLUTION")


def test_committed_student_notebooks_are_up_to_date():
    assert out_of_date() == [], "run: python -m minillm exercises build"
    assert cli("build", "--check") == (0, "")


def test_student_notebooks_hold_no_solution_and_no_output():
    for path in SOLUTIONS:
        student = nbformat.read(STUDENT_DIR / path.name, as_version=4)
        for cell in student.cells:
            assert "BEGIN SOLUTION" not in cell.source and "END SOLUTION" not in cell.source
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None


def test_build_writes_every_student_notebook(tmp_path):
    written = build(SOLUTIONS_DIR, tmp_path)
    assert [p.name for p in written] == [p.name for p in SOLUTIONS]
    assert all((tmp_path / p.name).read_text() == (STUDENT_DIR / p.name).read_text() for p in SOLUTIONS)
    bad = tmp_path / "bad"
    bad.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1")])
    nbformat.write(nb, bad / "x.ipynb")
    code, text = cli("build", "--solutions", str(bad), "--out", str(tmp_path / "out"))
    assert code == 2 and "x.ipynb" in text and "never closed" in text


def test_build_refuses_an_out_that_is_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for out in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "student"):
        code, text = cli("build", "--out", str(out))
        assert code == 2, text
        assert text == (f"error: --out {out}: {tmp_path / 'notes.txt'} is a file, not a folder; name a folder "
                        "(it is created if missing), or move the file away\n")
    assert (tmp_path / "notes.txt").read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    # a marker error in one notebook writes none of the others
    bad = tmp_path / "bad"
    bad.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), bad / "a.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("### END SOLUTION")]), bad / "b.ipynb")
    assert cli("build", "--solutions", str(bad), "--out", str(tmp_path / "out"))[0] == 2
    assert not (tmp_path / "out").exists()


HEAVY = {"11_paged_attention", "13_speculative_mechanics", "14_quant_formats", "15_capstone"}  # load the model first


@pytest.mark.parametrize("path", [
    pytest.param(STUDENT_DIR / p.name, id=p.stem, marks=[pytest.mark.slow] * (p.stem in HEAVY)) for p in SOLUTIONS])
def test_student_notebook_stops_at_its_first_blank(path):
    error, cell = run_in_process(path)
    names = exercise_names(nbformat.read(path, as_version=4))
    assert isinstance(error, NotImplementedError), f"cell {cell} raised {error!r}"
    if path.name == CAPSTONE:  # its pieces are pasted in; its first blank is the serving loop
        assert str(error) == "write this function: serve"
    else:
        assert str(error) == f"write this function: {names[0]}"


@pytest.mark.slow  # starts a kernel
def test_check_command_grades_notebooks(tmp_path):
    # a student's notebook with a wrong top-p (keeps one token too few) and an unfinished one
    nb = nbformat.read(STUDENT_DIR / "10_top_p.ipynb", as_version=4)
    for cell in nb.cells:
        cell.source = cell.source.replace(
            'raise NotImplementedError("write this function: top_p_filter")',
            "sp, order = probs.sort(-1, descending=True)\n"
            "    kept = torch.zeros_like(probs).scatter(-1, order, sp.masked_fill(sp.cumsum(-1) > top_p, 0.0))\n"
            "    return kept / kept.sum(-1, keepdim=True)")
    nbformat.write(nb, tmp_path / "10_top_p.ipynb")
    code, text = cli("check", str(tmp_path / "10_top_p.ipynb"), str(STUDENT_DIR / "05_block_table.ipynb"))
    assert code == 1
    assert "one token too few" in text and "top_p_filter: " in text
    for name in ("blocks_needed", "slot_mapping", "needs_new_block"):
        assert re.search(rf"{name}: 0/\d+ cases passed", text), text
    assert "not written yet" in text and "Traceback" not in text
    # run by a real kernel too, the unfinished notebook stops at its blank and nowhere else
    nb = nbformat.read(STUDENT_DIR / "05_block_table.ipynb", as_version=4)
    demo = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "blocks_needed(" in c.source
                and "def blocks_needed" not in c.source)
    raised = [line for line in text.splitlines() if " raised " in line]
    assert raised == [f"cell {demo + 1} (`{nb.cells[demo].source.splitlines()[0].strip()[:60]}`) raised "
                      "NotImplementedError: write this function: blocks_needed"], raised


@pytest.mark.slow  # starts a kernel
def test_check_command_passes_a_solution_notebook():
    code, text = cli("check", str(SOLUTIONS_DIR / "06_copy_on_write.ipynb"))
    assert code == 0, text
    assert re.search(r"append_token_cow: (\d+)/\1 cases passed \(all passed\)", text) and "PASSED" in text


def test_check_command_refuses_a_notebook_without_exercises(tmp_path):
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), tmp_path / "empty.ipynb")
    code, text = cli("check", str(tmp_path / "empty.ipynb"))
    assert code == 1 and "defines none of the exercise functions" in text


def test_list_names_every_exercise(capsys):
    code, text = cli("list")
    assert code == 0 and all(ex.signature in text for ex in EXERCISES.values())
    assert main(["list"]) == 0 and capsys.readouterr().out == text  # python -m minillm.exercises.cli list


def test_check_command_tells_a_path_that_is_no_notebook_from_a_failing_grade(tmp_path):
    (tmp_path / "notes.md").write_text("# not a notebook")
    code, text = cli("check", str(tmp_path / "missing.ipynb"), str(tmp_path / "notes.md"))
    assert code == 2 and text.count(": not a notebook (") == 2, text
    code, text = cli("check", str(tmp_path / "notes.md"), "--timeout", "0")  # 0 would mean no timeout to nbclient
    assert code == 2 and text.startswith("error: --timeout 0: give the seconds a cell may run"), text
