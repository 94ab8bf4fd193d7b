"""Grading that isolates each notebook and runs only the student's function: the cheats that scored full
marks score 0 with a line saying why, honest work still scores full marks, a notebook that breaks its own run
fails its own rows while the class is graded and the gradebook written, the gradebook's path is refused
before any grading, and a looping function costs one timeout. The cheats' notebooks run in real kernels;
the guard of the function's process is tested on that process alone."""

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

import minillm

from minillm.exercises import EXERCISES
from minillm.exercises.checker import grade
from minillm.exercises.isolate import call_in_fresh_process, sources
from minillm.exercises.notebooks import SOLUTIONS_DIR
from test_exercises import cli
from test_grader import notebook

KV_OWN = ("def kv_cache_size(config, batch_size, seq_len, dtype):\n    return (2 * batch_size * seq_len * "
          "config.n_layers * config.n_kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size())")
BYTES = "torch.empty((), dtype=dtype).element_size()"

# the five ways around the old guard, each of which scored full marks with hidden and teacher cases
CHEATS = {
    # the package's other public API, the comparison the exercise notebook prints
    "api": ["import torch\nfrom minillm import KVCache",
            "def kv_cache_size(config, batch_size, seq_len, dtype):\n"
            "    return KVCache(config, batch_size, seq_len, dtype, device='meta').nbytes"],
    # a copy of the replaced function's code made in an earlier cell, before grading switched it off
    "code_copy": ["import torch, types\nfrom minillm import kv_cache_bytes\n_code = kv_cache_bytes.__code__",
                  "def kv_cache_size(config, batch_size, seq_len, dtype):\n    return types.FunctionType(_code, "
                  f"kv_cache_bytes.__globals__)(config, batch_size, seq_len, {BYTES})"],
    # the grader's cell imported answer_cases inside the kernel: the notebook decided what the answers were
    "answer_cases": [
        "import torch\nimport minillm.exercises.grading as grading\nfrom minillm import kv_cache_bytes\n"
        "from minillm.exercises.checker import answer\n\n"
        "def fake(name, fn, cases_path, answers_path):\n    cases = torch.load(cases_path, weights_only=False)\n"
        "    real = lambda c, b, s, dtype: kv_cache_bytes(c, b, s, " + BYTES + ")\n"
        "    torch.save([answer(real, args) for args in cases], answers_path)\n\ngrading.answer_cases = fake",
        "def kv_cache_size(config, batch_size, seq_len, dtype):\n    return -1"],
    # the grader's cases file read from its temporary folder, answered while the package still worked
    "cases_file": [
        "import glob, os, tempfile, torch\nfrom minillm import kv_cache_bytes\nANSWERS = {}\n"
        "for path in glob.glob(os.path.join(tempfile.gettempdir(), 'minillm-grading-*', 'kv_cache_size.cases.pt')):\n"
        "    for c, b, s, dtype in torch.load(path, weights_only=False):\n"
        "        ANSWERS[repr((c, b, s, dtype))] = kv_cache_bytes(c, b, s, " + BYTES + ")",
        "def kv_cache_size(config, batch_size, seq_len, dtype):\n"
        "    return ANSWERS[repr((config, batch_size, seq_len, dtype))]"],
    # the guard replaced by a no-op, then a plain wrapper
    "no_op_guard": ["import contextlib, torch\nimport minillm.exercises.grading as grading\n"
                    "from minillm import kv_cache_bytes\ngrading.forbidden = lambda *args: contextlib.nullcontext()",
                    "def kv_cache_size(config, batch_size, seq_len, dtype):\n"
                    f"    return kv_cache_bytes(config, batch_size, seq_len, {BYTES})"],
}
WHY = {"api": "your function called minillm.kv_cache.KVCache.__init__",
       "code_copy": "your function raised NameError: name '_code' is not defined",
       "answer_cases": "got:      -1",
       "cases_file": "your function raised KeyError",
       "no_op_guard": "your function called minillm.kv_cache.kv_cache_bytes"}


