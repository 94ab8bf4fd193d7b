"""The scheduler of continuous batching: which sequences run in the next step, and how many tokens each.

Orca (Yu et al. 2022, Sec. 4: the batch is re-formed every step), vLLM (Kwon et al. 2023, Sec. 4.5:
preempt the latest sequences when the pool runs out, recompute them later) and vLLM V1: no prefill or
decode phases; each sequence catches up with its known tokens within ``max_num_batched_tokens``, so a long
prompt runs in chunks beside other sequences' decodes. One step (``schedule``):
1. Running sequences, oldest first, each min(tokens to catch up, budget left); when the pool cannot hold
   them, preempt the newest running sequence until they fit or it was itself the newest.
2. Unless something was preempted: waiting sequences in priority order while the budget, the seats
   (``max_num_seqs``) and the pool allow; the first that does not fit stops admission (no overtaking, so
   no starvation). Prefix-cache hits count as computed; drafts take only what own tokens leave.
Blocks are reserved as each sequence is planned, so the forward writes only where it was told; ``rollback``
undoes a failed plan.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .beam import BeamSearchParams
from .block_manager import BlockManager, NoFreeBlocksError, blocks_for
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's plan: ``scheduled`` (sequence, new tokens) in row order, ``preempted`` and ``admitted``
    sequences, and the (source, destination) block ``copies`` to make before the forward (copy-on-write)."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    planned: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens, while planning


class Scheduler:
    """Waiting and running sequences over one ``BlockManager``; ``max_num_seqs``: seats for running sequences
    (``Sequence.seats``), ``max_num_batched_tokens``: tokens per step (prefill chunks and decodes together).

    Raises:
        ValueError: a limit below 1.
    """

    def __init__(self, manager: BlockManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 256):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if value < 1:
                raise ValueError(f"{name}: must be at least 1, got {value}")
        self.manager, self.max_num_seqs, self.max_num_batched_tokens = manager, max_num_seqs, max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by priority
        self.running: list[Sequence] = []  # sorted by priority: the last is preempted first
        self.plan = SchedulerOutput()  # the last step's plan

    def add(self, seq: Sequence) -> None:
        """Queue a new (or preempted) sequence; it holds no blocks."""
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.priority)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds blocks (a fork) joins the running ones."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.priority)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks (if it holds any)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.manager.holds(seq.seq_id):  # also a fork caught between its blocks and the running list
            self.manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it to be recomputed (Kwon et al., Sec. 4.5)."""
        self.running.remove(seq)
        seq.spec_token_ids = []  # it resumes without a stale draft
        try:
            self._free(seq)
        finally:  # whatever happens, it is in one of the lists
            self.add(seq)

    def _free(self, seq: Sequence) -> None:
        """A sequence that waits holds no blocks; it recomputes from its first token."""
        self.manager.free(seq.seq_id)
        seq.num_computed_tokens = 0

    def check_fits(self, request_id: str, num_prompt_tokens: int, params, context: int) -> None:
        """Refuse a request that could never run: more samples or beams than run together, or more blocks than
        the pool holds (prompt + max_tokens, for each beam), so the oldest request always fits alone.
        ``context``: the tokens it may reach (``generation.check_prompt``).

        Raises:
            ValueError: naming n or beam_width, or the blocks needed and the pool's.
        """
        beam = isinstance(params, BeamSearchParams)
        num_blocks, block_size = self.manager.num_blocks, self.manager.block_size
        width, name = (params.beam_width, "beam_width") if beam else (params.n, "n")
        most = self.max_num_seqs if beam else min(self.max_num_seqs, num_blocks)
        if width > most:
            raise ValueError(f"{name}: {width} {'beams' if beam else 'samples'} must run together, but at most {most} "
                             f"can (max_num_seqs={self.max_num_seqs}, a pool of {num_blocks} blocks); "
                             f"lower {name} or raise max_num_seqs / the pool")
        copies = width if beam else 1
        per_seq = blocks_for(min(context, num_prompt_tokens + params.max_new_tokens), block_size)
        if copies * per_seq > num_blocks:
            each = f" ({per_seq} for each of {copies} beams)" if beam else ""
            raise ValueError(f"request {request_id!r}: its prompt ({num_prompt_tokens} tokens) and max_tokens "
                             f"({params.max_new_tokens}) need {copies * per_seq} blocks of {block_size} tokens{each}, "
                             f"but the pool has {num_blocks} blocks; lower max_tokens or give more blocks")

    def schedule_or_preempt_idle(self) -> SchedulerOutput:
        """``schedule``; when nothing fits although requests wait, preempt the newest running sequence if it is
        newer than the first waiting one (beams waiting for a sibling hold blocks the sibling needs) and plan
        again. ``preempted`` lists every one preempted.

        Raises:
            RuntimeError: nothing can run (a bug: ``check_fits`` lets the oldest request fit alone).
        """
        out = self.schedule()
        preempted = list(out.preempted)
        while not out.scheduled and self.has_unfinished():
            if not self.waiting or not self.running or self.running[-1].priority <= self.waiting[0].priority:
                raise RuntimeError(f"scheduler: nothing can run ({len(self.waiting)} waiting, {len(self.running)} "
                                   f"running, {self.manager.num_free_blocks} free blocks); this is a bug, please "
                                   "report it")
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
            out = self.schedule()
            preempted += out.preempted
        out.preempted = preempted
        return out

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (the module docstring's two phases) and reserve its blocks. A sequence with
        nothing to compute (a beam waiting for its siblings) holds its blocks and gets no tokens."""
        out = self.plan = SchedulerOutput()  # kept while the step runs: ``rollback`` undoes it
        self.manager.begin()
        budget = self.max_num_batched_tokens
        own, left = self._own_needs()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = own.pop(seq.seq_id, (0, 0))  # planned now: the budget and the free blocks lose it below
            left = (left[0] - need[0], left[1] - need[1])  # what the sequences after it still need
            if seq.spec_token_ids:
                n = self._with_drafts(seq, n, budget - left[0], self.manager.num_free_blocks - left[1])
            if n <= 0:
                i += 1
                continue
            while not self._reserve(seq, n, out) and self.running[-1] is not seq:
                victim = self.running[-1]
                budget += out.planned.pop(victim.seq_id, 0)
                self.preempt(victim)
                out.preempted.append(victim)
            if seq.seq_id not in out.planned:  # it is the newest itself: it waits, recomputed later
                self.preempt(seq)
                out.preempted.append(seq)
                break
            budget -= n
            i += 1
        if not out.preempted:
            seats = sum(s.seats for s in self.running)
            while self.waiting and budget > 0 and seats + self.waiting[0].seats <= self.max_num_seqs:
                seq = self.waiting[0]
                cached = self.manager.allocate(seq.seq_id, seq.token_ids)
                try:
                    seq.num_computed_tokens = cached
                    reserved = self._reserve(seq, min(seq.num_tokens - cached, budget), out)
                finally:
                    if seq.seq_id not in out.planned:  # not admitted (or an error): its cached blocks go back
                        self._free(seq)  # to the free queue, still cached
                if not reserved:
                    break
                out.admitted.append(seq)  # first: a rollback from here on sends it back to waiting
                self.waiting.pop(0)
                try:
                    self.add_running(seq)
                finally:
                    if seq not in self.running:  # interrupted between the lists: it waits again
                        self._free(seq)
                        self.add(seq)
                budget -= out.planned[seq.seq_id]
                seats += seq.seats
        out.scheduled = [(s, out.planned[s.seq_id]) for s in self.running if s.seq_id in out.planned]
        if self.manager.step_copies:  # the copy-on-write of this plan, less a preempted victim's
            held = {b for s, _ in out.scheduled for b in self.manager.block_table(s.seq_id)}
            out.copies = [(src, dst) for src, dst in self.manager.step_copies if dst in held]
        return out

    def _own_needs(self) -> tuple[dict[int, tuple[int, int]], tuple[int, int]]:
        """(tokens, blocks) each running sequence's own tokens take this step, and their sum, so that drafts only
        use what is left; ({}, (0, 0)) when no running sequence carries drafts."""
        if not any(s.spec_token_ids for s in self.running):
            return {}, (0, 0)
        own = {}
        for s in self.running:
            n, c = s.num_tokens - s.num_computed_tokens, s.num_computed_tokens
            own[s.seq_id] = (max(n, 0), self.manager.blocks_needed(s.seq_id, c, c + n) if n > 0 else 0)
        return own, (sum(t for t, _ in own.values()), sum(b for _, b in own.values()))

    def _with_drafts(self, seq: Sequence, n: int, budget: int, blocks: int) -> int:
        """The sequence's n own tokens plus the drafts that fit in ``budget`` tokens and ``blocks`` free blocks
        (what the others' own tokens leave), so it speculates less before anyone is preempted; drops the rest."""
        c, base = seq.num_computed_tokens, seq.num_tokens - seq.num_computed_tokens
        d = min(len(seq.spec_token_ids), max(0, budget - base)) if n == base else 0
        while d and self.manager.blocks_needed(seq.seq_id, c, c + base + d) > blocks:
            d -= 1
        del seq.spec_token_ids[d:]
        return n + d

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Slots for the sequence's next n tokens (and its copy-on-write); False, changing nothing, if none."""
        try:
            self.manager.grow(seq.seq_id, seq.num_computed_tokens + n)  # its copies: manager.step_copies
        except NoFreeBlocksError:
            return False
        out.planned[seq.seq_id] = n
        return True

    def rollback(self) -> None:
        """Undo the last plan, whose forward did not complete: its block names are forgotten, the sequences it
        admitted wait again (they may have found those blocks), and every running sequence gives back the slots
        past its computed tokens."""
        self.manager.rollback()
        for seq in self.plan.admitted:
            if seq in self.running:
                self.preempt(seq)
        for seq in self.waiting:  # interrupted between its admission's lookup and joining the running ones
            if self.manager.holds(seq.seq_id):
                self._free(seq)
        self.plan = SchedulerOutput()  # undone: a second rollback has nothing to undo
        for seq in self.running:
            if self.manager.num_tokens(seq.seq_id) > seq.num_computed_tokens:
                self.manager.truncate(seq.seq_id, seq.num_computed_tokens, keep_token_ids=True)
