"""The process that calls one student's function on the grader's cases, with the package switched off.

``grading.py`` starts ``python -I -c <this file's text>`` once per graded function and writes to its stdin
what it needs: the function's name, the notebook's import lines, the source of the function and of the
notebook's functions, classes and literal constants it uses (never the notebook's state), and the cases'
arguments. The process never imports ``minillm.exercises`` (the cases, the reference solutions and their
variants live there): an audit hook refuses that import, and, once the cases start, any minillm module not
yet loaded and any read of the package's files. Before the student's code is defined, every function of the
loaded minillm modules has its code swapped for one that records the call and raises
``ForbiddenCallError``; only the config classes (``ALLOWED``) and torch keep working. The originals are
dropped, so nothing in the process can call them again. The capstone's serving loop gets more: the model
(sent with the job), the model's forward left on (``capstone.TOOLS``), and the kit of capstone_kit.py, loaded
from its file beside a stand-in ``minillm.exercises.capstone`` whose lesson is switched off
(``provide_capstone``). The answers go back on stdout, as plain data,
after one line that says the start is done (the grader times the cases from there). The process dies with
its grader, even one killed outright.

As a module (``minillm.exercises.runner``) it gives the checker the same ``Answer``, ``answer`` and
``portable`` that this process uses, so that both sides agree on what an answer is.
"""

from __future__ import annotations

import copy
import io
import numbers
import os
import sys
import traceback
import types
from dataclasses import dataclass
from typing import Any, Callable

if __name__ == "__main__" and sys.platform == "linux":  # before torch's import: a grader killed outright
    import ctypes  # (SIGKILL) takes this process with it, from its first second

    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    if len(sys.argv) > 1 and os.getppid() != int(sys.argv[1]):  # the grader was gone before that took hold
        sys.exit(1)

import torch  # noqa: E402

# the config classes a case passes to the student's function (or that it may build): they stay on
ALLOWED = ("minillm.config.ModelConfig", "minillm.quant.rtn.QuantConfig", "minillm.sampling_params.SamplingParams",
           "minillm.paged.spec_decode.SpeculativeConfig")
READY = b"minillm-runner-ready\n"  # the line that ends the start (imports, switch-off, definitions)
# run as ``python -c`` there is no __file__: the package is found without importing it
_HERE = (os.path.dirname(os.path.abspath(__file__)) if "__file__" in globals() else
         os.path.join(os.path.dirname(__import__("importlib.util").util.find_spec("minillm").origin), "exercises"))
_PACKAGE = os.path.dirname(_HERE)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


class ForbiddenCallError(RuntimeError):
    """The student's function called package code that is switched off while it is checked."""


# ---------------------------------------------------------------------------------------------
# Answers as plain data (used by the checker as well)


def where(e: BaseException) -> str:
    """' (line N: source)' of the innermost frame in the student's code (not torch's, not the package's).
    Lines are looked up for that frame only, so that no file of the package is read."""
    frames = [f for f in traceback.StackSummary.extract(traceback.walk_tb(e.__traceback__), lookup_lines=False)
              if not os.path.abspath(f.filename).startswith((_PACKAGE + os.sep, _TORCH)) and f.filename != "<string>"]
    if not frames:
        return ""
    f = frames[-1]
    return f" (line {f.lineno}: {f.line.strip()})" if f.line else f" (line {f.lineno})"


class Foreign:
    """A value of a type that does not cross from the student's process to the grader as data (a NumPy
    array, a generator, an object of the student's class): its type's name and its text. It equals no
    answer, and failures describe it by its own type's name."""

    def __init__(self, type_name: str, text: str):
        self.type_name, self.text = type_name, text

    def __str__(self) -> str:
        return self.text


