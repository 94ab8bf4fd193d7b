"""Classroom exercises: a student writes the key functions of fast inference, and ``check`` says
what is wrong with each answer.

Each exercise is one notebook (``notebooks/exercises/solutions/``, the answers between
``### BEGIN SOLUTION`` / ``### END SOLUTION``; ``notebooks/exercises/student/``, generated from
them by ``python -m minillm exercises build``). ``check(name, fn)`` runs ``fn`` on hand-made cases
with known answers, then on random cases against the package's own implementation, and prints one
line per case: passed, or what was expected, what came back and a hint naming the typical mistake.

    >>> from minillm.exercises import EXERCISES, check
    >>> report = check("kv_cache_size", my_kv_cache_size)   # doctest: +SKIP
    >>> report.passed, [f.hint for f in report.failures]    # doctest: +SKIP

``EXERCISES`` maps each function's name to its ``Exercise`` (signature, notebook, the package code
it follows). Teachers: notebooks/exercises/README.md.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from .checker import Answer, Case, CaseResult, Exercise, Failure, Report, answer, grade
from .ex_blocks import BLOCK_EXERCISES, COPY_ON_WRITE
from .ex_cache import ROPE, UPDATE
from .ex_cost import COST, KV_SIZE
from .ex_quant import AWQ, GPTQ
from .ex_engine import GATHER, ONLINE, SCHEDULE
from .ex_formats import BITRATE, PACK, RTN
from .ex_sampling import TOP_P, VERIFY
from .ex_spec import NGRAM, ROLLBACK
from .forbid import ForbiddenCallError, forbidden

# in the order of the story: cost model, KV cache, paging, speculative decoding, quantization, sampling; then
# the engine's inner steps (attention over blocks, the scheduler, prompt lookup and rollback) and the file formats
EXERCISES: dict[str, Exercise] = {ex.name: ex for ex in (
    COST, KV_SIZE, UPDATE, ROPE, *BLOCK_EXERCISES, COPY_ON_WRITE, VERIFY, GPTQ, AWQ, TOP_P,
    GATHER, ONLINE, SCHEDULE, NGRAM, ROLLBACK, RTN, PACK, BITRATE)}

# each exercise's difficulty, as docs/course.md's table gives it (one star: a formula from the lesson; two: a rule with
# a boundary case; three: an algorithm with state; four: several algorithms together), and the capstone's (its
# notebook's rows): the gradebook's default weights, so that a function's weight does not grow with its case count
STARS: dict[str, int] = {
    "kv_cache_size": 1, "blocks_needed": 1, "slot_mapping": 1, "needs_new_block": 1, "cache_update": 1,
    "rollback_after_verify": 1, "top_p_filter": 2, "rope_at_offset": 2, "ngram_propose": 2, "rtn_scale_zero": 2,
    "pack_q4k_scales": 2, "append_token_cow": 2, "paged_gather": 2, "forward_flops_bytes": 3, "schedule_step": 3,
    "online_softmax_attention": 3, "speculative_verify": 3, "choose_bitrate": 3, "awq_search_scale": 3,
    "gptq_quantize_columns": 4, "capstone": 4}


def check(name: str, fn: Callable, verbose: bool = True, *, forbid: bool = True) -> Report:
    """Run the student's ``fn`` on every case of exercise ``name``; print a line per case if verbose.

    Cases are the same at every call (seeded with ``checker.SEED``). Nothing the student's function
    raises escapes: it is reported, in words, as that case's failure. While it runs, the package code
    it replaces raises ``ForbiddenCallError`` (``forbid.py``): a function that calls it earns 0 points
    (``forbid=False`` leaves it on: the tests run the package's own implementation through the check).

    Returns:
        ``Report`` with ``passed`` and ``failures`` (each with its case name, expected, got and hint).

    Raises:
        KeyError: ``name`` is not an exercise (the message lists them).
        TypeError: ``fn`` is not callable.
    """
    if name not in EXERCISES:
        raise KeyError(f"exercise {name!r}: not one of {', '.join(EXERCISES)}")
    if not callable(fn):
        raise TypeError(f"fn: pass the function itself (check({name!r}, {name})), got {type(fn).__name__}")
    ex = EXERCISES[name]
    cases = ex.cases()

    def answers():  # the package code the exercise replaces raises while the student's function runs
        for c in cases:
            with forbidden(name, ex.forbidden) if forbid else contextlib.nullcontext():
                ans = answer(fn, c.args)
            yield ans

    # lazy: each case is called and judged in turn, so that a slow or stuck case shows where it is
    report = grade(ex, cases, (ex.expected(c) for c in cases), answers(),
                   on_result=lambda result: print(result.line()) if verbose else None)
    if verbose:
        if report.unwritten:  # not written yet: one line says it for every case
            print(f"  FAILED  all {len(cases)} cases: {report.unwritten}")
        print(report.summary())
    return report


def what_we_measured(measured: dict[str, str], *reports: Report):
    """The closing cell of an exercise notebook: "What we measured", one line per entry of ``measured``
    (a label and its value with units, filled by the cells that ran the student's function, so that the
    lines are this run's) and one per check report.

    Before the function is written the cells that use it stop at its ``NotImplementedError`` and
    ``measured`` stays empty; the cell then says so instead of failing.

    Returns:
        an ``IPython.display.Markdown`` (a notebook displays it).
    """
    # notebooks only: the checker itself needs no IPython
    from IPython.display import Markdown

    lines = ["## What we measured", ""]
    if measured:
        lines += [f"* **{label}:** {value}" for label, value in measured.items()]
    else:
        lines.append("* Nothing yet: the cells above stop at your function's `NotImplementedError`. "
                     "Write it and run every cell again.")
    lines += [f"* **the check:** {report.summary()}" for report in reports]
    return Markdown("\n".join(lines))


__all__ = ["EXERCISES", "STARS", "Answer", "Case", "CaseResult", "Exercise", "Failure", "ForbiddenCallError", "Report",
           "check", "what_we_measured"]
