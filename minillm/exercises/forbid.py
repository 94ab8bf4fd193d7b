"""While a student's function is checked, the package code it replaces raises ``ForbiddenCallError``.

A function that wraps the package's own implementation (``kv_cache_size`` returning
``minillm.kv_cache_bytes(...)``) would pass every case; so, while its cases run, each function the
exercise names in ``Exercise.forbidden`` and every function of the checker's ``ex_*`` modules (the
references and their written-out variants) has its code swapped for one that raises. Swapping the code
object, not a module attribute, reaches every alias at once: ``minillm.kv_cache_bytes``,
``from minillm.kv_cache import kv_cache_bytes as f`` in the student's notebook, a bound method. The
code is put back when the cases are done, so the student's other cells and the other exercises keep it.
This is the practice check's guard; grading switches the whole package off by allow-list in a process of
the function's own (``runner.py``).
"""

from __future__ import annotations

import importlib
import sys
import types
from contextlib import contextmanager

from .runner import raiser_code


class ForbiddenCallError(RuntimeError):
    """The student's function called the package code the exercise asks them to write."""


def resolve(path: str) -> types.FunctionType:
    """The function named by a dotted path (``minillm.kv_cache.kv_cache_bytes``, ``pkg.mod.Class.method``).

    Raises:
        ValueError: nothing importable by that path is a Python function.
    """
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, None)
        obj = getattr(obj, "__func__", obj)  # a classmethod or staticmethod
        if isinstance(obj, types.FunctionType):
            return obj
        break
    raise ValueError(f"forbidden: {path!r} names no Python function; give module.function or module.Class.method")


def checker_functions() -> list[tuple[str, types.FunctionType]]:
    """Every function defined in the checker's ``minillm.exercises.ex_*`` modules (references, mistakes)."""
    found = []
    for name, module in list(sys.modules.items()):
        if name.startswith("minillm.exercises.ex_"):
            found += [(f"{name}.{k}", v) for k, v in vars(module).items()
                      if isinstance(v, types.FunctionType) and v.__module__ == name]
    return found


@contextmanager
def forbidden(exercise: str, paths: tuple[str, ...]):
    """Within the block, each function of ``paths`` and of the checker's modules raises
    ``ForbiddenCallError`` saying which function ``exercise`` must write itself."""
    targets = [(p, resolve(p)) for p in paths] + checker_functions()
    saved = []
    try:
        for path, fn in targets:
            for f in {fn, getattr(fn, "__wrapped__", fn)}:  # a decorated function and the one it wraps
                if not isinstance(f, types.FunctionType) or any(f is g for g, _ in saved):
                    continue
                message = (f"{path.removeprefix('minillm.exercises.')} is switched off while {exercise} is "
                           f"checked: write {exercise} yourself instead of calling the package's implementation")
                saved.append((f, f.__code__))
                f.__code__ = raiser_code(f.__code__, "raise __import__('minillm.exercises.forbid', fromlist=['x'])"
                                         f".ForbiddenCallError({message!r})")
        yield
    finally:
        for f, code in saved:
            f.__code__ = code