def portable(x: Any, depth: int = 0) -> Any:
    """``x`` as plain data that ``torch.load(weights_only=True)`` reads back: None, bool, int, float, str,
    dense tensors (detached), dtypes, and lists, tuples and dicts of them; NumPy scalars become Python
    numbers; anything else (or nested deeper than 20) becomes a ``Foreign``."""
    if x is None or type(x) in (bool, int, float, str) or isinstance(x, torch.dtype):
        return x
    if isinstance(x, torch.Tensor) and x.layout == torch.strided:
        return x.detach().as_subclass(torch.Tensor)
    if isinstance(x, numbers.Number) and hasattr(x, "item"):  # a NumPy scalar
        return portable(x.item(), depth + 1)
    for plain in (bool, int, float, str):  # subclasses (an IntEnum, say) become the plain value
        if isinstance(x, plain):
            return plain(x)
    if depth < 20 and isinstance(x, (list, tuple)):
        items = [portable(v, depth + 1) for v in x]
        return items if isinstance(x, list) else tuple(items)
    if depth < 20 and isinstance(x, dict) and all(type(k) in (str, int) for k in x):
        return {k: portable(v, depth + 1) for k, v in x.items()}
    try:
        text = str(x)[:200]
    except Exception:  # the student's __str__ may raise; the type's name still says what came back
        text = "(its str() raised)"
    return Foreign(type(x).__name__, text)


@dataclass
class Answer:
    """What the student's function did on one case, as plain data: it returned ``got`` (and left its
    arguments as ``args``: the cache exercise writes into them), or it raised ``error`` (the exception's
    name) with ``message`` (its first line) at ``where`` (the line of the student's code); ``calls``: the
    switched-off package code it called (or imported, or read), in order, each once."""

    got: Any = None
    args: tuple = ()
    error: str = ""
    message: str = ""
    where: str = ""
    calls: tuple = ()


def error_name(e: BaseException) -> str:
    """The exception's name as the student would write it (torch's LinAlgError is a private class)."""
    if isinstance(e, torch.linalg.LinAlgError):
        return "torch.linalg.LinAlgError"
    return type(e).__name__


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else "(no message)"


def answer(fn: Callable, args: tuple, calls: list | None = None) -> Answer:
    """Call ``fn`` on a copy of ``args`` (the student may write into its inputs; the cache exercise must).
    ``calls``: the list the switched-off package code appends its names to (this call's share is kept)."""
    args = copy.deepcopy(args)
    before = len(calls) if calls is not None else 0
    try:
        got = fn(*args)
    except Exception as e:  # any error in the student's code is reported in words, never re-raised
        result = Answer(error=error_name(e), message=first_line(e), where=where(e))
    else:
        result = Answer(portable(got), portable(args))
    if calls is not None:
        result.calls = tuple(dict.fromkeys(calls[before:]))
    return result


# ---------------------------------------------------------------------------------------------
# Switching the package off


def raiser_code(code: types.CodeType, raise_statement: str) -> types.CodeType:
    """A code object that runs ``raise_statement`` (its arguments are ``*args, **kwargs``), with as many free
    variables as ``code`` (a function's code can only be swapped for one with the same number)."""
    free = [f"_free{i}" for i in range(len(code.co_freevars))]
    source = (f"def _outer():\n    {' = '.join(free + ['None']) if free else 'pass'}\n"
              f"    def _forbidden(*args, **kwargs):\n        {', '.join(free) + ',' if free else ''}\n"
              f"        {raise_statement}\n"
              f"    return _forbidden\n")
    namespace: dict = {}
    # compiled under a name in the checker's folder, so that a traceback ends at the student's line
    exec(compile(source, os.path.join(_HERE, "forbid.py"), "exec"), namespace)
    return namespace["_outer"]().__code__


def _allowed(fn: types.FunctionType, tools: tuple[str, ...]) -> bool:
    """Whether ``fn`` stays on: a method of an ``ALLOWED`` class, or code under one of the exercise's ``tools``
    (a module, a class or a function, by dotted path)."""
    module, qualname = getattr(fn, "__module__", "") or "", fn.__qualname__
    if any(module == path.rpartition(".")[0] and qualname.startswith(path.rpartition(".")[2] + ".")
           for path in ALLOWED):
        return True
    full = f"{module}.{qualname}"
    return any(name == tool or name.startswith(tool + ".") for tool in tools for name in (module, full))


