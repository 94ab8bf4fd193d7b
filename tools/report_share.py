"""How much of each lesson's code builds reports instead of running the model or drawing.

``python -m tools.report_share [NOTEBOOK ...]`` prints, per lesson (every ``notebooks/*.ipynb`` by default, the
exercises left out), its code lines, the lines that build reports and their share, then the total.

The counting rule is ``minillm.lab.lessons.report_share``'s (a measure for the course's authors, so it stays out
of the lessons' outputs):

* code lines: the non-blank lines of code cells that are not comments (``#``) or magics (``%``);
* report lines: the whole of every call to ``Markdown(...)`` or ``record(...)`` (however many lines it spans),
  and every assignment or expression statement that assembles text, that is, holds an f-string anywhere
  outside a ``print(...)`` call; a line is counted once, whatever marks it.

Printing a measurement (``print(f"...")``) is not counted: it is the cell's output, what a student reads
next to the code that produced it. A call to a helper that builds the text (``Markdown(lesson_notes.x(...))``)
counts as the lines of that call only, which is the point of moving the wording into helpers. The course aims
at most 15% per lesson.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minillm.lab.lessons import report_share  # noqa: E402

AIM = 0.15


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks to count (default: notebooks/*.ipynb)")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    total_code = total_report = 0
    print(f"{'lesson':28s} {'code lines':>10s} {'report lines':>12s} {'share':>6s}")
    for path in paths:
        s = report_share(path)
        total_code += s["code_lines"]
        total_report += s["report_lines"]
        flag = "" if s["share"] <= AIM else f"   above {AIM:.0%}"
        print(f"{path.stem:28s} {s['code_lines']:10d} {s['report_lines']:12d} {s['share']:6.0%}{flag}")
    share = total_report / total_code if total_code else 0.0
    print(f"{'all':28s} {total_code:10d} {total_report:12d} {share:6.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
