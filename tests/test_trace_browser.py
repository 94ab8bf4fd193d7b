"""The replay page as a person uses it: opened in a real headless browser (Debian's chromium, driven by
playwright where it is installed, else by chromium's own --dump-dom and --screenshot), the slider moved to a
step, and what the page shows there (each sequence's block table, the owner of every block of the pool, a
block's tokens on hover) checked against the trace. Skips, saying how to install one, where no browser is."""

import html.parser
import os
import shutil
import subprocess

import pytest
import torch
from helpers import random_decoder

from minillm import SamplingParams
from minillm.lab.replay import read_trace, replay, write_html
from minillm.paged import LLMEngine

V = 300


def find_chromium() -> str | None:
    """$MINILLM_CHROMIUM, else the first of chromium, chromium-browser, google-chrome on PATH."""
    names = [os.environ.get("MINILLM_CHROMIUM")] + ["chromium", "chromium-browser", "google-chrome"]
    return next((shutil.which(n) for n in names if n and shutil.which(n)), None)


CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no browser installed: the replay test needs Debian's "
                                "chromium (`apt-get install -y chromium`, which `make setup` runs as root)")


def record_trace(path):
    """Two requests sharing a prefix, one forking into two samples (copy-on-write), a pool small enough that a
    late request is preempted."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, V, (9,), generator=g).tolist()
    engine = LLMEngine(random_decoder(V, scale=0.3), num_blocks=14, block_size=4, max_num_batched_tokens=24,
                       trace=path)
    engine.add_request("A", shared + [1, 2], SamplingParams(max_tokens=10, ignore_eos=True))
    engine.add_request("B", shared + [3], SamplingParams(max_tokens=6, ignore_eos=True, n=2, temperature=1.0, seed=1))
    engine.add_request("C", torch.randint(0, V, (14,), generator=g).tolist(), SamplingParams(max_tokens=12,
                                                                                            ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 2:
            engine.add_request("D", shared + [7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    return read_trace(path)


def expected(trace, k: int) -> dict:
    """What the page must show at step k: each sequence's table by (request, index), each block's owners."""
    state = next(s for s in replay(trace) if s.step["step"] == k)
    rows = {(rid, str(i)): ",".join(map(str, state.tables[sid])) for sid, (rid, i) in state.owners.items()}
    owners = {b: sorted(f"{rid}#{i}" for sid, (rid, i) in state.owners.items() if b in state.tables[sid])
              for b in range(trace.header["num_blocks"])}
    return {"rows": rows, "owners": owners, "state": state}


class _Dom(html.parser.HTMLParser):
    """The step, the sequence rows and the pool's blocks of a dumped page."""

    def __init__(self):
        super().__init__()
        self.step, self.rows, self.owners = None, {}, {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.step = a.get("data-step")
        if "seq" in (a.get("class") or "").split():
            self.rows[(a["data-request"], a["data-index"])] = a["data-blocks"]
        if tag == "rect" and a.get("class") == "block":
            self.owners[int(a["data-block"])] = sorted(filter(None, a["data-owners"].split(",")))


def show_step(page_path, trace, k: int, screenshot) -> dict:
    """Open the page, move the slider to step k, read what it shows; a screenshot of it."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if sync_playwright is None:  # chromium alone: the page opens at the step its address names
        url = f"{page_path.as_uri()}#step={k}"
        dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", url],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={screenshot}",
                        "--window-size=1400,900", url], capture_output=True, timeout=120, check=True)
        parsed = _Dom()
        parsed.feed(dom)
        return {"step": parsed.step, "rows": parsed.rows, "owners": parsed.owners, "hover": None}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(page_path.as_uri())
            page.focus("#slider")
            for _ in range(k):  # as a person would: the arrow key moves the slider one step
                page.keyboard.press("ArrowRight")
            rows = page.eval_on_selector_all(".seq", "rs => rs.map(r => [r.dataset.request, r.dataset.index, "
                                                     "r.dataset.blocks])")
            owners = page.eval_on_selector_all("rect.block", "bs => bs.map(b => [+b.dataset.block, b.dataset.owners])")
            held = next(int(b) for b, o in owners if o)
            page.hover(f"rect.block[data-block='{held}']")
            hover = (held, page.inner_text("#hover"))
            page.screenshot(path=str(screenshot), full_page=True)
            return {"step": page.evaluate("document.body.dataset.step"), "rows": {(r, i): b for r, i, b in rows},
                    "owners": {b: sorted(filter(None, o.split(","))) for b, o in owners}, "hover": hover}
        finally:
            browser.close()


def test_the_page_shows_each_step_as_the_trace_records_it(tmp_path):
    trace = record_trace(tmp_path / "trace.jsonl")
    page = write_html(trace, tmp_path / "trace.html")
    # the step where request D is preempted: the one the lesson asks about
    k = next(s["step"] for s in trace.steps if s["preempted"])
    want = expected(trace, k)
    shot = tmp_path / "replay.png"
    seen = show_step(page, trace, k, shot)
    assert seen["step"] == str(k)
    assert seen["rows"] == want["rows"]
    assert seen["owners"] == want["owners"]
    assert shot.stat().st_size > 10_000  # a drawn page, not a blank one
    if seen["hover"] is not None:
        block, text = seen["hover"]
        tokens = " ".join(map(str, want["state"].block_tokens(block)))
        assert f"block {block}: held by" in text and tokens in text