def switch_off(exercise: str, tools: tuple[str, ...] = ()) -> int:
    """Swap the code of every function of the loaded minillm modules (their methods, properties and closures
    included; ``ALLOWED`` classes and the exercise's ``tools`` excepted) for code that calls
    ``__main__.switched_off`` with its name.
    The original code objects are dropped. Returns how many functions were switched off."""
    import gc

    n = 0
    for obj in gc.get_objects():
        if type(obj) is not types.FunctionType:  # type(), not isinstance: no object's __class__ is asked
            continue
        filename = os.path.abspath(obj.__code__.co_filename)
        if not filename.startswith(_PACKAGE + os.sep) or filename.startswith(_HERE + os.sep) or _allowed(obj, tools):
            continue
        name = f"{obj.__module__}.{obj.__qualname__}".replace(".<locals>", "")
        message = (f"{name} is switched off while {exercise} is checked: write {exercise} yourself instead of "
                   "calling the package's implementation")
        obj.__code__ = raiser_code(
            obj.__code__, f"__import__('sys').modules['__main__'].switched_off({name!r}, {message!r})")
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# The process


# what the cases may not do: start programs, reach other processes, load or call native code, walk the
# garbage collector (where the guard's own state lives)
_REFUSED = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
            "socket.connect", "socket.bind", "ctypes.", "gc.get_objects", "gc.get_referrers", "gc.get_referents")
CASES_EVENT = "minillm.grading.cases"  # the audit event that turns the guard on for good


def _libraries() -> tuple[str, ...]:
    """Folders of the installed libraries (stdlib and site-packages): the only files the cases may open."""
    import site
    import sysconfig

    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages())
    return tuple(os.path.realpath(p) + os.sep for p in paths)


def _guard(name: str, calls: list) -> None:
    """An audit hook (it cannot be removed): minillm.exercises is never imported. From the ``CASES_EVENT`` on
    (a switch held in the hook's closure, which only the garbage collector could reach, and it is refused),
    no other minillm module is loaded, no file of the package (nor any file outside the installed libraries:
    answers a notebook left behind) is opened, and no program, socket or native code is reached."""
    package, libraries = _PACKAGE + os.sep, _libraries()
    cases = False

    def refuse(what: str, why: str):
        calls.append(what)
        raise ForbiddenCallError(f"{what} is switched off while {name} is checked: {why}")

    def hook(event, args):
        nonlocal cases
        if event == CASES_EVENT:
            cases = True
        elif event == "import" and args[0].split(".")[0] == "minillm":
            if args[0] == "minillm.exercises" or args[0].startswith("minillm.exercises."):
                calls.append(f"import {args[0]}")
                raise ImportError(f"{args[0]} holds the grader's cases and answers: it cannot be imported while "
                                  "a function is graded")
            if cases:
                refuse(f"import {args[0]}", f"write {name} yourself")
        elif not cases:
            return
        elif event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if path.startswith(package) or not path.startswith(libraries):
                refuse(f"open {path}", "a graded function reads no files (the package's least of all)")
        elif event.startswith(_REFUSED):
            refuse(event, "a graded function computes its answer itself")

    sys.addaudithook(hook)


# ---------------------------------------------------------------------------------------------
# The capstone's loop


