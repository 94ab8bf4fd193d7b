"""Writing output files so that nothing is lost, and JSON that every parser reads.

Every writer (GGUF, safetensors, draft checkpoints, tables) writes to a temporary file beside its
destination and renames it into place only when the file is complete (``atomic_write``): a crash,
a full disk or an error half-way leaves the destination as it was. The commands check their output
paths with ``check_output_path`` before loading a model, so that a bad path costs nothing; every command
runs under ``sigterm_as_exit`` (``minillm.cli.main``), so that a SIGTERM removes the temporary file as Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_output_path(path: str | os.PathLike, option: str, *, sources: Iterable[str | os.PathLike] = (),
                      suffix: str | None = None, folder: bool = False) -> Path:
    """Check that ``path`` can be written, before any work starts.

    Args:
        path: the file (or, with ``folder``, the folder) to write.
        option: the option or argument that named it, for the message (e.g. ``"--out"``).
        sources: files the work reads; the output may not be any of them (with ``folder``, no file
            inside the folder may be one of them either).
        suffix: the ending the file must have (e.g. ``".gguf"``), or None.
        folder: the output is a folder (created if missing) rather than a file.

    Returns the path. Raises ValueError naming ``option``: the wrong suffix, a folder that does not
    exist, a directory where a file goes (or a file where a folder goes), or a source as destination.
    """
    p = Path(path)
    if suffix is not None and p.suffix != suffix:
        raise ValueError(f"{option}: must end in {suffix}, got {str(path)!r}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{option}: the folder {str(parent)!r} does not exist; create it first (mkdir -p) "
                         "or give another path")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{option}: the folder {str(parent)!r} cannot be written (read-only, or not yours); "
                         "give a path in a folder you can write")
    if folder and p.exists() and not p.is_dir():
        raise ValueError(f"{option}: {str(path)!r} is a file, and a folder is written there; give a new folder name")
    if not folder and p.is_dir():
        raise ValueError(f"{option}: {str(path)!r} is a folder; give a file name inside it")
    for src in sources:
        src = Path(src)
        if _same_file(p, src) or (folder and _same_file(p, src.parent)):
            raise ValueError(f"{option}: {str(path)!r} is the file being read ({src}); writing it would destroy "
                             "the source: give another path")
    return p


@contextlib.contextmanager
def atomic_write(dst: str | os.PathLike, sources: Iterable[str | os.PathLike] = ()) -> Iterator[Path]:
    """``with atomic_write(dst) as tmp:`` write to ``tmp``; on leaving the block ``tmp`` is renamed
    to ``dst`` (atomic on one file system), or removed if the block raised. The source files stay
    readable throughout, even memory-mapped ones, since no byte of an existing file is overwritten.

    Raises:
        ValueError: ``dst`` resolves to one of ``sources``.
    """
    dst = Path(dst)
    for src in sources:
        if _same_file(dst, Path(src)):
            raise ValueError(f"out: {str(dst)!r} is the file being read; writing it would destroy the source: "
                             "give another path")
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent if str(dst.parent) else ".")
    try:  # from the moment it exists: any exception, KeyboardInterrupt and SystemExit included, removes it
        os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        yield Path(tmp)
        # as open() would create it: mkstemp, and writers such as safetensors' save_file, make it private
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dst)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


SIGTERM_STATUS = 128 + signal.SIGTERM  # the shell's exit status for a process ended by SIGTERM


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM raises ``SystemExit(SIGTERM_STATUS)``, so that ``finally`` blocks run:
    ``atomic_write`` removes its temporary file, which SIGTERM's default action (the process ends at once)
    leaves beside the destination. Off the main thread, where Python cannot install a handler, the block runs
    as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(SIGTERM_STATUS)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:  # None: a handler installed outside Python, which cannot be restored
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def runs_folder() -> Path:
    """Where the commands draw their figures: ``$MINILLM_FIGURES``, else figures/runs under the current
    folder (git-ignored, so running a command never changes the committed figures, the notebooks' own)."""
    return Path(os.environ.get("MINILLM_FIGURES", "figures/runs"))


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Save a matplotlib figure through ``atomic_write`` (its folder created if missing) and close it."""
    import matplotlib.pyplot as plt  # matplotlib loads only for those who draw

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps_strict(obj, **kwargs) -> str:
    """``json.dumps`` that strict parsers accept: NaN and infinity become null (Python's default writes
    ``NaN``, which is not JSON), and anything else that is not JSON (paths, dtypes) becomes its string."""
    return json.dumps(_finite(obj), allow_nan=False, default=str, **kwargs)
