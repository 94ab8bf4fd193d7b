"""The technique docs explain; the records record.

A technique doc says what the technique is, why it works, shows its current table (rebuilt from figures/ by
tools.tables) and the command to rerun it. Dated runs, UTC windows, acceptance goals and issue numbers belong in
docs/records/ or in the JSON records, never in what a student reads first; no table states a goal verdict.
"""

import re
from pathlib import Path

import pytest

from tools import tables
from tools.tables import quant as tables_quant

ROOT = Path(__file__).resolve().parents[1]
TECHNIQUE_DOCS = ["decode", "roofline", "kv_cache", "paged", "speculative", "quantization", "stack", "formats",
                  "quant_methods", "correctness"]
MARKED = re.compile(r"<!-- table:[a-z0-9_]+ -->\n.*?<!-- /table -->", re.S)
# what a dated lab notebook says, and a doc that explains does not
HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bUTC\b|\bgoals?\b|\bissue \d+|\bnot met\b|/tmp\b|\bwork item", re.I)
PROSE_LINES = 150  # lines of a doc outside its rebuilt tables


def _prose(name: str) -> str:
    """The doc without its rebuilt tables (whose last line names the run's command and date)."""
    return MARKED.sub("", (ROOT / "docs" / f"{name}.md").read_text(encoding="utf-8"))


def prose_history(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code that read like a dated record."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and HISTORY.search(line):
            found.append(line.strip())
    return found


def test_history_is_recognised():
    assert prose_history("measured 2026-12-04 03:21-03:23 UTC\nfine\n(goal 3x: **not met**)\nissue 35's CPU")[:2] == [
        "measured 2026-12-04 03:21-03:23 UTC", "(goal 3x: **not met**)"]
    assert prose_history("```bash\npip install --target /tmp/x y\n```\nthe bound is DRAM's") == []


@pytest.mark.parametrize("name", TECHNIQUE_DOCS)
def test_technique_doc_explains_without_history(name):
    history = prose_history(_prose(name))
    assert not history, (f"docs/{name}.md reads like a dated record (move it to docs/records/{name}.md): "
                         + " | ".join(history[:3]))


@pytest.mark.parametrize("name", TECHNIQUE_DOCS)
def test_technique_doc_is_short(name):
    lines = _prose(name).count("\n")
    assert lines <= PROSE_LINES, f"docs/{name}.md has {lines} lines besides its tables (at most {PROSE_LINES})"


def _wired() -> dict[str, list[str]]:
    return {**tables.FILES, **tables_quant.FILES}


@pytest.mark.parametrize("rel", [r for r in _wired() if r.startswith("docs/")])
def test_each_doc_with_a_table_names_the_command_that_reruns_it(rel):
    text = MARKED.sub("", (ROOT / rel).read_text(encoding="utf-8"))
    assert re.search(r"python -m (minillm|tools\.tables)|jupyter nbconvert", text), \
        f"{rel}: no command that reruns its tables outside them"


def test_every_table_is_built_without_a_goal_verdict():
    for rel, names in _wired().items():
        text = (ROOT / rel).read_text(encoding="utf-8")
        for block in MARKED.findall(text):
            assert not re.search(r"\bgoals?\b|not met", block, re.I), (
                f"{rel}: a rebuilt table states a goal verdict (keep goals in the JSON record): {block[:80]}")


def test_records_link_back_and_each_long_doc_links_its_records():
    for f in sorted((ROOT / "docs" / "records").glob("*.md")):
        if f.name == "README.md":
            continue
        assert f"](../{f.name})" in f.read_text(encoding="utf-8"), f"docs/records/{f.name} does not link its doc"
        assert f"records/{f.name}" in (ROOT / "docs" / f.name).read_text(encoding="utf-8"), \
            f"docs/{f.name} does not link docs/records/{f.name}"


def test_relative_links_in_docs_resolve():
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\((?!https?:|#|mailto:)([^)#\s]+)", f.read_text(encoding="utf-8")):
            assert (f.parent / target).exists(), f"{f.relative_to(ROOT)}: the link {target} leads nowhere"