@pytest.mark.slow
def test_the_kept_cheats_score_zero_and_honest_work_full_marks(tmp_path):
    folder = tmp_path / "submissions"
    for student, cells in CHEATS.items():
        notebook(folder / student, *cells, name="02_kv_cache_size.ipynb")
    (folder / "honest").mkdir(parents=True)
    shutil.copy(SOLUTIONS_DIR / "02_kv_cache_size.ipynb", folder / "honest")
    (tmp_path / "cases.py").write_text(
        "from minillm.exercises import Case\nfrom minillm import ModelConfig\nimport torch\n"
        "CASES = {'kv_cache_size': [Case('teacher: one layer, one head', (ModelConfig(n_layers=1, n_kv_heads=1, "
        "n_heads=1, head_dim=4, dim=4), 1, 3, torch.float32), 96, points=3)]}\n")
    code, text = cli("check", str(folder), "--grading", "--seed", "4711", "--cases", str(tmp_path / "cases.py"),
                     "--csv", str(tmp_path / "grades.csv"), "--timeout", "120")
    assert code == 1, text
    rows = {r["student"]: r for r in csv.DictReader(open(tmp_path / "grades.csv"))}
    assert (rows["honest"]["points"], rows["honest"]["max_points"], rows["honest"]["status"]) == ("16", "16", "passed")
    reports = dict(re.findall(r"== \S+/(\w+)/02_kv_cache_size.ipynb\n(.*?)(?=\n== |\Z)", text, re.DOTALL))
    for student in CHEATS:
        assert rows[student]["points"] == "0", (student, reports[student])
        assert WHY[student] in reports[student], (student, reports[student])
    assert "calls into minillm: minillm.kv_cache.KVCache.__init__" in reports["api"]
    assert "calls into minillm: minillm.kv_cache.kv_cache_bytes" in reports["no_op_guard"]
    assert "calls into minillm: none" in reports["honest"]
    assert (rows["api"]["status"], rows["no_op_guard"]["status"]) == ("forbidden", "forbidden")


