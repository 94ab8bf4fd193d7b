"""What the engine records about its steps, for notebook 03's timeline and serve-bench's memory figures:
one ``StepRecord`` per step (one hook: ``EngineStats.record_step`` after the forward, ``end_step`` once the
step's tokens are appended), summed by ``EngineStats.summary``, and, when asked, one line of the engine's
trace per step (``trace.TraceWriter``). Nothing here changes what the engine computes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# step records an engine keeps (the latest): enough for any benchmark's run, bounded for a server's days
KEEP_RECORDS = 10_000


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups counted in full blocks: ``queries`` looked up, ``hits`` reused."""

    queries: int = 0
    hits: int = 0

    @property
    def misses(self) -> int:
        return self.queries - self.hits

    @property
    def hit_rate(self) -> float:
        """hits / queries (0 when nothing was looked up)."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class StepRecord:
    """One step: ``runs`` (request_id, index, tokens, "prefill"/"decode"/"recompute"), ``preempted``, the
    forward's (B, T), blocks in use and KV slots holding tokens after it, the blocks the running sequences
    would hold unshared, start / end (perf_counter s), and ``sampled`` (rows of the output layer)."""

    step: int
    runs: list[tuple[str, int, int, str]]
    preempted: list[tuple[str, int]]
    rows: tuple[int, int]
    used_blocks: int
    held_slots: int
    unshared_blocks: int
    start: float
    end: float
    sampled: int = 0


@dataclass
class EngineStats:
    """Counters over the engine's life: steps, preemptions, prompt tokens, prefix-cached prompt tokens, the
    block sums ``summary`` reads, and the latest per-step records (``StepRecord``): at least the last
    ``keep_records`` (None: every one), at most twice that, so a long-lived engine holds bounded state.
    ``trace``: a ``trace.TraceWriter`` that writes each step's line, or None."""

    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spec_decoding: object = None  # the engine's ``spec_decode.SpecDecodingStats`` when it speculates
    records: list[StepRecord] = field(default_factory=list)
    keep_records: int | None = KEEP_RECORDS
    trace: object = None
    # sums over every committed step, kept apart from the records so that ``summary`` covers the engine's life
    peak_blocks: int = 0
    used_blocks: int = 0
    held_slots: int = 0
    unshared_blocks: int = 0

    def __post_init__(self):
        k = self.keep_records
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"keep_records: the step records to keep must be an integer >= 0 or None (all), got {k!r}")

    def record_step(self, plan, shape, sampled, scheduler, start, step: int) -> StepRecord:
        """The hook, after a step's forward and before its tokens are appended: what ran, judged before it is
        computed ("recompute": computed before a preemption, "prefill": prompt tokens, or "decode"), what was
        preempted, the blocks in use, their slots holding tokens (shared blocks once), the blocks held unshared.
        Returns the record (``end`` = start until ``end_step``); ``add`` keeps it once the step commits."""
        def kind(seq):
            if seq.num_output_tokens > 1 and seq.num_computed_tokens < seq.num_tokens - 1:
                return "recompute"
            return "prefill" if seq.is_prefill else "decode"
        manager, filled, unshared = scheduler.manager, {}, 0
        for seq in scheduler.running:
            n = manager.num_tokens(seq.seq_id)
            table = manager.block_table(seq.seq_id)
            unshared += len(table)
            for j, block in enumerate(table):
                filled[block] = max(filled.get(block, 0), min(manager.block_size, n - j * manager.block_size))
        runs = [(s.request_id, s.index, n, kind(s)) for s, n in plan.scheduled]
        preempted = [(s.request_id, s.index) for s in plan.preempted]
        if self.trace is not None:  # what only this moment shows: prefix hits and drafts, before the commit
            self.trace.planned(plan)
        return StepRecord(step, runs, preempted, shape, manager.num_used_blocks, sum(filled.values()),
                          unshared, start, start, sampled)

    def add(self, rec: StepRecord, admitted: list[tuple[int, int]] = ()) -> None:
        """Keep a committed step's record; ``admitted``: (prompt tokens, prefix-cached tokens) of each
        request the step ran for the first time."""
        self.records.append(rec)
        if self.keep_records is not None and len(self.records) >= 2 * max(self.keep_records, 1):
            del self.records[:-self.keep_records or None]  # in halves: each record is moved once on average
        self.steps = rec.step + 1  # the engine's count (``LLMEngine.steps``), read back, not kept twice
        self.preemptions += len(rec.preempted)
        self.peak_blocks = max(self.peak_blocks, rec.used_blocks)
        self.used_blocks += rec.used_blocks
        self.held_slots += rec.held_slots
        self.unshared_blocks += rec.unshared_blocks
        for prompt, cached in admitted:
            self.prompt_tokens += prompt
            self.cached_tokens += cached

    def end_step(self, rec: StepRecord, plan, ready, draws, outputs) -> None:
        """The step's tokens are appended and its stops done: its end time, and its trace line (``trace``) from
        the plan, the ready sequences' draws and the step's outputs."""
        rec.end = time.perf_counter()
        if self.trace is not None:
            self.trace.write(rec, plan, ready, draws, outputs)

    def summary(self, block_size: int) -> dict:
        """peak_blocks, mean_blocks (per step), kv_utilization (slots holding tokens / slots of used
        blocks, summed over steps), sharing_saved (1 - used / unshared blocks, summed over steps),
        preemptions, prefix_hit_rate (cached / prompt tokens), steps: over every step of the engine's life."""
        used, unshared = self.used_blocks, self.unshared_blocks
        return {"steps": self.steps, "preemptions": self.preemptions,
                "peak_blocks": self.peak_blocks, "mean_blocks": used / self.steps if self.steps else 0.0,
                "kv_utilization": self.held_slots / (block_size * used) if used else 0.0,
                "sharing_saved": 1 - used / unshared if unshared else 0.0,
                "prefix_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0}
