"""``LLMEngine``: continuous batching over one pool of KV blocks, in vLLM's API.

Yu et al. 2022 (Orca, Sec. 4: iteration-level scheduling) and Kwon et al. 2023 (vLLM, arXiv 2309.06180,
Sec. 4.3-4.5: sequences decode together over one block pool; samples and beams share blocks; preemption
by recompute). ``step()`` is the paper's loop: schedule (``Scheduler``, blocks reserved), pack every
scheduled token into one forward (``batching``), run ``Decoder.forward`` on the ``PagedKVCache``, sample
each sequence that caught up with its known tokens (sample 0 seeded with the request's seed, so a seeded
request draws the same tokens alone as in any batch), append, stop. Statistics: ``stats.py``; beams:
``beam.py``; drafts: ``spec_decode.py``.

A step is all or nothing until its tokens are drawn: a failure undoes it (blocks named for it leave the
prefix cache, admitted sequences wait again, generators are restored), so a retry computes the same
tokens. A request whose append fails is aborted and says so ("abort", returned by the next ``step``).
One thread drives an engine at a time (``driving``).
"""

from __future__ import annotations

import numbers
import threading
import time
from collections.abc import Iterable
from contextlib import contextmanager

import torch

from ..generation import GenerationResult, Stopper, check_prompt, stop_ids
from ..kv_cache import kv_cache_bytes as kv_bytes_of
from ..loading import load_model
from ..sampling import SamplingParams
from .batching import pack_flat, pack_rows
from .beam import BeamSearchParams, EngineBeams
from .cache import ATTENTION_PATHS, FLAT_PATHS, PagedKVCache
from .sampler import draw_tokens, sample_generator
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Request, RequestMetrics, RequestOutput, Sequence, prompt_ids, request_output
from .spec_decode import Run, SpecDecoder, check_speculative_config
from .stats import EngineStats, StepRecord
from .signals import interrupts_deferred

__all__ = ["LLMEngine", "EngineStats", "StepRecord", "check_engine_args"]

DEFAULT_KV_BYTES = 512 * 2 ** 20  # the pool when neither num_blocks nor kv_cache_bytes is given (at most)
GREEDY = SamplingParams()


def check_engine_args(block_size=16, num_blocks=None, kv_cache_bytes=None, max_num_seqs=64,
                      max_num_batched_tokens=256, max_seq_len=None) -> None:
    """Refuse an engine setting before any memory is taken or model loaded, naming the setting.

    Raises:
        ValueError: a size that is not a positive integer (num_blocks, max_seq_len: or None), a
            kv_cache_bytes that is not a positive number.
    """
    for name, value, optional in (("block_size", block_size, False), ("num_blocks", num_blocks, True),
                                  ("max_num_seqs", max_num_seqs, False),
                                  ("max_num_batched_tokens", max_num_batched_tokens, False),
                                  ("max_seq_len", max_seq_len, True)):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1{' (or None)' if optional else ''}, got {value!r}")
    if kv_cache_bytes is not None and (isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, numbers.Real)
                                       or not 0 < kv_cache_bytes < float("inf")):
        raise ValueError(f"kv_cache_bytes: must be a positive number of bytes (or None), got {kv_cache_bytes!r}")


