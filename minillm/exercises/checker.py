"""The checker behind ``minillm.exercises.check``: run a student's function on named cases, compare
with the known answer, and say in plain words what is wrong and which typical mistake gives that
answer.

An ``Exercise`` holds the function's name and signature, its hand-made cases (known answers) and its
random cases (answers from the package's own implementation, ``reference``), and a ``judge`` that
compares one answer and names the likely mistake. ``check`` never lets an exception from the student's
function, or an ``AssertionError``, escape: each becomes a line of the report.

Calling the student's function and judging what it did are two steps: ``answer`` calls it on one case's
arguments and keeps what happened as plain data (an ``Answer``: values made ``portable``, or the error's
name and message); ``judge_answer`` compares that with the expected answer. The grader (``grading.py``)
runs the first step in a process of the function's own and the second in its own process, so nothing the
student's code computes is taken as a verdict.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

# what one call of the student's function did, as plain data: the grading process and the graded function's
# own process (runner.py, which may not import this package) share these
from .runner import Answer, Foreign, answer, error_name, first_line, portable, where  # noqa: F401

SEED = 0  # every check draws the same random cases, so a notebook's output is the same at every run


@dataclass
class Case:
    """One call of the student's function: ``fn(*args)``, and the answer it must give.

    ``expected`` is the known answer of a hand-made case; None for a random case, whose answer the
    package's implementation (``Exercise.reference``) gives; ``reference_kwargs`` are passed to it only
    (the seed a random source was drawn from, say); ``points`` the case earns when it passes.
    """

    name: str
    args: tuple
    expected: Any = None
    reference_kwargs: dict = field(default_factory=dict)
    points: float = 1.0


@dataclass
class Failure:
    """What ``judge`` says about a wrong answer: what was expected, what came back (both short
    strings), and a hint naming the typical mistake (or what to look at)."""

    expected: str
    got: str
    hint: str


@dataclass
class CaseResult:
    name: str
    passed: bool
    expected: str = ""
    got: str = ""
    hint: str = ""
    points: float = 0.0  # earned
    max_points: float = 1.0

    def line(self) -> str:
        if self.passed:
            return f"  passed  {self.name}"
        return (f"  FAILED  {self.name}\n          expected: {self.expected}\n          got:      {self.got}\n"
                f"          hint:     {self.hint}")


@dataclass
class Report:
    """The outcome of ``check``: ``passed`` (every case), ``failures`` (the failed ``CaseResult``s)."""

    name: str
    results: list[CaseResult] = field(default_factory=list)
    unwritten: str = ""  # the hint when the function is not written yet (each case raised NotImplementedError)
    forbidden: str = ""  # the message when the function called the implementation it replaces (0 points)
    calls: list[str] | None = None  # the switched-off package code it called (None: not recorded)

    @property
    def passed(self) -> bool:
        return bool(self.results) and not self.forbidden and all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    @property
    def hints(self) -> list[str]:
        return [r.hint for r in self.failures]

    @property
    def points(self) -> float:
        return 0.0 if self.forbidden else sum(r.points for r in self.results)

    @property
    def max_points(self) -> float:
        return sum(r.max_points for r in self.results)

    def summary(self) -> str:
        n_ok = sum(r.passed for r in self.results)
        verdict = "all passed" if self.passed else f"{len(self.failures)} failed"
        text = (f"{self.name}: {n_ok}/{len(self.results)} cases passed ({verdict}), "
                f"{self.points:g}/{self.max_points:g} points")
        if self.forbidden:
            text += " (0: it calls the implementation it replaces)"
        return text

    def __str__(self) -> str:
        calls = [] if self.calls is None else [f"  calls into minillm: {', '.join(self.calls) or 'none'}"]
        return "\n".join([f"check {self.name}"] + [r.line() for r in self.results] + [self.summary()] + calls)

    def __repr__(self) -> str:
        return f"<Report {self.summary()}>"


@dataclass(frozen=True)
class Exercise:
    """One function a student writes.

    Attributes:
        name: the function's name (what ``check`` is called with).
        signature: ``name(args) -> result``, with shapes, as the notebook states it.
        notebook: the solution notebook's file name (the student notebook has the same name).
        follows: the package code the random cases compare with.
        reference: the package's implementation with the exercise's signature.
        hand_cases: () -> the named hand-made cases with known answers.
        random_cases: (torch.Generator) -> random cases (their answers come from ``reference``).
        judge: (case, expected, got, args after the call, made ``portable``: tensors stay tensors, a config
            becomes a ``Foreign``; read the case's own from ``case.args``) -> None when right, else a ``Failure``.
        error_hint: (case, the error's name, its first line) -> a hint for a function that raised, or None.
        forbidden: dotted paths of the package functions the student's function replaces: while its cases
            run they raise (``forbid.py``; the checker's own ``ex_*`` functions always do).
        tools: dotted paths of the package modules, classes or functions the exercise hands the student (its
            docstring names them): they stay on when grading switches the rest of the package off
            (``runner.py``).
    """

    name: str
    signature: str
    notebook: str
    follows: str
    reference: Callable
    hand_cases: Callable[[], list[Case]]
    random_cases: Callable[[torch.Generator], list[Case]]
    judge: Callable[[Case, Any, Any, tuple], Failure | None]
    error_hint: Callable[[Case, str, str], str | None] = lambda case, error, message: None
    forbidden: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()

    def cases(self) -> list[Case]:
        """The practice cases: hand-made, then random (the same at every call: seeded with ``SEED``)."""
        return self.hand_cases() + self.random_cases(torch.Generator().manual_seed(SEED))

    def grading_cases(self, seed: int | None = None, extra: list[Case] = ()) -> list[Case]:
        """The practice cases, then cases the student has never seen: random ones drawn with the teacher's
        ``seed`` (named "hidden N ...") and the teacher's own ``extra`` cases.

        Raises:
            ValueError: ``seed`` is the practice seed (its cases are the practice cases).
        """
        if seed == SEED:
            raise ValueError(f"seed: {seed} is the practice cases' seed; choose another number and keep it to yourself")
        hidden = [] if seed is None else self.random_cases(torch.Generator().manual_seed(seed))
        for case in hidden:
            case.name = "hidden " + case.name.removeprefix("random ")
        return self.cases() + hidden + list(extra)

    def expected(self, case: Case) -> Any:
        """The case's known answer, or the reference's answer on a copy of its arguments."""
        if case.expected is not None:
            return case.expected
        return self.reference(*copy.deepcopy(case.args), **case.reference_kwargs)


def kind(x: Any) -> str:
    """The name of ``x``'s type, as the student wrote it (a ``Foreign`` value's original type)."""
    return x.type_name if isinstance(x, Foreign) else type(x).__name__


def judge_answer(ex: Exercise, case: Case, expected: Any, ans: Answer) -> CaseResult:
    """One case's result: the student's answer judged against the expected one."""
    if ans.error == "NotImplementedError":
        return CaseResult(case.name, False, describe(expected), "NotImplementedError",
                          f"not written yet ({ans.message}): replace the raise with your code", 0.0, case.points)
    if ans.error == "ForbiddenCallError" or ans.calls:  # a call caught by the student's code counts all the same
        called = ans.calls[0] if ans.calls else ans.message.split(" is ")[0]
        return CaseResult(case.name, False, describe(expected), f"your function called {called}"
                          f"{ans.where}", "the check switches off the package code this exercise replaces: compute "
                          "the answer with your own code (torch and Python are fine)", 0.0, case.points)
    if ans.error:
        hint = ex.error_hint(case, ans.error, ans.message) or (
            "grading runs your function in a fresh process with its own source, the functions and constants it "
            "uses and the notebook's imports: a name that another cell sets at run time does not exist there"
            if ans.error == "NameError" else "read the error and the docstring's shapes; try this case by hand")
        return CaseResult(case.name, False, describe(expected),
                          f"your function raised {ans.error}: {ans.message}{ans.where}", hint, 0.0, case.points)
    try:
        failure = ex.judge(case, expected, ans.got, ans.args)
    except Exception as e:  # an answer so odd that comparing it fails: say what came back
        failure = Failure(describe(expected), describe(ans.got),
                          f"the answer could not be compared ({type(e).__name__}: {first_line(e)}); "
                          f"return what the signature says: {ex.signature}")
    if failure is None:
        return CaseResult(case.name, True, points=case.points, max_points=case.points)
    return CaseResult(case.name, False, failure.expected, failure.got, failure.hint, 0.0, case.points)


def run_case(ex: Exercise, fn: Callable, case: Case) -> CaseResult:
    """One case, called and judged in this process (what ``check`` does)."""
    return judge_answer(ex, case, ex.expected(case), answer(fn, case.args))


def grade(ex: Exercise, cases: list[Case], expected: Iterable, answers: Iterable[Answer],
          on_result: Callable[[CaseResult], None] = lambda result: None) -> Report:
    """The report of every case (``expected`` and ``answers`` may be lazy: a case is judged when
    reached, and ``on_result`` sees each result as it comes). A function not written yet (its first
    case raises ``NotImplementedError``) gets one failure per case and ``Report.unwritten`` says so; one
    that calls the implementation it replaces in any case (``ForbiddenCallError``, or a call its answer
    records in ``Answer.calls``) earns no points."""
    report = Report(ex.name)
    for i, (case, want, ans) in enumerate(zip(cases, expected, answers)):
        result = judge_answer(ex, case, want, ans)
        if i == 0 and ans.error == "NotImplementedError":
            report.results = [CaseResult(c.name, False, "", "NotImplementedError", result.hint, 0.0, c.points)
                              for c in cases]
            report.unwritten = result.hint
            break
        if (ans.error == "ForbiddenCallError" or ans.calls) and not report.forbidden:
            report.forbidden = ans.message or f"{ans.calls[0]} is switched off while {ex.name} is checked"
        report.results.append(result)
        on_result(result)
    return report


# ---------------------------------------------------------------------------------------------
# Describing and comparing answers (the helpers every judge uses)


def describe(x: Any, limit: int = 8) -> str:
    """A short, rounded text for a number, tensor, list or tuple (never a long dump)."""
    if x is None:
        return "None"
    if isinstance(x, torch.Tensor):
        flat = x.detach().flatten()
        head = ", ".join(describe(v.item()) for v in flat[:limit]) + (", ..." if flat.numel() > limit else "")
        dims = "x".join(map(str, x.shape)) or "scalar"
        return f"tensor {dims} {str(x.dtype).replace('torch.', '')} [{head}]"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, numbers.Integral):
        return f"{int(x):,}"
    if isinstance(x, numbers.Real):
        return f"{float(x):.6g}"
    if isinstance(x, (list, tuple)):
        items = ", ".join(describe(v, limit) for v in x[:limit]) + (", ..." if len(x) > limit else "")
        return f"({items})" if isinstance(x, tuple) else f"[{items}]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in list(x.items())[:limit]) + "}"
    return f"{kind(x)} {str(x)[:80]}"


def tensor_problem(got: Any, shape: tuple, dtype: torch.dtype | None = None, what: str = "the result",
                   floating: bool = True) -> str | None:
    """Plain words for a result that is not a tensor of ``shape`` (and ``dtype``), or holds NaN/inf."""
    if not isinstance(got, torch.Tensor):
        return f"{what} should be a torch.Tensor of shape {tuple(shape)}, got {kind(got)}" + (
            ": did you forget `return`?" if got is None else "")
    if tuple(got.shape) != tuple(shape):
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(shape)}"
    if dtype is not None and got.dtype != dtype:
        return f"{what} has dtype {got.dtype}, expected {dtype}"
    if not floating and got.is_floating_point():
        return f"{what} should hold integers, got dtype {got.dtype}"
    if got.is_floating_point() and not torch.isfinite(got).all():
        bad = "NaN" if torch.isnan(got).any() else "inf"
        return f"{what} holds {bad} (a division by zero, or the log of 0?)"
    return None


def number_problem(got: Any, what: str = "the result") -> str | None:
    """Plain words for a result that is not a finite real number."""
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        return f"{what} should be a number, got {kind(got)}" + (
            ": did you forget `return`?" if got is None else "")
    if not math.isfinite(float(got)):
        return f"{what} is {got} (a division by zero?)"
    return None


def close(a: float, b: float, rtol: float = 1e-6) -> bool:
    """Relative closeness of two numbers (exact for 0)."""
    a, b = float(a), float(b)
    return abs(a - b) <= rtol * max(abs(a), abs(b)) if (a or b) else True


def same_tensor(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-4) -> bool:
    return tuple(a.shape) == tuple(b.shape) and torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol)


def first_match(got: Any, mutants: list[tuple[Callable[[], Any], str]], equal: Callable[[Any, Any], bool]):
    """The hint of the first typical mistake whose answer equals ``got`` (mutants that fail to run are
    skipped), or None."""
    for answer, hint in mutants:
        try:
            if equal(got, answer()):
                return hint
        except Exception:  # a mistake that cannot run on this case cannot be the one made
            continue
    return None
