"""The engine's flight recorder: one JSON line per step, for ``python -m minillm trace replay``.

``LLMEngine(..., trace=PATH)`` (and ``LLM``) hands a ``TraceWriter`` to the engine's statistics hook
(``stats.EngineStats``): after the forward it notes what only that moment shows (prefix hits of the sequences
admitted, the drafts in the batch), and once the step's tokens are appended it writes the step: the batch,
every sequence's block table, the blocks taken, freed, shared and copied on write, the prefix cache's changes,
preemptions, finished samples and the free count. It only reads the engine (copies of tables, the prefix
cache's block ids), so a traced run computes and caches exactly what an untraced one does. The schema, line by
line: docs/trace.md.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path


__all__ = ["TRACE_FORMAT", "TRACE_VERSION", "TraceWriter", "check_trace_path"]

TRACE_FORMAT = "minillm engine trace"
TRACE_VERSION = 1


def check_trace_path(path) -> Path:
    """The trace's path, checked before any work: a file in an existing folder (it is overwritten).

    Raises:
        ValueError: naming the path, when it is a folder or its folder does not exist.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"trace: {path} is a folder; give a file path such as {path / 'trace.jsonl'}")
    if not path.parent.is_dir():
        raise ValueError(f"trace: the folder {path.parent} does not exist; create it or write the trace elsewhere")
    return path


class TraceWriter:
    """Writes an engine's steps to ``path`` (JSON lines: a header, then one line per committed step).

    Args:
        path: the file (overwritten; ``check_trace_path``). engine: the ``LLMEngine`` it records (read only).

    Raises:
        ValueError: a bad path (``check_trace_path``). OSError: the file cannot be opened.
    """

    def __init__(self, path, engine):
        self.path = check_trace_path(path)
        self.manager, self.scheduler, self.tokenizer = engine.manager, engine.scheduler, engine.tokenizer
        self.requests = engine.requests  # the engine's own dict, read to forget aborted requests' samples
        self._file = open(self.path, "w", encoding="utf-8", buffering=1)  # a line per step, each flushed whole
        self._t0 = time.perf_counter()
        # what the last line said, so that this one writes only what changed (bounded by the running sequences)
        self._held: set[int] = set()
        self._cached: set[int] = set()
        self._written: dict[int, int] = {}  # seq_id -> its token ids written so far
        self._reported: set[tuple[str, int]] = set()  # finished samples of requests still running
        self._hits: list[dict] = []
        self._drafts: dict[int, int] = {}
        spec = engine.spec
        self._emit({"format": TRACE_FORMAT, "version": TRACE_VERSION, "num_blocks": self.manager.num_blocks,
                    "block_size": self.manager.block_size, "max_num_seqs": self.scheduler.max_num_seqs,
                    "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
                    "prefix_caching": self.manager.enable_prefix_caching,
                    "speculative": None if spec is None else spec.config.method,
                    "tokens_as_text": self.tokenizer is not None})

    def planned(self, plan) -> None:
        """After the forward, before the commit: the admitted sequences' prefix hits (their computed tokens are
        still what the prefix cache served) and each scheduled sequence's drafts in the batch."""
        bs = self.manager.block_size
        self._hits = [{"request": s.request_id, "index": s.index, "seq": s.seq_id,
                       "blocks": self.manager.block_table(s.seq_id)[:s.num_computed_tokens // bs]}
                      for s in plan.admitted if s.num_computed_tokens >= bs]
        self._drafts = {s.seq_id: len(s.spec_token_ids) for s, _ in plan.scheduled if s.spec_token_ids}

    def write(self, rec, plan, ready, draws, outputs) -> None:
        """The committed step's line (docs/trace.md). A write that fails stops the trace, saying so once on
        stderr; the engine goes on."""
        if self._file is None:
            return
        runs = {s.seq_id: d for s, d in zip(ready, draws) if d.drafted}
        batch = []
        for (seq, _), (rid, index, n, kind) in zip(plan.scheduled, rec.runs):
            run = runs.get(seq.seq_id)
            drafts = run.drafted if run is not None else self._drafts.get(seq.seq_id, 0)
            batch.append({"request": rid, "index": index, "seq": seq.seq_id, "kind": kind, "tokens": n,
                          "drafts": drafts, "accepted": run.accepted if run is not None else 0})
        line = {"step": rec.step, "time": round(rec.start - self._t0, 6), "seconds": round(rec.end - rec.start, 6),
                "budget": self.scheduler.max_num_batched_tokens, "rows": list(rec.rows), "batch": batch,
                "preempted": [{"request": s.request_id, "index": s.index, "seq": s.seq_id} for s in plan.preempted],
                "finished": self._finished(outputs), "prefix_hits": self._hits,
                "copied": [list(c) for c in plan.copies]}
        line.update(self._blocks())
        self._hits, self._drafts = [], {}
        self._emit(line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # ---- internals -----------------------------------------------------------------------------
    def _blocks(self) -> dict:
        """Every sequence's table and new tokens, and the pool's changes since the last line."""
        manager, by_id = self.manager, {s.seq_id: s for s in self.scheduler.running}
        seqs, counts, written = [], Counter(), {}
        for sid in manager.seq_ids():
            table, seq = manager.block_table(sid), by_id.get(sid)
            counts.update(table)
            entry = {"seq": sid, "request": None if seq is None else seq.request_id,
                     "index": None if seq is None else seq.index, "table": table,
                     "computed": manager.num_tokens(sid)}
            if seq is not None:
                ids = seq.token_ids
                start = self._written.get(sid, 0)
                start = start if start <= len(ids) else 0
                new = ids[start:]
                entry.update({"from": start, "tokens": new})
                if self.tokenizer is not None:
                    entry["pieces"] = [self.tokenizer.decode([t]) for t in new]
                written[sid] = len(ids)
            seqs.append(entry)
        self._written = written  # sequences that hold no blocks write their tokens again when they return
        held, cached = set(counts), manager.prefix_cache.cached_blocks()
        out = {"seqs": seqs, "taken": sorted(held - self._held), "freed": sorted(self._held - held),
               "shared": sorted(b for b, c in counts.items() if c > 1),
               "cached_new": sorted(cached - self._cached), "cached_gone": sorted(self._cached - cached),
               "free": manager.num_free_blocks}
        self._held, self._cached = held, cached
        return out

    def _finished(self, outputs) -> list[dict]:
        """Samples that finished in this step (each once, also when its request runs on), and why."""
        done = []
        for out in outputs:
            for c in out.outputs:
                key = (out.request_id, c.index)
                if c.finish_reason is not None and key not in self._reported:
                    done.append({"request": out.request_id, "index": c.index, "reason": c.finish_reason})
                    self._reported.add(key)
            if out.finished:
                self._reported -= {(out.request_id, c.index) for c in out.outputs}
        if self._reported:  # a request aborted between steps sends no last output
            self._reported = {k for k in self._reported if k[0] in self.requests}
        return done

    def _emit(self, obj: dict) -> None:
        try:
            self._file.write(json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n")
        except (OSError, ValueError) as e:  # a full disk, a closed file: the engine serves on, untraced
            print(f"trace: writing {self.path} failed ({e}); the engine goes on without its trace", file=sys.stderr)
            self._file = None
