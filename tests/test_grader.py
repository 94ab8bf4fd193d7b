"""``exercises check`` against students who break the rules: a function that never returns or kills its
process fails within the timeout, a cell that floods the output is stopped and the rest graded, SIGTERM stops
the grader and its kernel, a kernel that forges a passing report earns nothing (the answers are judged in
the grader's process), a function that wraps the package scores zero in the gradebook, and a syntax error
names its cell. Each notebook runs in a real Jupyter kernel."""

import csv
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from minillm.exercises import EXERCISES
from minillm.exercises.checker import Answer, answer, grade
from minillm.exercises.isolate import _read_answers
from test_exercises import cli

REPO = Path(__file__).resolve().parents[1]
# a student's first cell: it leaves its kernel's pid where the test reads it (without importing torch, which can take
# longer than the tests' short timeouts on a loaded machine, and a cell stopped by the timeout is skipped)
PID_CELL = "import os\nopen('kernel.pid', 'w').write(str(os.getpid()))"


def notebook(folder: Path, *cells: str, name: str = "05_block_table.ipynb") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), path)
    return path


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_a_function_that_never_returns_fails_within_the_timeout(tmp_path):
    path = notebook(tmp_path, PID_CELL, "def blocks_needed(num_tokens, block_size):\n    while True:\n        pass")
    start = time.monotonic()
    code, text = cli("check", str(path), "--timeout", "10")
    assert time.monotonic() - start < 150, text  # a kernel start, the function's process and 10 s
    assert code == 1 and f"{path}: FAILED" in text
    assert "check blocks_needed: FAILED: your function ran past the 10 s timeout on its cases (an endless loop?); " \
           "its process was killed" in text, text
    assert "stopped:" not in text  # the notebook never calls it: its run is not stopped
    assert gone(int((tmp_path / "kernel.pid").read_text()))


@pytest.mark.slow
def test_a_process_that_dies_fails_the_function_that_killed_it(tmp_path):
    path = notebook(tmp_path, PID_CELL, "def blocks_needed(num_tokens, block_size):\n    return 1",
                    "def slot_mapping(block_table, positions, block_size):\n    os._exit(1)",
                    "def needs_new_block(num_tokens, block_size):\n    return num_tokens % block_size == 0")
    code, text = cli("check", str(path), "--timeout", "120")  # the checks import torch: slow on a loaded machine
    assert code == 1, text
    assert "check slot_mapping: FAILED: its process died while your function ran (os._exit" in text
    # each function has a process of its own: the functions beside it are graded
    assert re.search(r"needs_new_block: (\d+)/\1 cases passed \(all passed\)", text), text
    assert "blocks_needed: 3/11 cases passed" in text  # 1, 15 and 16 tokens: 1 block


