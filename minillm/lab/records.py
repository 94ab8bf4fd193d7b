"""Records: a measurement kept as JSON with the command that made it, the date and the machine's load.

The benchmark commands (``python -m tools.tables record``) and the notebooks write them into ``figures/``;
the repository's table builder (``tools/tables``, not part of the package) rebuilds README's and docs'
tables from them. A record is ``{"command", "date", "load", "report"}``: ``report`` is what a command
printed with ``--json``, or what a notebook measured.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

from ..files import atomic_write, dumps_strict


def load_average() -> str:
    """The 1/5/15-minute load averages, as ``uptime`` prints them (``"n/a"`` where the OS has none)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def provenance() -> dict:
    """What a bench's JSON starts with, as docs/quantization.md's generated tables state it: the command
    that ran, today's UTC date and the machine's load average."""
    return {"command": "python -m minillm " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "load": load_average()}


def record(report: dict, path: str | os.PathLike, command: str) -> Path:
    """Write ``report`` to ``path`` as a record: the command that measured it, today's UTC date and the
    machine's load average beside it. Notebooks call this with their measurements."""
    rec = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "load": load_average(), "report": report}
    with atomic_write(path) as tmp:
        tmp.write_text(dumps_strict(rec, indent=1) + "\n", encoding="utf-8")
    return Path(path)


class RecordError(ValueError):
    """A record (or report) that cannot be read, or holds values its table cannot use; the message names
    the file, what is wrong and the command that rewrites it. ``python -m tools.tables --check`` exits 2
    on it, so that "out of date" (exit 1) never stands for "unreadable"."""


def read_json(path: Path, writer: str) -> object:
    """The JSON in ``path``, which ``writer`` (a command or notebook) rewrites.

    Raises:
        FileNotFoundError: the file is not there.
        RecordError: it cannot be read as JSON text: a folder or an unreadable file, empty, binary (not
            UTF-8), holding NUL bytes (what a write cut short by a crash can leave), or not valid JSON (cut
            short, edited by hand); each named, with ``writer``.
    """
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found; {writer} writes it")
    try:
        data = path.read_bytes()
    except OSError as e:  # a folder in its place, no permission
        raise RecordError(f"{path}: cannot be read ({e.strerror or e}); rewrite it with {writer}") from None
    if not data.strip():
        raise RecordError(f"{path}: is empty; rewrite it with {writer}")
    nul = data.find(b"\0")
    if nul >= 0:  # checked before decoding: NULs are valid UTF-8, and JSON's error would not say so
        raise RecordError(f"{path}: holds NUL bytes (the first at byte {nul}; a write cut short by a crash leaves "
                          f"them), so it is not a JSON record; rewrite it with {writer}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError(f"{path}: is not UTF-8 text (byte {e.start} is {data[e.start]:#04x}; a binary file?), so "
                          f"it is not a JSON record; rewrite it with {writer}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        cut = "" if text.rstrip().endswith(("}", "]")) else " (it does not end with } or ]: cut short?)"
        raise RecordError(f"{path}: not valid JSON ({e}){cut}; rewrite it with {writer}") from None


def read_record(name: str, folder: str | os.PathLike = "figures", writer: str = "its benchmark") -> dict:
    """The record ``folder/name`` (``folder`` relative to the current directory: ``figures`` from the
    repository's root, ``../figures`` from ``notebooks/``).

    Raises:
        FileNotFoundError: the JSON is not there (the error names ``writer``, the command or notebook that
            writes it).
        RecordError (a ValueError): it cannot be read (``read_json``), is not a record, or its report is
            not an object (null, say); the error names the file and what rewrites it.
    """
    path = Path(folder) / name
    rec = read_json(path, writer)
    if not isinstance(rec, dict) or not {"command", "date", "report"} <= set(rec):
        raise RecordError(f"{path}: not a record (needs command, date, report); rewrite it with {writer}")
    if not isinstance(rec["report"], dict):
        raise RecordError(f"{path}: its report is {json.dumps(rec['report'])[:40]}, not an object; rewrite it with "
                          f"{writer}")
    return rec
