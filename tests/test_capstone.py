"""The capstone: the package's reference loop with the reference pieces serves a batch and matches the package's
engine token for token, with preemptions and with drafts (a tiny random model: fast); the solution notebook's loop
is its twin; a wrong piece shows where the tokens part; a piece that is missing or breaks the bookkeeping is
refused in words; the default scheduler is exercise 12's answer.

The capstone's graded row: the student's loop, called in a process of its own with the notebook's own pieces and
the provided model (here the tiny one), earns a point per prompt and setting whose tokens are the engine's; a loop
that calls the engine or the package's loop earns 0 and says why; a loop with a wrong step loses the points of
the setting it breaks, with a line saying where the tokens first differ; a course that skipped exercises 12, 7
and 13 gets the default scheduler and loses only the drafts' points."""

import nbformat
import pytest
import torch

from minillm.exercises import EXERCISES, capstone, check
from minillm.exercises.capstone import (PIECES, SETTINGS, ServeResult, compare_with_engine, default_schedule_step,
                                        engine_tokens, serve)
from minillm.exercises.ex_cache import _rope
from minillm.exercises.grading import grade_capstone
from minillm.exercises.notebooks import SOLUTIONS_DIR
from test_engine_beam import V, prompt, tiny  # noqa: F401  (the tiny random model fixture)

SOLUTION = nbformat.read(SOLUTIONS_DIR / "15_capstone.ipynb", as_version=4)


def reference_pieces():
    return {name: EXERCISES[name].reference for name in PIECES}


def prompts():
    return [prompt(n, seed) for seed, n in enumerate((5, 9, 3))]


def cell(start: str) -> str:
    """The source of the solution notebook's code cell that starts with ``start``."""
    return next(c.source for c in SOLUTION.cells if c.cell_type == "code" and c.source.startswith(start))


@pytest.mark.parametrize("gamma", [0, 3])
def test_the_reference_pieces_serve_what_the_engine_serves(tiny, gamma):  # noqa: F811
    # 10 blocks of 4 for three sequences growing to 21 tokens: the scheduler must preempt
    same, text, result = compare_with_engine(serve, tiny, prompts(), reference_pieces(), max_new_tokens=10,
                                             num_blocks=10, num_speculative_tokens=gamma)
    assert same, text
    assert text.count("the same as the engine's") == 3
    assert result.preemptions > 0 or gamma
    assert result.drafted >= result.accepted > 0 if gamma else result.drafted == 0


def test_the_solution_notebooks_loop_is_the_packages_twin(tiny):  # noqa: F811
    namespace = {}
    exec(cell("import torch"), namespace)
    exec(cell("def serve("), namespace)
    for settings in SETTINGS.values():
        ours = namespace["serve"](tiny, prompts(), reference_pieces(), **settings)
        assert isinstance(ours, ServeResult)
        assert ours == serve(tiny, prompts(), reference_pieces(), **settings)
    assert ours.tokens == engine_tokens(tiny, prompts(), 16)


def test_a_wrong_piece_shows_where_the_tokens_part(tiny):  # noqa: F811
    pieces = reference_pieces()
    pieces["rope_at_offset"] = lambda x, start, base: _rope(x, torch.arange(x.shape[2]), base)  # restarts at 0
    same, text, _ = compare_with_engine(serve, tiny, prompts(), pieces, max_new_tokens=6)
    assert not same and "differs from token" in text, text


def test_missing_or_inconsistent_pieces_are_refused(tiny):  # noqa: F811
    pieces = reference_pieces()
    del pieces["slot_mapping"]
    with pytest.raises(ValueError, match="pieces: give your functions slot_mapping"):
        serve(tiny, prompts(), pieces)
    pieces = reference_pieces()
    miscount = lambda d, p, a, f: (d, p, a, f + 1)  # noqa: E731  (one block more than the tables leave)
    pieces["schedule_step"] = lambda *args: miscount(*EXERCISES["schedule_step"].reference(*args))
    with pytest.raises(ValueError, match="schedule_step: says .* blocks are free after the step"):
        serve(tiny, prompts(), pieces)


def test_the_default_scheduler_is_exercise_12s_answer():
    assert check("schedule_step", default_schedule_step, verbose=False, forbid=False).passed
    # the practice check refuses it as an answer to exercise 12
    report = check("schedule_step", lambda *args: default_schedule_step(*args), verbose=False)
    assert report.points == 0 and "default_schedule_step" in report.forbidden


def test_the_practice_comparison_switches_the_engine_off(tiny):  # noqa: F811
    def wraps_the_package(model, prompts, pieces, **kwargs):
        return serve(model, prompts, pieces, **kwargs)

    with pytest.raises(Exception, match="capstone.serve is switched off"):
        compare_with_engine(wraps_the_package, tiny, prompts(), reference_pieces(), max_new_tokens=4)


# ---------------------------------------------------------------------------------------------
# The graded row


@pytest.fixture
def tiny_row(tiny, monkeypatch):  # noqa: F811
    """The capstone's row graded on the tiny model and its prompts (the grader's setup replaced)."""
    expected = engine_tokens(tiny, prompts(), 16)
    monkeypatch.setattr(capstone, "grading_setup", lambda: (tiny, prompts(), expected))
    return expected