def graded(fn_source: str, name: str = "kv_cache_size", imports=("import torch",)):
    """Grade one function's source in its own process, as the grader does: the report."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("\n".join(imports)),
                                         nbformat.v4.new_code_cell(fn_source)])
    ex = EXERCISES[name]
    cases = ex.cases()
    answers, notes = call_in_fresh_process(name, sources(nb)[name], cases, timeout=120)
    assert answers is not None, notes
    report = grade(ex, cases, [ex.expected(c) for c in cases], answers)
    report.calls = list(dict.fromkeys(c for a in answers for c in a.calls))
    return report, notes


PACKAGE = Path(minillm.__file__).parent


@pytest.mark.slow
@pytest.mark.parametrize("source, called", [
    # the package's source read from disk and run: the files of the package cannot be opened
    ("def kv_cache_size(config, batch_size, seq_len, dtype):\n    import minillm\n    ns = {}\n"
     "    exec(open(minillm.__file__.replace('__init__.py', 'kv_cache.py')).read(), ns)\n"
     f"    return ns['kv_cache_bytes'](config, batch_size, seq_len, {BYTES})", "open " + str(PACKAGE / "kv_cache.py")),
    # the checker's references: minillm.exercises cannot be imported
    ("def kv_cache_size(config, batch_size, seq_len, dtype):\n    from minillm.exercises import ex_cost\n"
     "    return ex_cost.KV_SIZE.reference(config, batch_size, seq_len, dtype)", "import minillm.exercises"),
    # the original code (or the guard's switch) hunted in the garbage collector: refused
    ("def kv_cache_size(config, batch_size, seq_len, dtype):\n    import gc, types\n"
     "    for f in gc.get_objects():\n        if type(f) is types.FunctionType and f.__name__ == 'kv_cache_bytes':\n"
     "            try:\n                return f(config, batch_size, seq_len, " + BYTES + ")\n"
     "            except Exception:\n                pass", "gc.get_objects"),
    # the guard's switch reached through the recorder the switched-off code calls: it holds no switch
    ("def kv_cache_size(config, batch_size, seq_len, dtype):\n    import sys\n"
     "    for cell in sys.modules['__main__'].switched_off.__closure__:\n"
     "        if isinstance(cell.cell_contents, dict):\n            cell.cell_contents['cases'] = False\n"
     "    import minillm\n    ns = {}\n"
     "    exec(open(minillm.__file__.replace('__init__.py', 'kv_cache.py')).read(), ns)\n"
     f"    return ns['kv_cache_bytes'](config, batch_size, seq_len, {BYTES})", "open " + str(PACKAGE / "kv_cache.py")),
    # native code: ctypes reaches the interpreter's C API
    ("def kv_cache_size(config, batch_size, seq_len, dtype):\n    import ctypes\n"
     "    ctypes.pythonapi.Py_IncRef(ctypes.py_object(config))\n    return 0", "ctypes."),
    # a copy made as the function is defined (a default argument): defined after the switch-off
    ("def kv_cache_size(config, batch_size, seq_len, dtype, _f=kv_cache_bytes.__code__):\n    import types\n"
     f"    return types.FunctionType(_f, {{}})(config, batch_size, seq_len, {BYTES})",
     "minillm.kv_cache.kv_cache_bytes"),
    # the call's error caught and the own formula used: the call still counts
    ("def kv_cache_size(config, batch_size, seq_len, dtype):\n    try:\n"
     "        return KVCache(config, batch_size, seq_len, dtype, device='meta').nbytes\n    except Exception:\n"
     "        return 2 * batch_size * seq_len * config.n_layers * config.n_kv_heads * config.head_dim * " + BYTES,
     "minillm.kv_cache.KVCache.__init__"),
    # a new module of the package loaded during the cases
    ("def kv_cache_size(config, batch_size, seq_len, dtype):\n    from minillm.lab import tour\n    return 0",
     "import minillm.lab"),
])
def test_the_function_process_refuses_the_ways_back_to_the_package(source, called):
    report, _ = graded(source, imports=("import torch", "from minillm import KVCache, kv_cache_bytes"))
    assert report.points == 0 and report.forbidden, report
    assert any(c.startswith(called) for c in report.calls), report.calls
    assert f"your function called {called}" in report.failures[0].got, report.failures[0]


@pytest.mark.slow
def test_a_function_gets_its_helpers_and_constants_but_not_the_notebooks_state():
    helpers = ("BYTES_PER = {'float32': 4}\n\ndef per_element(dtype):\n    return torch.empty((), dtype=dtype)"
               ".element_size()\n\n" + KV_OWN.replace(BYTES, "per_element(dtype)"))
    report, notes = graded(helpers)
    assert report.passed and report.calls == [] and notes == [], report
    # the config class a case passes stays on, as torch does; a name set by running a cell does not exist
    report, _ = graded("SCALE = 2 * 1\n\n" + KV_OWN.replace("2 *", "SCALE *"))
    assert not report.passed and "NameError: name 'SCALE' is not defined" in report.failures[0].got
    assert "a name that another cell sets at run time does not exist there" in report.failures[0].hint


def write_raw(path: Path, cells: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


@pytest.mark.slow
def test_a_notebook_that_breaks_its_run_fails_its_own_rows_and_the_class_is_graded(tmp_path, monkeypatch):
    # the grader's temporary files go to a folder of this test's own (the kernel inherits TMPDIR)
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    own = "def blocks_needed(num_tokens, block_size):\n    return -(-num_tokens // block_size)"
    folder = tmp_path / "submissions"
    # an output nbformat rejects
    notebook(folder / "a", "from IPython.display import display\ndisplay({'text/plain': 5}, raw=True)", own)
    # a cell source that is a number
    write_raw(folder / "b" / "05_block_table.ipynb", [
        {"cell_type": "code", "source": 5, "metadata": {}, "outputs": [], "execution_count": None}])
    # every file and folder of the grader's in the temporary folder swapped for a symlink
    notebook(folder / "c", "import glob, os, shutil, tempfile\n"
             "for p in glob.glob(os.path.join(tempfile.gettempdir(), '*')):\n"
             "    shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)\n"
             "    os.symlink('/', p)", own)
    notebook(folder / "d", own)
    code, text = cli("check", str(folder), "--csv", str(tmp_path / "grades.csv"), "--timeout", "60")
    assert code == 2, text  # one path is no notebook
    rows = [(r["student"], r["exercise"], r["points"], r["status"])
            for r in csv.DictReader(open(tmp_path / "grades.csv"))]
    assert rows == [("a", "blocks_needed", "11", "passed"), ("b", "", "0", "not a notebook"),
                    ("c", "blocks_needed", "11", "passed"), ("d", "blocks_needed", "11", "passed")], text
    assert "stopped: the notebook's run broke off (NotebookValidationError" in text
    assert "b/05_block_table.ipynb: not a valid notebook (cell 1's source: 5 is not valid under any of the given " \
           "schemas); open it in Jupyter" in text, text
    assert "Traceback" not in text


@pytest.mark.parametrize("make, says", [
    (lambda tmp: tmp / "missing" / "grades.csv", "does not exist"),
    (lambda tmp: tmp, "is a folder"),
    (lambda tmp: (tmp / "ro").mkdir(mode=0o555) or tmp / "ro" / "grades.csv", "cannot be written"),
])
def test_the_gradebooks_path_is_refused_before_any_grading(tmp_path, make, says):
    if says == "cannot be written" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    path = notebook(tmp_path / "alice", "def blocks_needed(num_tokens, block_size):\n    return 1")
    start = time.monotonic()
    code, text = cli("check", str(path), "--csv", str(make(tmp_path)))
    assert code == 2 and "error: --csv: " in text and says in text, text
    assert "==" not in text and time.monotonic() - start < 5  # nothing graded


@pytest.mark.slow
def test_a_looping_function_costs_one_timeout(tmp_path):
    path = notebook(tmp_path, "def blocks_needed(num_tokens, block_size):\n    while True:\n        pass",
                    "blocks_needed(3, 4)", "from minillm.exercises import check\n"
                    "report = check('blocks_needed', blocks_needed)", "blocks_needed(5, 4)",
                    "def needs_new_block(num_tokens, block_size):\n    return num_tokens % block_size == 0")
    start = time.monotonic()
    code, text = cli("check", str(path), "--timeout", "10", "--csv", str(tmp_path / "grades.csv"))
    elapsed = time.monotonic() - start
    assert code == 1, text
    # one timeout, in the first cell that called it; the check cell and the grader do not call it again
    assert text.count("ran past the 10 s timeout") == 2, text  # the stop line and the function's report
    assert "stopped: cell 2 (`blocks_needed(3, 4)`) ran past the 10 s timeout (--timeout); its kernel was killed; " \
           "graded without it" in text
    assert "check blocks_needed: FAILED: your function ran past the 10 s timeout in cell 2 (`blocks_needed(3, 4)`) " \
           "(an endless loop?); the grader does not call it again" in text
    assert "cell 4 (`blocks_needed(5, 4)`) raised TimeoutError: blocks_needed ran past the grader's timeout in an " \
           "earlier cell; the grader does not call it again" in text
    assert re.search(r"needs_new_block: (\d+)/\1 cases passed", text), text
    rows = [(r["exercise"], r["status"]) for r in csv.DictReader(open(tmp_path / "grades.csv"))]
    assert rows == [("blocks_needed", "stopped"), ("needs_new_block", "passed")]
    print(f"a looping notebook at --timeout 10: {elapsed:.1f} s")  # measured, never asserted (a loaded machine)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXERCISES))
def test_every_solution_scores_full_marks_in_its_own_process(name):
    # the package is off but for the config classes and the exercise's tools (AWQ's rtn_quantize)
    ex = EXERCISES[name]
    cases = ex.grading_cases(seed=4711)
    nb = nbformat.read(SOLUTIONS_DIR / ex.notebook, as_version=4)
    answers, notes = call_in_fresh_process(name, sources(nb)[name], cases, timeout=300)
    assert answers is not None and notes == [], notes
    report = grade(ex, cases, [ex.expected(c) for c in cases], answers)
    assert report.passed and not any(a.calls for a in answers), report


def runner_processes(parent: int) -> list[int]:
    """Graded functions' processes started by ``parent`` (their command line holds the runner's text)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"minillm-runner-ready" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_sigterm_while_a_function_is_graded_kills_its_process(tmp_path):
    path = notebook(tmp_path, "def blocks_needed(num_tokens, block_size):\n    while True:\n        pass")
    grader = subprocess.Popen([sys.executable, "-m", "minillm.exercises.cli", "check", str(path)],
                              cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):  # the notebook runs (a kernel start), then the function's process starts
            children = runner_processes(grader.pid)
            if children:
                break
            time.sleep(0.5)
        assert children, "no function's process started"
        time.sleep(2)
        grader.send_signal(signal.SIGTERM)
        out, _ = grader.communicate(timeout=60)
    finally:
        if grader.poll() is None:
            grader.kill()
    assert grader.returncode == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM" in out and "no grade" in out
    time.sleep(1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in children)  # killed, and reaped by the grader


