"""What the engine records about its steps, for notebook 03's timeline and serve-bench's memory figures:
one ``StepRecord`` per step (one hook, ``EngineStats.record_step``), summed by ``EngineStats.summary``.
Nothing here changes what the engine computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """Counters over the engine's life: steps, preemptions, prompt tokens, prefix-cached prompt tokens,
    and the per-step records (``StepRecord``)."""

    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spec_decoding: object = None  # the engine's ``spec_decode.SpecDecodingStats`` when it speculates
    records: list[StepRecord] = field(default_factory=list)

    def record_step(self, plan, shape, sampled, scheduler, start) -> StepRecord:
        """The hook, after a step's forward and before its tokens are appended: what ran, judged before it is
        computed ("recompute": computed before a preemption, "prefill": prompt tokens, or "decode"), what was
        preempted, the blocks in use, their slots holding tokens (shared blocks once), the blocks held unshared.
        Returns the record (``end`` = start until the engine sets it); ``add`` keeps it once the step commits."""
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
        return StepRecord(len(self.records), runs, preempted, shape, manager.num_used_blocks, sum(filled.values()),
                          unshared, start, start, sampled)

    def add(self, rec: StepRecord, admitted: list[tuple[int, int]] = ()) -> None:
        """Keep a committed step's record; ``admitted``: (prompt tokens, prefix-cached tokens) of each
        request the step ran for the first time."""
        self.records.append(rec)
        self.steps += 1
        self.preemptions += len(rec.preempted)
        for prompt, cached in admitted:
            self.prompt_tokens += prompt
            self.cached_tokens += cached

    def summary(self, block_size: int) -> dict:
        """peak_blocks, mean_blocks (per step), kv_utilization (slots holding tokens / slots of used
        blocks, summed over steps), sharing_saved (1 - used / unshared blocks, summed over steps),
        preemptions, prefix_hit_rate (cached / prompt tokens), steps."""
        used = [r.used_blocks for r in self.records]
        total_used = sum(used)
        unshared = sum(r.unshared_blocks for r in self.records)
        return {"steps": self.steps, "preemptions": self.preemptions,
                "peak_blocks": max(used, default=0), "mean_blocks": total_used / len(used) if used else 0.0,
                "kv_utilization": sum(r.held_slots for r in self.records) / (block_size * total_used) if total_used else 0.0,
                "sharing_saved": 1 - total_used / unshared if unshared else 0.0,
                "prefix_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0}