def notebook(serve_source: str, **replace) -> nbformat.NotebookNode:
    """The solution notebook's imports and pieces and the given loop (``replace``: piece cell -> new source)."""
    sources = [cell("import torch"), *(replace.get(start, cell(start)) for start in
               ("def cache_update(", "def blocks_needed(", "def top_p_filter(", "def speculative_verify("))]
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources + [serve_source]])


def graded(nb) -> tuple[str, tuple]:
    (text, _), score = grade_capstone(nb, timeout=300)
    return text, score


def test_an_honest_loop_scores_full_marks(tiny_row):
    text, score = graded(notebook(cell("def serve(")))
    assert score == (6.0, 6.0, "passed"), text
    assert text.count("passed  ") == 6 and "a pool that preempts, prompt 2" in text
    assert "calls into minillm: none" in text


@pytest.mark.parametrize("loop, called", [
    ("from minillm import LLM, SamplingParams\n\n"
     "def serve(model, prompts, pieces, *, max_new_tokens=16, **settings):\n"
     "    outputs = LLM(model, block_size=16, num_blocks=64).generate(\n"
     "        [{'prompt_token_ids': p} for p in prompts],\n"
     "        SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True), use_tqdm=False)\n"
     "    return ServeResult([list(o.outputs[0].token_ids) for o in outputs])\n", "minillm.paged.llm.LLM"),
    ("from minillm.exercises.capstone import serve as reference\n\n"
     "def serve(model, prompts, pieces, **settings):\n"
     "    return reference(model, prompts, pieces, **settings)\n", "minillm.exercises.capstone.serve")],
    ids=["minillm.LLM", "capstone.serve"])
def test_a_loop_that_calls_the_engine_scores_zero(tiny_row, loop, called):
    text, score = graded(notebook(loop))
    assert score == (0.0, 6.0, "forbidden"), text
    assert f"your loop called {called}" in text and "0/6 points (0: it calls the implementation it replaces)" in text
    assert f"calls into minillm: {called}" in text


@pytest.mark.slow  # grades two broken loops, each in a process of its own
def test_a_loop_with_a_wrong_step_loses_the_points_of_the_setting_it_breaks(tiny_row):
    solution = cell("def serve(")
    # a preempted sequence keeps its cached count: it is never recomputed, and reads blocks it no longer owns
    no_recompute = solution.replace("tables[i], cached[i] = [], 0", "tables[i] = []")
    assert no_recompute != solution
    text, score = graded(notebook(no_recompute))
    assert score == (5.0, 6.0, "failed"), text
    # the third prompt, preempted and readmitted; a pool that holds everyone (the drafts' run) never preempts
    assert "FAILED  a pool that preempts, prompt 2" in text and text.count("FAILED") == 1
    assert "expected: from token 10: [177, 177, 177" in text and "differs from token 10 on (yours [" in text
    # finished sequences keep their blocks: the pool runs dry and the loop stops with waiting prompts
    no_free = solution.replace("            free += tables[i]\n            tables[i] = []\n", "")
    assert no_free != solution
    text, score = graded(notebook(no_free))
    assert score[0] < 6.0, text
    assert "your loop raised ValueError: schedule_step: nothing scheduled" in text


def test_a_loop_that_skips_the_pieces_earns_nothing(tiny_row):
    # greedy decoding by the model's forward alone, recomputing every token: the engine's tokens, no pieces
    loop = ("def serve(model, prompts, pieces, *, max_new_tokens=16, **settings):\n"
            "    out = []\n"
            "    for p in prompts:\n"
            "        tokens = list(p)\n"
            "        for _ in range(max_new_tokens):\n"
            "            logits = model(torch.tensor([tokens]), torch.arange(len(tokens)))[0, -1]\n"
            "            tokens.append(int(logits.argmax()))\n"
            "        out.append(tokens[len(p):])\n"
            "    return ServeResult(out)\n")
    text, score = graded(notebook(loop))
    assert score == (0.0, 6.0, "failed"), text
    assert "your loop never called cache_update, rope_at_offset, blocks_needed" in text


def test_a_course_that_skipped_exercises_12_7_and_13_reaches_the_capstone(tiny_row):
    student = nbformat.read(SOLUTIONS_DIR.parent / "student" / "15_capstone.ipynb", as_version=4)
    blank = {start: next(c.source for c in student.cells if c.cell_type == "code" and c.source.startswith(start))
             for start in ("def top_p_filter(", "def speculative_verify(")}
    # top_p_filter written, schedule_step left blank; both speculative pieces left blank
    sampling = cell("def top_p_filter(").split("\n\n\ndef schedule_step(")[0] + "\n\n\ndef schedule_step(" + \
        blank["def top_p_filter("].split("\n\n\ndef schedule_step(")[1]
    text, score = graded(notebook(cell("def serve("), **{"def top_p_filter(": sampling,
                                                         "def speculative_verify(": blank["def speculative_verify("]}))
    assert score[:2] == (3.0, 6.0), text
    assert "your loop was given default_schedule_step" in text
    assert "pieces: give your functions speculative_verify, ngram_propose" in text