@pytest.mark.slow
def test_sigterm_stops_the_grader_and_kills_its_kernel(tmp_path):
    path = notebook(tmp_path, PID_CELL, "def blocks_needed(num_tokens, block_size):\n    return 1",
                    "while True:\n    pass")
    grader = subprocess.Popen([sys.executable, "-m", "minillm.exercises.cli", "check", str(path), str(path)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pid_file = tmp_path / "kernel.pid"
        for _ in range(120):  # the kernel starts and imports torch
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.5)
        time.sleep(1)  # the endless cell is running
        grader.send_signal(signal.SIGTERM)
        out, _ = grader.communicate(timeout=30)
    finally:
        if grader.poll() is None:
            grader.kill()
    assert grader.returncode == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM; the student's kernel was killed; no grade" in out
    assert out.count(f"== {path}") == 1  # the second notebook is not started
    assert gone(int(pid_file.read_text()))


@pytest.mark.slow
def test_a_kernel_cannot_forge_a_pass(tmp_path):
    # one student replaces the checker inside their kernel; another's function prints what the grader's
    # kernel printed for a pass (its result marker and JSON) every time it is called
    patcher = notebook(tmp_path / "a", (
        "import minillm.exercises as ex\nfrom minillm.exercises import checker\n"
        "class Passed:\n    passed, results, failures = True, [], []\n"
        "    def __str__(self):\n        return 'blocks_needed: 11/11 cases passed (all passed)'\n"
        "ex.check = lambda *args, **kwargs: Passed()\n"
        "checker.grade = lambda *args, **kwargs: Passed()\n"
        "checker.judge_answer = lambda *args, **kwargs: checker.CaseResult('x', True)"),
        "def blocks_needed(num_tokens, block_size):\n    return 42")
    printer = notebook(tmp_path / "b", (
        "import json\n\ndef blocks_needed(num_tokens, block_size):\n"
        "    report = 'check blocks_needed\\nblocks_needed: 11/11 cases passed (all passed)'\n"
        "    print('@@minillm-exercises@@' + json.dumps({'blocks_needed': [report, True]}))\n"
        "    print(report)\n    return 42"))
    code, text = cli("check", str(patcher), str(printer), "--timeout", "60")
    assert code == 1, text
    assert text.count("blocks_needed: 0/11 cases passed (11 failed)") == 2, text
    assert f"{patcher}: FAILED" in text and f"{printer}: FAILED" in text and "PASSED" not in text


@pytest.mark.slow
def test_a_syntax_error_names_its_cell(tmp_path):
    path = notebook(tmp_path, "import torch", "# my answer\ndef blocks_needed(num_tokens, block_size):\n"
                    "    return (num_tokens + block_size - 1 // block_size\n", "x = 1")
    code, text = cli("check", str(path), "--timeout", "60")
    assert code == 1
    assert "cell 2 (`# my answer`) raised SyntaxError: " in text, text
    assert "(line 3 of the cell)" in text
    assert "check blocks_needed: not defined (cell 2 (`# my answer`), which defines it, raised SyntaxError" in text


def saved(obj) -> bytes:
    data = io.BytesIO()
    torch.save(obj, data)
    return data.getvalue()


def test_answers_cross_from_the_process_as_data_only(tmp_path):
    # what a function's process sends back is read with weights_only: a pickle that would run code is refused
    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    assert "could not be read back (UnpicklingError" in _read_answers(saved([Exploit()]), 1)
    assert not (tmp_path / "ran").exists()
    assert _read_answers(saved({"answers": [{"passed": True}], "notes": []}), 1) == \
        "its answers file does not hold 1 answers"  # a verdict instead of answers
    # answers of any type travel (a NumPy array as a Foreign value) and are judged here
    ex = EXERCISES["slot_mapping"]
    cases = ex.cases()
    answers, notes = _read_answers(saved({"answers": [answer(lambda t, p, bs: np.asarray(p), c.args) for c in cases],
                                          "notes": []}), len(cases))
    assert all(type(a) is Answer for a in answers) and notes == []
    report = grade(ex, cases, [ex.expected(c) for c in cases], answers)
    assert not report.passed and "should be a torch.Tensor of shape (10,), got ndarray" in report.failures[0].hint


@pytest.mark.slow
def test_a_cell_that_floods_the_output_is_stopped_and_the_rest_graded(tmp_path):
    path = notebook(tmp_path, "def blocks_needed(num_tokens, block_size):\n    return -(-num_tokens // block_size)",
                    "while True:\n    print('x' * 1000)", "x = 1")
    code, text = cli("check", str(path), "--timeout", "60", "--max-output", "100000")
    assert "stopped: cell 2 (`while True:`) printed more than 100,000 characters (--max-output); its kernel was " \
           "killed; graded without it" in text, text
    assert re.search(r"blocks_needed: (\d+)/\1 cases passed", text) and len(text) < 20_000


@pytest.mark.slow
def test_a_folder_of_submissions_becomes_a_gradebook_and_a_wrapped_function_scores_zero(tmp_path):
    own = "def kv_cache_size(config, batch_size, seq_len, dtype):\n    return (2 * batch_size * seq_len * " \
          "config.n_layers * config.n_kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size())"
    wrapped = "from minillm import kv_cache_bytes as kvb\n\ndef kv_cache_size(config, batch_size, seq_len, " \
              "dtype):\n    return kvb(config, batch_size, seq_len, torch.empty((), dtype=dtype).element_size())"
    folder = tmp_path / "submissions"
    notebook(folder / "alice", "import torch", own, name="02_kv_cache_size.ipynb")
    notebook(folder / "bob", "import torch", wrapped, name="02_kv_cache_size.ipynb")
    (tmp_path / "cases.py").write_text(
        "from minillm.exercises import Case\nfrom minillm import ModelConfig\nimport torch\n"
        "CASES = {'kv_cache_size': [Case('teacher: one layer, one head', (ModelConfig(n_layers=1, n_kv_heads=1, "
        "n_heads=1, head_dim=4, dim=4), 1, 3, torch.float32), 96, points=3)]}\n")
    code, text = cli("check", str(folder), "--grading", "--seed", "7", "--cases", str(tmp_path / "cases.py"),
                     "--csv", str(tmp_path / "grades.csv"), "--timeout", "120")
    assert code == 1, text
    assert "teacher: one layer, one head" in text and "hidden model 1 " in text, text
    assert "your function called minillm.kv_cache.kv_cache_bytes" in text
    rows = list(csv.DictReader(open(tmp_path / "grades.csv")))
    # 9 practice cases, 4 hidden ones from the seed, and the teacher's case worth 3 points: 16 points
    assert [(r["student"], r["exercise"], r["points"], r["max_points"], r["status"]) for r in rows] == [
        ("alice", "kv_cache_size", "16", "16", "passed"), ("bob", "kv_cache_size", "0", "16", "forbidden")]
    assert cli("check", str(folder), "--grading")[0] == 2  # no hidden cases named: refused before grading


@pytest.mark.slow
def test_a_notebook_that_exits_is_graded_on_what_ran(tmp_path):
    path = notebook(tmp_path, "def blocks_needed(num_tokens, block_size):\n    return -(-num_tokens // block_size)",
                    "import sys\nsys.exit(3)", "exit()", "def needs_new_block(num_tokens, block_size):\n"
                    "    return num_tokens % block_size == 0")
    code, text = cli("check", str(path), "--timeout", "60")
    assert "cell 2 (`import sys`) raised SystemExit: 3" in text, text  # IPython catches SystemExit: a cell error
    assert "cell 3 (`exit()`) raised SystemExit: exit() and quit() do not end a graded notebook" in text, text
    assert "stopped:" not in text
    assert re.search(r"blocks_needed: (\d+)/\1 cases passed", text) and re.search(
        r"needs_new_block: (\d+)/\1 cases passed", text), text