class LLMEngine:
    """Requests in, ``RequestOutput``s out, one step at a time (vLLM's ``LLMEngine``).

    Args:
        model: a ``minillm.model.Decoder``; tokenizer: for text prompts, stop strings and ``text`` (or None).
        block_size, num_blocks, kv_cache_bytes: the pool (``PagedKVCache``); without either size,
            ``DEFAULT_KV_BYTES`` or what max_num_seqs full-context sequences take, whichever is less.
        enable_prefix_caching: reuse full blocks across requests (``num_cached_tokens``).
        max_num_seqs, max_num_batched_tokens: the scheduler's limits (forks and beams take seats too).
        eos_ids: ids that end a sequence (default: the tokenizer's EOS).
        max_seq_len: context to use (default and at most: the model's).
        attention: how the forward reads the pool (``attention.py``): "bucketed" (default) and "blockwise"
            (the paper's online softmax) pack one flat (1, N) row (``pack_flat``); "indexed" and "gather"
            (the references) pack (B, T) rows padded to the longest (``pack_rows``, ``row_width`` forces T).
        record_logits: keep each sequence's next-token logits (tests compare them with a recompute).
        speculative_config: vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 4} or
            {"method": "draft_model", "model": PATH_OR_DECODER, "num_speculative_tokens": "auto"} (``spec_decode``).

    Raises:
        ValueError: a size that is not a positive integer (``check_engine_args``); an unknown attention
            path, or a row_width with a flat path; a speculative_config field (``check_speculative_config``).
    """

    def __init__(self, model, tokenizer=None, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: float | None = None, enable_prefix_caching: bool = True, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 256, eos_ids=None, max_seq_len: int | None = None,
                 row_width: int | None = None, record_logits: bool = False, attention: str = "bucketed",
                 speculative_config: dict | None = None):
        # refused before the KV pool is allocated
        check_engine_args(block_size, num_blocks, kv_cache_bytes, max_num_seqs, max_num_batched_tokens, max_seq_len)
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention: {attention!r} is not one of {ATTENTION_PATHS}")
        if row_width is not None and attention in FLAT_PATHS:
            raise ValueError(f"row_width: attention={attention!r} packs one flat row without padding; row_width "
                             "applies to the padded rows of 'indexed' and 'gather'")
        spec = check_speculative_config(speculative_config, model,
                                        lambda path: load_model(path, dtype=model.dtype, device=model.device)[0])
        self.model, self.tokenizer = model, tokenizer
        self.max_seq_len = min(max_seq_len or model.config.max_seq_len, model.config.max_seq_len)
        if num_blocks is None and kv_cache_bytes is None:
            element = torch.empty((), dtype=model.dtype).element_size()
            kv_cache_bytes = min(DEFAULT_KV_BYTES, kv_bytes_of(model.config, max_num_seqs, self.max_seq_len, element))
        self.cache = PagedKVCache(model.config, num_blocks, block_size, kv_bytes=kv_cache_bytes, dtype=model.dtype,
                                  device=model.device, enable_prefix_caching=enable_prefix_caching,
                                  attention=attention)
        self.manager, self.block_size = self.cache.manager, block_size
        self.scheduler = Scheduler(self.manager, max_num_seqs, max_num_batched_tokens)
        self.eos_ids = stop_ids(tokenizer, eos_ids)
        self.row_width, self.record_logits = row_width, record_logits
        self.layout = "flat" if attention in FLAT_PATHS else "rows"
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.beams = EngineBeams(self.eos_ids, self.max_seq_len, tokenizer)
        self.logits: dict[tuple[str, int], list[torch.Tensor]] = {}  # record_logits: (request, index) -> (V,) per sample
        self._pending: list[RequestOutput] = []  # outputs of a step that raised: the next step returns them
        self._driver = threading.RLock()
        self._next_seq_id = self._arrivals = 0
        self.spec = SpecDecoder(spec, self) if spec is not None else None
        self.stats.spec_decoding = self.spec.stats if self.spec is not None else None

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @contextmanager
    def driving(self):
        """Hold the engine for the calling thread (re-entrant); every public call and ``LLM.generate``'s
        whole loop hold it.

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
        """Queue a request. ``prompt``: a string (needs the tokenizer), ``{"prompt_token_ids": [...]}``
        (optionally with "prompt"), or a list of token ids. ``params``: ``SamplingParams`` (default:
        greedy, 64 tokens) or ``BeamSearchParams``.

        Raises:
            ValueError: a request_id in use, a prompt that is empty or past the context, stop strings
                without a tokenizer, params of another type, beams with speculation, or a request that
                could never run (``Scheduler.check_fits``).
            RuntimeError: another thread is driving the engine (``driving``).
        """
        with self.driving():
            params = GREEDY if params is None else params
            if request_id in self.requests or any(out.request_id == request_id for out in self._pending):
                raise ValueError(f"request_id: {request_id!r} is already running (or its last output is not yet "
                                 "returned by step); give each request its own id")
            if not isinstance(params, (SamplingParams, BeamSearchParams)):
                raise ValueError(f"params: must be SamplingParams or BeamSearchParams, got {type(params).__name__}")
            text, ids = prompt_ids(prompt, self.tokenizer)
            beam = isinstance(params, BeamSearchParams)
            if beam and self.spec is not None:
                raise ValueError("params: beam search does not run with speculative decoding (nor does it in vLLM); "
                                 "use an engine built without speculative_config for beam search")
            stopper = None if beam else Stopper(params, self.tokenizer, self.eos_ids)
            self.scheduler.check_fits(request_id, len(ids), params, check_prompt(self.model, ids, self.max_seq_len))
            arrival = time.perf_counter() if arrival_time is None else arrival_time
            req = Request(request_id, text, ids, params, self._arrivals, RequestMetrics(arrival), stopper=stopper)
            seq = self._new_sequence(req, 0, list(ids))
            seq.seats = params.beam_width if beam else params.n  # what it forks into, reserved at admission
            req.seqs.append(seq)
            self._arrivals += 1
            self.requests[request_id] = req
            self.scheduler.add(seq)

    def abort_request(self, request_id) -> None:
        """Stop a request (or an iterable of them) now and return its blocks; unknown ids are ignored (as vLLM).

        Raises:
            RuntimeError: another thread is driving the engine (``driving``).
        """
        ids = list(request_id) if isinstance(request_id, Iterable) and not isinstance(request_id, str) else [request_id]
        with self.driving(), interrupts_deferred():
            for rid in ids:
                req = self.requests.get(rid) if _hashable(rid) else None
                if req is not None:
                    self._abort(req)
            gone = {rid for rid in ids if _hashable(rid)}
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
            whatever the forward or sampling raised, after undoing the step; RuntimeError: another
                thread is driving the engine, or nothing could be scheduled although requests wait (a bug).
        """
        with self.driving():
            outputs, self._pending = self._pending, []
            start = time.perf_counter()
            try:
                try:
                    plan = self._schedule()  # schedule: blocks reserved, copy-on-write done
                    if not plan.scheduled:
                        return outputs
                    rows, ready = self._pack(plan)  # pack: every scheduled token in one forward's rows
                    logits = self._forward(rows, ready)  # forward: the ready sequences' next-token logits
                    record = self.stats.record_step(plan, rows.shape, len(ready), self.manager,
                                                    self.scheduler.running, start)
                    draws = self._draw(ready, logits)  # sample
                except BaseException:
                    with interrupts_deferred():
                        self._rollback()
                    raise
                with interrupts_deferred():  # the forward wrote its tokens: from here the step stands
                    self._commit(plan, start, record, outputs)
                    self._append_all(ready, draws, outputs)  # append, stop
            except BaseException:
                self._pending[:0] = outputs  # not lost: the next step returns them
                raise
            record.end = time.perf_counter()
            return outputs

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
        """Every scheduled token in one flat row or (B, T) rows (``batching``), the cache told which
        sequence each row is; returns the rows and the sequences that catch up with their known tokens
        (they sample)."""
        spans = [(s.seq_id, s.num_computed_tokens, (s.token_ids[s.num_computed_tokens:] + s.spec_token_ids)[:n])
                 for s, n in plan.scheduled]  # drafts ride after the sequence's own tokens
        if self.layout == "flat":
            rows = pack_flat(spans, self.model.device)
        else:
            rows = pack_rows(spans, max(a + len(t) for _, a, t in spans), self.model.device, self.row_width)
        self.cache.set_rows(rows.seq_ids, rows.widths, reserved=True)
        return rows, [s for s, n in plan.scheduled if s.num_computed_tokens + n >= s.num_tokens]

    def _forward(self, rows, ready: list[Sequence]) -> torch.Tensor:
        """One forward over the packed rows; returns the ready sequences' next-token logits (R, V) (the
        output layer runs at those rows only)."""
        at = (self.spec.logits_indices(rows, ready) if self.spec is not None  # the pending token and each draft
              else rows.logits_indices([s.seq_id for s in ready]))
        begun = time.perf_counter()
        logits = self.model(rows.tokens, rows.input_pos, self.cache, logits_indices=at)
        if self.spec is not None:  # "auto" follows the machine's load
            self.spec.observe(rows.tokens.numel(), time.perf_counter() - begun)
        return logits

    def _draw(self, ready: list[Sequence], logits: torch.Tensor) -> list[list[tuple[int, float]] | None]:
        """What each ready sequence draws (``sampler.draw_tokens``): one token per sample it becomes (a
        request's first sample draws for all n), None for a beam (held for its siblings), a drafted
        sequence's verified tokens (``spec_decode.Run``). Changes nothing if it raises."""
        plans, last = [], self.spec.last_rows(logits) if self.spec is not None else logits
        try:
            for i, seq in enumerate(ready):
                req = self.requests[seq.request_id]
                if req.is_beam_search:
                    self.beams.hold(seq, last[i])
                    plans.append(None)
                    continue
                ks = range(req.params.n) if not req.forked else [seq.index]
                plans.append((req.params, [None if req.params.greedy else self._generator(req, k) for k in ks]))
            draws = self.spec.draw(logits, plans, ready) if self.spec is not None else draw_tokens(logits, plans)
        except BaseException:
            for seq in ready:
                self.beams.drop(seq.seq_id)
            raise
        if self.record_logits:
            for i, seq in enumerate(ready):
                self.logits.setdefault((seq.request_id, seq.index), []).append(last[i].float().cpu())
        return draws

    def _commit(self, plan, start: float, record, outputs: list[RequestOutput]) -> None:
        """The forward wrote every scheduled token: they count as computed, the blocks named for them stay
        in the prefix cache, the record is kept. If that fails halfway, the step's requests end ("abort")
        and their outputs join ``outputs``."""
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
            self.stats.add(record, admitted)
        except BaseException:
            for rid in dict.fromkeys(s.request_id for s, _ in plan.scheduled):
                req = self.requests.get(rid)
                if req is not None:
                    self._abort(req)
                    outputs.append(request_output(req, self._decode))
            raise

    def _rollback(self) -> None:
        """Undo the step that just failed: copy-on-write made again (a reservation that stays keeps its
        copy), drafts discarded, the scheduler's plan undone."""
        held = {b for s in self.scheduler.running if self.manager.holds(s.seq_id)
                for b in self.manager.block_table(s.seq_id)}
        self.cache.copy_blocks([(src, dst) for src, dst in self.manager.step_copies if dst in held])
        if self.spec is not None:
            self.spec.discard(self.scheduler.running)
        self.scheduler.rollback()

    def _append_all(self, ready: list[Sequence], draws, outputs: list[RequestOutput]) -> None:
        """Append each ready sequence's draws (forking a request's first sample into n), step the beams,
        finish what stopped; the touched requests' outputs join ``outputs``. A request whose append
        raises is aborted (its output says so), the others keep their tokens, and the first error is
        raised once all are done."""
        touched: dict[str, list] = {}
        for seq, drawn in zip(ready, draws):
            touched.setdefault(seq.request_id, []).append((seq, drawn))
        error = None
        for rid, items in touched.items():
            req = self.requests[rid]
            try:
                for seq, drawn in items:
                    if isinstance(drawn, Run):  # verified drafts: roll back the rejected, append the rest
                        self.spec.append(req, seq, drawn, self._append)
                    if drawn is None or isinstance(drawn, Run):
                        continue
                    targets = [seq] + [self._fork(req, seq, k) for k in range(1, len(drawn))]
                    req.forked = True
                    for target, (token, logprob) in zip(targets, drawn):
                        self._append(req, target, token, logprob)
                if req.is_beam_search:
                    self.beams.step(req, self._fork, self._finish_seq)
                outputs.append(request_output(req, self._decode))
            except BaseException as e:  # noqa: B036  (its state may be half-appended: it ends, and says so)
                error = error or e
                self._abort(req)
                outputs.append(request_output(req, self._decode))
                continue
            if req.is_finished:
                self.requests.pop(rid, None)
        if error is not None:
            raise error

    # ---- sequences -----------------------------------------------------------------------------
    def _new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, req.request_id, index, (req.arrival_order, index), token_ids,
                       len(req.prompt_token_ids))
        self._next_seq_id += 1
        return seq

    def _fork(self, req: Request, parent: Sequence, index: int) -> Sequence:
        """A child sharing every block of ``parent`` (Kwon et al., Sec. 4.4), running from its state; it
        takes one of the parent's seats."""
        child = self._new_sequence(req, index, list(parent.token_ids))
        child.num_computed_tokens, child.cumulative_logprob = parent.num_computed_tokens, parent.cumulative_logprob
        req.seqs.append(child)  # first: an abort from here on finds it (and frees what it holds)
        self.manager.fork(parent.seq_id, child.seq_id, child.token_ids)  # the child's list is its ledger
        parent.seats -= 1
        self.scheduler.add_running(child)
        return child

    def _append(self, req: Request, seq: Sequence, token: int, logprob: float) -> None:
        """A sampled token joins the known tokens; then EOS, stop strings, stop token ids, max_tokens
        and the context."""
        now = time.perf_counter()
        seq.token_ids.append(token)  # the block manager reads this list: one ledger of known tokens
        seq.cumulative_logprob += logprob
        req.metrics.first_token_time = req.metrics.first_token_time or now
        req.metrics.last_token_time = now
        result = GenerationResult(req.prompt_token_ids, tokens=seq.output_token_ids)
        if req.stopper.check(result):
            seq.stop_reason = req.stopper.stop_reason  # the stop string or stop token id (vLLM's), None for EOS
            seq.text = result.text if result.finish_reason == "stop" else self._decode(seq.output_token_ids[:-1])
            self._finish_seq(seq, "stop")
        elif seq.num_output_tokens >= req.params.max_new_tokens or seq.num_tokens >= self.max_seq_len:
            seq.text = self._decode(seq.output_token_ids)
            self._finish_seq(seq, "length")

    def _finish_seq(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.beams.drop(seq.seq_id)
        if self.spec is not None:
            self.spec.forget(seq)
        req = self.requests.get(seq.request_id)
        if req is not None:
            req.generators.pop(seq.index, None)
            if req.is_finished:
                req.metrics.finished_time = time.perf_counter()

    def _abort(self, req: Request) -> None:
        """End every sequence of the request ("abort"), free its blocks, forget it."""
        req.aborted = True
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish_seq(seq, "abort")
        req.metrics.finished_time = req.metrics.finished_time or time.perf_counter()
        self.requests.pop(req.request_id, None)  # its stopper and generators leave with it

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _generator(self, req: Request, k: int) -> torch.Generator:
        """Sample k's generator (``sampler.sample_generator``), made at its first draw."""
        if k not in req.generators:
            req.generators[k] = sample_generator(req.params, k, self.model.device)
        return req.generators[k]


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True
