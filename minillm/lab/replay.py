"""``python -m minillm trace replay``: an engine's trace (``LLMEngine(trace=PATH)``, docs/trace.md) replayed.

``read_trace`` checks the file line by line; ``replay`` rebuilds the block pool after every step (each
sequence's block table, the reference counts, the free count, the prefix cache's blocks, the tokens each
block holds); ``write_html`` writes one self-contained page (inline script and SVG, nothing fetched) to scrub
through the steps: the pool as a grid coloured by owner, a row per sequence with its block table, the step's
batch, a timeline, a slider and a play button, a block's tokens on hover; ``write_png`` draws chosen steps
with matplotlib for places that run no script.
"""

from __future__ import annotations

import colorsys
import importlib.resources
import json
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from ..files import atomic_write, check_output_path, save_figure
from ..paged.trace import TRACE_FORMAT, TRACE_VERSION

STEP_KEYS = ("step", "seconds", "budget", "batch", "preempted", "finished", "prefix_hits", "copied", "seqs", "taken",
             "freed", "shared", "cached_new", "cached_gone", "free")
HEADER_KEYS = ("num_blocks", "block_size", "max_num_batched_tokens")
# the page: HTML, CSS and script in a file of its own; write_html puts the trace's JSON in place of __DATA__
PAGE = importlib.resources.files(__package__) / "replay_page.html"


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file, the line and the field."""


@dataclass
class Trace:
    """A read trace: its header (the engine's settings) and one dict per step (docs/trace.md)."""

    path: Path
    header: dict
    steps: list[dict]


@dataclass
class PoolState:
    """The pool after one step, rebuilt from the trace.

    tables: seq_id -> block table; owners: seq_id -> (request_id, sample index); computed: seq_id -> tokens
    whose keys and values are in its blocks; ref_counts: tables holding each block (num_blocks,); free: blocks
    no table holds; cached: blocks the prefix cache can find (held or free); tokens: seq_id -> its known token
    ids (and ``pieces``, their text, when the engine had a tokenizer).
    """

    step: dict
    tables: dict[int, list[int]]
    owners: dict[int, tuple[str, int]]
    computed: dict[int, int]
    ref_counts: list[int]
    free: int
    cached: set[int]
    tokens: dict[int, list[int]] = field(default_factory=dict)
    pieces: dict[int, list[str]] = field(default_factory=dict)
    block_size: int = 16

    def block_tokens(self, block: int) -> list[int]:
        """The token ids whose keys and values the block holds (read from its first table)."""
        for sid, table in self.tables.items():
            if block in table:
                j, bs = table.index(block), self.block_size
                return self.tokens.get(sid, [])[j * bs:min((j + 1) * bs, self.computed[sid])]
        return []


def read_trace(path) -> Trace:
    """Read and check a trace: a header line, then step lines with every key of docs/trace.md. A last line cut
    short (the run stopped while writing it) is left out, saying so on stderr.

    Raises:
        TraceError: a missing file, a line that is not JSON, a header of another format or version, a missing key.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace: {path} is not a file; write one with LLM(..., trace=PATH) or serve-bench "
                         "--trace-out PATH")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    if not lines:
        raise TraceError(f"trace: {path} is empty; it holds no header (was the engine built with trace=PATH?)")
    records = []
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) and not text.endswith("\n") and i > 1:
                print(f"trace: {path} line {i} is cut short (the run stopped while writing it); replaying the "
                      f"{i - 2} steps before it", file=sys.stderr)
                break
            raise TraceError(f"trace: {path} line {i} is not JSON ({e.msg}); a trace holds one JSON object a line")
    header, steps = records[0], records[1:]
    if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
        raise TraceError(f"trace: {path} line 1 is not a minillm engine trace's header (format "
                         f"{TRACE_FORMAT!r}); write the trace with LLM(..., trace=PATH)")
    if header.get("version") != TRACE_VERSION:
        raise TraceError(f"trace: {path} has version {header.get('version')!r}; this minillm replays version "
                         f"{TRACE_VERSION}: record it again with this version")
    for key in HEADER_KEYS:
        if not isinstance(header.get(key), int):
            raise TraceError(f"trace: {path} line 1: the header's {key!r} is missing or not an integer")
    for i, step in enumerate(steps, 2):
        missing = [k for k in STEP_KEYS if not isinstance(step, dict) or k not in step]
        if missing:
            raise TraceError(f"trace: {path} line {i}: missing {', '.join(map(repr, missing))} "
                             "(docs/trace.md lists a step's keys)")
    return Trace(path, header, steps)


def replay(trace: Trace):
    """Yield the ``PoolState`` after each step, in order. The token lists are shared between the states (a
    sequence's known tokens only grow); ``computed`` says how many each state's blocks hold.

    Raises:
        TraceError: a table naming a block outside the pool.
    """
    num_blocks, cached, tokens, pieces = trace.header["num_blocks"], set(), {}, {}
    for step in trace.steps:
        cached |= set(step["cached_new"])
        cached -= set(step["cached_gone"])
        tables, owners, computed, refs = {}, {}, {}, [0] * num_blocks
        for entry in step["seqs"]:
            sid = entry["seq"]
            tables[sid], owners[sid], computed[sid] = entry["table"], (entry["request"], entry["index"]), entry["computed"]
            for block in entry["table"]:
                if not 0 <= block < num_blocks:
                    raise TraceError(f"trace: {trace.path} step {step['step']}: sequence {sid} holds block {block}, "
                                     f"outside the pool of {num_blocks}")
                refs[block] += 1
            if "tokens" in entry:
                ids = tokens.setdefault(sid, [])
                del ids[entry["from"]:]
                ids.extend(entry["tokens"])
                if "pieces" in entry:
                    text = pieces.setdefault(sid, [])
                    del text[entry["from"]:]
                    text.extend(entry["pieces"])
        yield PoolState(step, tables, owners, computed, refs, sum(1 for r in refs if r == 0), set(cached), tokens,
                        pieces, trace.header["block_size"])


def request_colours(trace: Trace) -> dict[str, str]:
    """One colour per request (hex), in the order requests first hold blocks: hues a golden angle apart."""
    colours = {}
    for step in trace.steps:
        for entry in step["seqs"]:
            rid = entry["request"]
            if rid not in colours:
                r, g, b = colorsys.hls_to_rgb((len(colours) * 0.381966) % 1.0, 0.62, 0.62)
                colours[rid] = f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"
    return colours


def write_html(trace: Trace, out) -> Path:
    """Write the replay page (one file, no network) to ``out``; returns its path."""
    out = Path(out)
    data = json.dumps({"header": trace.header, "steps": trace.steps, "colours": request_colours(trace),
                       "source": trace.path.name}, separators=(",", ":"), ensure_ascii=False)
    data = data.replace("</", "<\\/")  # no "</script>" inside the data
    page = PAGE.read_text(encoding="utf-8").replace("__DATA__", data)
    with atomic_write(out) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return out


def write_png(trace: Trace, steps: list[int], out, columns: int | None = None) -> Path:
    """Draw the pool at each chosen step (one panel each, top to bottom): blocks coloured by the request that
    holds them, shared blocks outlined in black with their reference count, prefix-cached blocks dotted, the
    step's batch in the title. Returns the path.

    Raises:
        ValueError: a step the trace does not hold.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    states = {s.step["step"]: s for s in replay(trace)}
    bad = [s for s in steps if s not in states]
    if bad:
        raise ValueError(f"steps: {bad} not in the trace (steps {min(states, default=0)}..{max(states, default=-1)})")
    num_blocks, colours = trace.header["num_blocks"], request_colours(trace)
    cols = columns or min(32, max(8, int((2 * num_blocks) ** 0.5)))
    rows = -(-num_blocks // cols)
    width = max(8.0, 0.32 * cols + 2.5)  # inches: the grid and the legend of requests beside it
    fig, axes = plt.subplots(len(steps), 1, figsize=(width, (0.32 * rows + 1.3) * len(steps)), squeeze=False)
    for ax, k in zip(axes[:, 0], steps):
        state = states[k]
        owner_of = {}
        for sid, table in state.tables.items():
            for block in table:
                owner_of.setdefault(block, state.owners[sid][0])
        for block in range(num_blocks):
            x, y = block % cols, block // cols
            refs = state.ref_counts[block]
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=colours.get(owner_of.get(block), "#eeeeee"),
                                   edgecolor="black" if refs > 1 else "#bbbbbb", linewidth=2.2 if refs > 1 else 0.5))
            if refs > 1:
                ax.text(x + 0.5, y + 0.55, str(refs), ha="center", va="center", fontsize=7, weight="bold")
            if block in state.cached:
                ax.plot(x + 0.8, y + 0.22, "o", color="#006d77", ms=3)
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_aspect("equal")
        ax.axis("off")
        title = f"step {k}: {_batch_text(state.step)}; {state.free} of {num_blocks} blocks free"
        ax.set_title(textwrap.fill(title, width=int(11 * width)), fontsize=9, loc="left")
        held = list(dict.fromkeys(state.owners[s][0] for s in state.tables))
        handles = [Rectangle((0, 0), 1, 1, color=colours[r]) for r in held]
        if handles:
            ax.legend(handles, [f"request {r}" for r in held], loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      fontsize=7, frameon=False)
    fig.text(0.01, 0.005, "black outline: shared (number: reference count) · dot: in the prefix cache · grey: free",
             fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    return save_figure(fig, out)


def _batch_text(step: dict) -> str:
    """The step in words: prefill / decode / recompute tokens, drafts accepted of proposed, prefix hits, copies on
    write, preemptions."""
    kinds = {}
    for run in step["batch"]:
        kinds[run["kind"]] = kinds.get(run["kind"], 0) + run["tokens"]
    words = [f"{n} {kind}" for kind, n in kinds.items()]
    drafts = sum(r["drafts"] for r in step["batch"])
    if drafts:
        words.append(f"drafts {sum(r['accepted'] for r in step['batch'])}/{drafts} accepted")
    for hit in step["prefix_hits"]:
        words.append(f"{hit['request']}#{hit['index']} found {len(hit['blocks'])} blocks in the prefix cache")
    for src, dst in step["copied"]:
        words.append(f"block {src} copied to {dst}")
    if step["preempted"]:
        words.append(f"preempted {', '.join(p['request'] for p in step['preempted'])}")
    return ", ".join(words) or "nothing scheduled"


# ---- the command ---------------------------------------------------------------------------------------------
def cmd_trace_replay(args) -> int:
    out = check_output_path(args.out, "--out", sources=[args.path], suffix=".html")
    png = check_output_path(args.png, "--png", sources=[args.path], suffix=".png") if args.png else None
    if args.steps is not None:
        _step_list(args.steps)  # refused before any work
    trace = read_trace(args.path)
    if not trace.steps:
        raise ValueError(f"trace: {args.path} holds no step (the engine ran none); nothing to replay")
    write_html(trace, out)
    print(f"wrote {out}: {len(trace.steps)} steps, a pool of {trace.header['num_blocks']} blocks of "
          f"{trace.header['block_size']} tokens; open it in a browser (nothing is fetched)")
    if png is not None:
        steps = _step_list(args.steps) if args.steps is not None else _interesting_steps(trace)
        write_png(trace, steps, png)
        print(f"wrote {png}: steps {', '.join(map(str, steps))}")
    return 0


def _interesting_steps(trace: Trace, most: int = 3) -> list[int]:
    """Steps worth a picture when none are named: the first with a preemption, a copy-on-write, a prefix hit or
    drafts, else the first, middle and last."""
    picks = []
    for key in ("prefix_hits", "copied", "preempted"):
        first = next((s["step"] for s in trace.steps if s[key]), None)
        if first is not None and first not in picks:
            picks.append(first)
    drafted = next((s["step"] for s in trace.steps if any(r["drafts"] for r in s["batch"])), None)
    if drafted is not None and drafted not in picks:
        picks.append(drafted)
    if not picks:
        n = len(trace.steps)
        picks = sorted({trace.steps[0]["step"], trace.steps[n // 2]["step"], trace.steps[-1]["step"]})
    return sorted(picks[:most])


def _step_list(text: str) -> list[int]:
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--steps: {text!r} is not a comma-separated list of step numbers, e.g. 3,10,20") from None
    if not steps:
        raise ValueError("--steps: give at least one step number, e.g. 3,10,20")
    return steps


def register(sub) -> None:
    t = sub.add_parser("trace", help="an engine's trace (LLM(..., trace=PATH), serve-bench --trace-out)")
    verbs = t.add_subparsers(dest="trace", required=True)
    r = verbs.add_parser("replay", help="one HTML page to scrub through the steps (no network); a PNG of chosen steps")
    r.add_argument("path", help="the trace (JSON lines, docs/trace.md)")
    r.add_argument("--out", default="trace.html", help="the HTML page to write (default trace.html)")
    r.add_argument("--png", default=None, help="also draw chosen steps into this PNG (matplotlib)")
    r.add_argument("--steps", default=None,
                   help="--png: comma-separated step numbers (default: the first prefix hit, copy-on-write, "
                        "preemption and drafts)")
    r.set_defaults(func=cmd_trace_replay)
