"""``LLMEngine``: continuous batching over one pool of KV blocks, in vLLM's API.

Yu et al. 2022 (Orca, Sec. 4: iteration-level scheduling) and Kwon et al. 2023 (vLLM, arXiv 2309.06180,
Sec. 4.3-4.5: sequences decode together over one block pool; preemption by recompute). ``step()`` is the
paper's loop: schedule (blocks reserved), pack every scheduled token into one forward on the
``PagedKVCache``, sample each sequence that caught up with its known tokens, append, stop. Until its tokens
are drawn a step that raises is undone, so a retry computes the same tokens. One thread drives an engine.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

from ..stops import stop_ids
from ..kv_cache import kv_cache_bytes as kv_bytes_of
from ..loading import load_model
from ..sampling_params import SamplingParams
from .batching import pack_flat, pack_rows
from .beam import BeamSearchParams
from .cache import backend
from .config import DEFAULT_KV_BYTES, check_engine_args
from .requests import RequestTracker
from .scheduler import Scheduler, SchedulerOutput
from .outputs import RequestOutput
from .sequence import Request, Sequence
from .spec_decode import SpecDecoder, check_speculative_config
from .stats import KEEP_RECORDS, EngineStats
from .signals import interrupts_deferred
from .trace import TraceWriter

__all__ = ["DEFAULT_KV_BYTES", "LLMEngine"]


class LLMEngine:
    """Requests in, ``RequestOutput``s out, one step at a time (vLLM's ``LLMEngine``).

    Args:
        model: a ``minillm.model.Decoder``; tokenizer: for text prompts, stop strings and ``text`` (or None).
        block_size, num_blocks, kv_cache_bytes: the pool (``PagedKVCache``); without either size,
            ``DEFAULT_KV_BYTES`` or what max_num_seqs full-context sequences take, whichever is less.
        enable_prefix_caching: reuse full blocks across requests (``num_cached_tokens``).
        max_num_seqs, max_num_batched_tokens: the scheduler's limits (forks and beams take seats too).
        eos_ids: ids that end a sequence (default: the tokenizer's EOS); max_seq_len: the context (default and
            at most: the model's).
        attention: how the forward reads the pool (``cache.BACKENDS``): None for the model's own
            (``model.paged_backend``: "blockwise", the online softmax of ``attention.py``, unless the speed layer
            set "bucketed"); "blockwise", "bucketed" and "fused" take one flat (1, N) row; "gather" (the
            reference) and "indexed" take (B, T) rows padded to the longest (``row_width`` forces T).
        record_logits: keep each sequence's next-token logits (tests compare them with a recompute).
        speculative_config: vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 4} or
            {"method": "draft_model", "model": PATH_OR_DECODER, "num_speculative_tokens": "auto"}.
        trace: a path: one JSON line per step (``trace.TraceWriter``, the schema in docs/trace.md), for
            ``python -m minillm trace replay``; None (default) records nothing.
        log_stats: keep counters and step records in ``stats`` (``EngineStats``; vLLM's ``log_stats``): the server,
            the benchmarks and a trace read them; ``LLM`` turns them off unless asked (``disable_log_stats``).
        keep_records: step records kept in ``stats.records`` (the latest; None: all), ``stats.KEEP_RECORDS``.

    Raises:
        ValueError: a setting (``check_engine_args``) or a speculative_config field (``check_speculative_config``).
    """

    def __init__(self, model, tokenizer=None, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: float | None = None, enable_prefix_caching: bool = True, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 256, eos_ids=None, max_seq_len: int | None = None,
                 row_width: int | None = None, record_logits: bool = False, attention: str | None = None,
                 speculative_config: dict | None = None, trace=None, keep_records: int | None = KEEP_RECORDS,
                 log_stats: bool = True):
        attention = attention or model.paged_backend
        check_engine_args(block_size, num_blocks, kv_cache_bytes, max_num_seqs, max_num_batched_tokens, max_seq_len,
                          attention, row_width)  # before the KV pool is allocated
        spec = check_speculative_config(speculative_config, model,
                                        lambda path: load_model(path, dtype=model.dtype, device=model.device,
                                                                      fast=model.accelerated)[0])
        self.model, self.tokenizer = model, tokenizer
        self.max_seq_len = min(max_seq_len or model.config.max_seq_len, model.config.max_seq_len)
        if num_blocks is None and kv_cache_bytes is None:
            kv_cache_bytes = min(DEFAULT_KV_BYTES, kv_bytes_of(model.config, max_num_seqs, self.max_seq_len,
                                                               model.dtype.itemsize))
        self.cache = backend(attention)(model.config, num_blocks, block_size, kv_bytes=kv_cache_bytes, dtype=model.dtype,
                                  device=model.device, enable_prefix_caching=enable_prefix_caching,
                                  attention=attention)
        self.manager, self.block_size = self.cache.manager, block_size
        self.scheduler = Scheduler(self.manager, max_num_seqs, max_num_batched_tokens)
        self.eos_ids = stop_ids(tokenizer, eos_ids)
        self.row_width, self.flat = row_width, attention in self.cache.FLAT_PATHS  # one flat row, or (B, T) padded rows
        self.tracker = RequestTracker(model, tokenizer, self.scheduler, self.eos_ids, self.max_seq_len,
                                      record_logits=record_logits)
        self.requests, self.beams, self.logits = self.tracker.requests, self.tracker.beams, self.tracker.logits
        self.steps = 0  # committed steps: "auto" speculation fades a sequence's acceptance record by them
        self.spec = self.tracker.spec = None  # the tracker verifies and appends the drafts
        if spec is not None:
            self.spec = self.tracker.spec = SpecDecoder(spec, model, tokenizer, self.scheduler, self.requests,
                                                        self.max_seq_len, lambda: self.steps)
        self.stats = None
        if log_stats or trace is not None:
            self.stats = EngineStats(spec_decoding=self.spec.stats if self.spec is not None else None,
                                     keep_records=keep_records)
        if trace is not None:  # last: the writer reads the engine's settings
            self.stats.trace = TraceWriter(trace, self)
        self._pending: list[RequestOutput] = []  # outputs of a step that raised: the next step returns them
        self._driver = threading.RLock()

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @contextmanager
    def driving(self):
        """Hold the engine for the calling thread (re-entrant), as every public call and ``LLM.generate`` do.

        Raises:
            RuntimeError: another thread holds it (a server funnels its requests through one thread).
        """
        if not self._driver.acquire(blocking=False):
            raise RuntimeError("LLMEngine: another thread is driving this engine (step, add_request, abort_request "
                               "or LLM.generate is running there); drive an engine from one thread at a time, or "
                               "give each thread its own LLM")
        try:
            yield
        finally:
            self._driver.release()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | BeamSearchParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. ``prompt``: a string (needs the tokenizer), ``{"prompt_token_ids": [...]}`` or a
        list of token ids; ``params``: ``SamplingParams`` (default: greedy, 64 tokens) or ``BeamSearchParams``.

        Raises:
            ValueError: a request_id in use, or what ``RequestTracker.add`` refuses.
            RuntimeError: another thread is driving the engine (``driving``).
        """
        with self.driving():
            if request_id in self.requests or any(out.request_id == request_id for out in self._pending):
                raise ValueError(f"request_id: {request_id!r} is already running (or its last output is not yet "
                                 "returned by step); give each request its own id")
            self.tracker.add(request_id, prompt, params, arrival_time)

    def abort_request(self, request_id) -> None:
        """Stop a request (or an iterable of them) now and return its blocks; unknown ids are ignored (as vLLM).
        Raises RuntimeError when another thread is driving the engine."""
        with self.driving(), interrupts_deferred():
            gone = self.tracker.abort_ids(request_id)
            self._pending = [out for out in self._pending if out.request_id not in gone]  # the caller let them go

    def has_unfinished_requests(self) -> bool:
        """Whether a request runs, waits, or has an output that the next ``step`` returns."""
        return bool(self.requests or self._pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests) + len(self._pending)

    def block_table(self, request_id: str, index: int = 0) -> list[int]:
        """The physical blocks of a running sequence (``BlockManager.block_table``)."""
        seq = next(s for s in self.requests[request_id].seqs if s.index == index)
        return self.manager.block_table(seq.seq_id)

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, pack, forward, sample, append, stop. Returns a cumulative ``RequestOutput`` (vLLM's
        default) for every request that got a token or finished (or that a failed step aborted).

        Raises:
            whatever the forward or sampling raised, after undoing the step; RuntimeError: another thread
                drives the engine, or nothing could be scheduled although requests wait (a bug).
        """
        with self.driving(), self._outputs() as outputs:
            start = time.perf_counter()
            with self._undone_on_error():  # until its tokens are drawn, a step that raises never happened
                plan = self._schedule()  # schedule: drafts proposed, blocks reserved, copy-on-write done
                if not plan.scheduled:
                    return outputs
                rows, ready = self._pack(plan)  # pack: every scheduled token in one forward's rows
                logits = self._forward(rows, ready)  # forward: the ready sequences' next-token logits
                record = (self.stats.record_step(plan, rows.shape, len(ready), self.scheduler, start, self.steps)
                          if self.stats is not None else None)
                draws = self.tracker.draw(ready, logits)  # sample
            with interrupts_deferred():  # the forward wrote its tokens: from here the step stands
                self._commit(plan, start, record, outputs)
                self.tracker.append(ready, draws, outputs, self._append)  # append, stop
            if self.stats is not None:
                self.stats.end_step(record, plan, ready, draws, outputs)
            return outputs

    @contextmanager
    def _outputs(self):
        """The step's outputs, led by those a failed step left; if this step fails too, they wait for the next."""
        outputs, self._pending = self._pending, []
        try:
            yield outputs
        except BaseException:
            self._pending[:0] = outputs
            raise

    @contextmanager
    def _undone_on_error(self):
        """Undo a step that raises: its plan and drafts are dropped, and a copy-on-write whose destination the
        sequence keeps is made again (the failed forward may have written there), so a retry computes the same."""
        try:
            yield
        except BaseException:
            with interrupts_deferred():
                held = {b for s in self.scheduler.running if self.manager.holds(s.seq_id)
                        for b in self.manager.block_table(s.seq_id)}
                self.cache.copy_blocks([(src, dst) for src, dst in self.manager.step_copies if dst in held])
                if self.spec is not None:
                    self.spec.discard(self.scheduler.running)
                self.scheduler.rollback()
            raise

    def _schedule(self) -> SchedulerOutput:
        """Drafts proposed, then the scheduler's plan (``Scheduler.schedule_or_preempt_idle``) and its copies made."""
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)  # drafts, before the plan that places them
        with interrupts_deferred():  # bookkeeping: an interrupt waits for the forward
            plan = self.scheduler.schedule_or_preempt_idle()
            for seq in plan.preempted:
                self.beams.drop(seq.seq_id)
            self.cache.copy_blocks(plan.copies)
            if not plan.scheduled:
                self.manager.commit()
        return plan

    def _pack(self, plan):
        """Every scheduled token in one flat row or (B, T) rows, the cache told whose each row is; returns the
        rows and the sequences that catch up with their known tokens (they sample)."""
        spans = [(s.seq_id, s.num_computed_tokens, (s.token_ids[s.num_computed_tokens:] + s.spec_token_ids)[:n])
                 for s, n in plan.scheduled]  # drafts ride after the sequence's own tokens
        rows = (pack_flat(spans, self.model.device) if self.flat
                else pack_rows(spans, max(a + len(t) for _, a, t in spans), self.model.device, self.row_width))
        self.cache.set_rows(rows.seq_ids, rows.widths, reserved=True)
        return rows, [s for s, n in plan.scheduled if s.num_computed_tokens + n >= s.num_tokens]

    def _forward(self, rows, ready: list[Sequence]) -> torch.Tensor:
        """One forward over the packed rows; the ready sequences' next-token logits (R, V), computed there only."""
        at = (self.spec.logits_indices(rows, ready) if self.spec is not None  # the pending token and each draft
              else rows.logits_indices([s.seq_id for s in ready]))
        begun = time.perf_counter()
        logits = self.model(rows.tokens, rows.input_pos, self.cache, logits_indices=at)
        if self.spec is not None:  # "auto" follows the machine's load
            self.spec.observe(rows.tokens.numel(), time.perf_counter() - begun)
        return logits

    def _commit(self, plan, start: float, record, outputs: list[RequestOutput]) -> None:
        """The forward wrote every scheduled token: they count as computed, their blocks' names hold, the
        record is kept. If that fails halfway, the step's requests end ("abort") and join ``outputs``."""
        try:
            self.manager.commit()
            self.scheduler.plan = SchedulerOutput()
            admitted = []
            for seq, n in plan.scheduled:
                req = self.requests[seq.request_id]
                if req.num_cached_tokens is None:  # its first admission: what the prefix cache served
                    req.num_cached_tokens, req.metrics.first_scheduled_time = seq.num_computed_tokens, start
                    admitted.append((len(req.prompt_token_ids), req.num_cached_tokens))
                seq.num_computed_tokens += n
            self.steps += 1
            if self.stats is not None:
                self.stats.add(record, admitted)
        except BaseException:
            for rid in dict.fromkeys(s.request_id for s, _ in plan.scheduled):
                req = self.requests.get(rid)
                if req is not None:
                    self.tracker.abort(req)
                    outputs.append(self.tracker.output(req))
            raise

    def _append(self, req: Request, seq: Sequence, token: int, logprob: float) -> None:
        """A drawn token joins the sequence's known tokens; then its stops (``RequestTracker.check_stop``)."""
        now = time.perf_counter()
        seq.token_ids.append(token)  # the block manager reads this list: one ledger of known tokens
        seq.cumulative_logprob += logprob
        req.metrics.first_token_time = req.metrics.first_token_time or now
        req.metrics.last_token_time = now
        self.tracker.check_stop(req, seq)