def provide_capstone(switched_off: list[str]) -> types.ModuleType:
    """What the capstone's loop may import from ``minillm.exercises``, and nothing else of it: the kit
    (capstone_kit.py, loaded from its file, so that the package's ``__init__``, which holds the cases, never
    runs) and a stand-in ``minillm.exercises.capstone`` holding the kit's names and, for each name in
    ``switched_off`` (the lesson: the reference loop, the comparison with the engine), a function that records
    the call and raises ``ForbiddenCallError``. Returns the kit."""
    import importlib.util

    import minillm

    path = os.path.join(_HERE, "capstone_kit.py")
    spec = importlib.util.spec_from_file_location("minillm.exercises.capstone_kit", path)
    kit = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = kit  # before it runs: its dataclass looks its module up there
    spec.loader.exec_module(kit)
    package = types.ModuleType("minillm.exercises")
    package.__path__ = []  # any other module of it is looked for, and the guard refuses the import
    capstone = types.ModuleType("minillm.exercises.capstone")
    for name in kit.__all__:
        setattr(capstone, name, getattr(kit, name))
    for name in switched_off:
        setattr(capstone, name, _stand_in(f"minillm.exercises.capstone.{name}"))
    package.capstone, package.capstone_kit = capstone, kit
    minillm.exercises = package
    sys.modules.update({"minillm.exercises": package, "minillm.exercises.capstone": capstone,
                        "minillm.exercises.capstone_kit": kit})
    return kit


def _stand_in(qualified: str) -> Callable:
    message = (f"{qualified} is switched off while your serving loop is graded: write the loop yourself, with "
               "your pieces")

    def switched(*args, **kwargs):
        return sys.modules["__main__"].switched_off(qualified, message)

    return switched


def capstone_loop(serve: Callable, model, kit: types.ModuleType, namespace: dict) -> Callable:
    """The student's ``serve`` as one case calls it: (prompts, settings) -> its ``ServeResult``'s fields as a
    dict (plain data) and ``called``, the pieces it called, called with the provided ``model`` and the pieces the
    notebook defines (the kit's ``default_schedule_step`` where it defines no ``schedule_step``)."""
    defined = {name: namespace[name] for name in kit.PIECES if callable(namespace.get(name))}
    defined.setdefault("schedule_step", kit.default_schedule_step)

    def counted(name, fn):
        def piece(*args, **kwargs):
            called.add(name)
            return fn(*args, **kwargs)
        return piece

    called: set = set()

    def loop(prompts, settings):
        called.clear()
        result = serve(model, prompts, {name: counted(name, fn) for name, fn in defined.items()}, **settings)
        if isinstance(result, kit.ServeResult):
            fields = ("tokens", "steps", "preemptions", "drafted", "accepted")
            return {**{k: getattr(result, k) for k in fields}, "called": sorted(called)}
        return result

    return loop


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the student's code prints goes to stderr, never into the answers
    import linecache

    # the grader's own data (configs are dataclasses, so not weights_only)
    job = torch.load(io.BytesIO(sys.stdin.buffer.read()), weights_only=False)
    name, calls = job["name"], []
    _guard(name, calls)
    capstone = job.get("capstone")
    kit = provide_capstone(capstone["switched_off"]) if capstone else None
    namespace = {"__name__": "__student__", "__builtins__": __builtins__}
    notes = []
    for line in job["imports"]:
        try:
            exec(compile(line, "<the notebook's imports>", "exec"), namespace)
        except Exception as e:  # one import that fails here need not sink the function: say so
            notes.append(f"`{line}` failed in the grading process ({error_name(e)}: {first_line(e)})")

    def switched_off(qualified: str, message: str):
        calls.append(qualified)
        raise ForbiddenCallError(message)

    sys.modules["__main__"].switched_off = switched_off
    switch_off(name, tuple(job.get("tools", ())))
    sys.audit(CASES_EVENT)
    for filename, source in job["cells"].items():  # so that a traceback shows the student's line
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        for filename, source in job["definitions"]:
            exec(compile(source, filename, "exec"), namespace)
        fn = namespace[name]
        if capstone:
            fn = capstone_loop(fn, capstone["model"], kit, namespace)
    except Exception as e:
        notes.append(f"its definition raised {error_name(e)}: {first_line(e)}{where(e)}")
        fn = None
    out.write(READY)
    out.flush()
    answers = [] if fn is None else [answer(fn, args, calls) for args in job["cases"]]
    data = io.BytesIO()  # torch.save needs a file it can seek in
    torch.save({"answers": answers, "notes": notes}, data)
    out.write(data.getvalue())
    out.flush()


if __name__ == "__main__":
    main()
