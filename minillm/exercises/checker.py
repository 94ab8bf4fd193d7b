"""The checker behind ``minillm.exercises.check``: run a student's function on named cases, compare
with the known answer, and say in plain words what is wrong and which typical mistake gives that
answer.

An ``Exercise`` holds the function's name and signature, its hand-made cases (known answers) and its
random cases (answers from the package's own implementation, ``reference``), and a ``judge`` that
compares one answer and names the likely mistake. ``check`` never lets an exception from the student's
function, or an ``AssertionError``, escape: each becomes a line of the report.
"""

from __future__ import annotations

import copy
import math
import numbers
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

SEED = 0  # every check draws the same random cases, so a notebook's output is the same at every run
_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass
class Case:
    """One call of the student's function: ``fn(*args)``, and the answer it must give.

    ``expected`` is the known answer of a hand-made case; None for a random case, whose answer the
    package's implementation (``Exercise.reference``) gives; ``reference_kwargs`` are passed to it only
    (the seed a random source was drawn from, say).
    """

    name: str
    args: tuple
    expected: Any = None
    reference_kwargs: dict = field(default_factory=dict)


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

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    @property
    def hints(self) -> list[str]:
        return [r.hint for r in self.failures]

    def summary(self) -> str:
        n_ok = sum(r.passed for r in self.results)
        verdict = "all passed" if self.passed else f"{len(self.failures)} failed"
        return f"{self.name}: {n_ok}/{len(self.results)} cases passed ({verdict})"

    def __str__(self) -> str:
        return "\n".join([f"check {self.name}"] + [r.line() for r in self.results] + [self.summary()])

    def __repr__(self) -> str:
        return f"<Report {self.summary()}>"


@dataclass(frozen=True)
class Exercise:
    """One function a student writes.

    Fields:
        name: the function's name (what ``check`` is called with).
        signature: ``name(args) -> result``, with shapes, as the notebook states it.
        notebook: the solution notebook's file name (the student notebook has the same name).
        follows: the package code the random cases compare with.
        reference: the package's implementation with the exercise's signature.
        hand_cases: () -> the named hand-made cases with known answers.
        random_cases: (torch.Generator) -> random cases (their answers come from ``reference``).
        judge: (case, expected, got, args after the call) -> None when right, else a ``Failure``.
    """

    name: str
    signature: str
    notebook: str
    follows: str
    reference: Callable
    hand_cases: Callable[[], list[Case]]
    random_cases: Callable[[torch.Generator], list[Case]]
    judge: Callable[[Case, Any, Any, tuple], Failure | None]
    error_hint: Callable[[Case, BaseException], str | None] = lambda case, e: None


def where(e: BaseException) -> str:
    """' (line N: source)' of the innermost frame in the student's code (not torch's, not the checker's)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not os.path.abspath(f.filename).startswith((_HERE, _TORCH))]
    if not frames:
        return ""
    f = frames[-1]
    return f" (line {f.lineno}: {f.line.strip()})" if f.line else f" (line {f.lineno})"


def run_case(ex: Exercise, fn: Callable, case: Case) -> CaseResult:
    """One case: the student's answer judged against the known answer or the reference's."""
    expected = case.expected
    if expected is None:
        expected = ex.reference(*copy.deepcopy(case.args), **case.reference_kwargs)
    args = copy.deepcopy(case.args)  # the student may write into its inputs (the cache exercise must)
    try:
        got = fn(*args)
    except NotImplementedError as e:
        return CaseResult(case.name, False, describe(expected), "NotImplementedError",
                          f"not written yet ({e}): replace the raise with your code")
    except Exception as e:  # any error in the student's code is reported in words, never re-raised
        hint = ex.error_hint(case, e) or "read the error and the docstring's shapes; try this case by hand"
        return CaseResult(case.name, False, describe(expected),
                          f"your function raised {error_name(e)}: {first_line(e)}{where(e)}", hint)
    try:
        failure = ex.judge(case, expected, got, args)
    except Exception as e:  # an answer so odd that comparing it fails: say what came back
        failure = Failure(describe(expected), describe(got),
                          f"the answer could not be compared ({type(e).__name__}: {first_line(e)}); "
                          f"return what the signature says: {ex.signature}")
    if failure is None:
        return CaseResult(case.name, True)
    return CaseResult(case.name, False, failure.expected, failure.got, failure.hint)


def error_name(e: BaseException) -> str:
    """The exception's name as the student would write it (torch's LinAlgError is a private class)."""
    if isinstance(e, torch.linalg.LinAlgError):
        return "torch.linalg.LinAlgError"
    return type(e).__name__


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else "(no message)"


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
    return f"{type(x).__name__} {str(x)[:80]}"


def tensor_problem(got: Any, shape: tuple, dtype: torch.dtype | None = None, what: str = "the result",
                   floating: bool = True) -> str | None:
    """Plain words for a result that is not a tensor of ``shape`` (and ``dtype``), or holds NaN/inf."""
    if not isinstance(got, torch.Tensor):
        return f"{what} should be a torch.Tensor of shape {tuple(shape)}, got {type(got).__name__}" + (
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
        return f"{what} should be a number, got {type(got).__name__}" + (
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