@pytest.mark.slow
def test_a_loop_costs_one_timeout_when_the_notebook_takes_the_stack_signal(tmp_path):
    # the kernel sends no stacks: the function the stopped cell calls is the one not called again
    path = notebook(tmp_path, "import signal\nsignal.signal(signal.SIGUSR1, signal.SIG_IGN)",
                    "def blocks_needed(num_tokens, block_size):\n    while True:\n        pass",
                    "x = 1\nblocks_needed(3, 4)", "blocks_needed(5, 4)")
    code, text = cli("check", str(path), "--timeout", "10")
    assert code == 1 and text.count("ran past the 10 s timeout") == 2, text
    assert "the grader does not call it again" in text and "cell 4 (`blocks_needed(5, 4)`) raised TimeoutError" in text


@pytest.mark.slow
def test_a_grader_killed_outright_takes_the_functions_process_with_it():
    grader = subprocess.Popen([sys.executable, "-c", (
        "import nbformat\nfrom minillm.exercises import EXERCISES\n"
        "from minillm.exercises.isolate import call_in_fresh_process, sources\n"
        "nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("
        "'def blocks_needed(num_tokens, block_size):\\n    while True:\\n        pass')])\n"
        "call_in_fresh_process('blocks_needed', sources(nb)['blocks_needed'], EXERCISES['blocks_needed'].cases(),"
        " 600)")])
    try:
        for _ in range(600):
            children = runner_processes(grader.pid)
            if children:
                break
            time.sleep(0.1)
        assert children, "no function's process started"
        time.sleep(20)  # its start is over (torch imported, the job read): it spins in the student's loop
    finally:
        grader.kill()  # SIGKILL: no cleanup of the grader's runs
        grader.wait()
    for _ in range(100):
        if not any(Path(f"/proc/{pid}").exists() for pid in children):
            break
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in children)
