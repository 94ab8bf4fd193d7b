"""``LLMEngine``: continuous batching over one pool of KV blocks, in vLLM's API.

Yu et al. 2022 (Orca, Sec. 4: iteration-level scheduling) and Kwon et al. 2023 (vLLM, arXiv
2309.06180, Sec. 4.3-4.5: many sequences decode together over one block pool; parallel samples and
beams share blocks; preemption by recompute). One ``step()``: schedule (``Scheduler``), run one forward
over every scheduled token (``batching.pack_flat``: decode tokens and prefill chunks side by side in
one (1, N) row, as vLLM V1 batches them; or ``batching.pack_rows``' (B, T) rows; one ``Decoder.forward``
on the ``PagedKVCache``), sample each sequence whose computed tokens
caught up with its known tokens (one generator per sequence: sample 0 seeded with the request's seed,
so a seeded request draws the same tokens alone as in any batch), append, stop.

Room for speculative decoding: a sequence may be given several known-but-uncomputed tokens (a draft);
the forward computes them in one span, and rejected ones are rolled back by writing again from the
first rejected position (``PagedKVCache.prepare`` truncates there, ``BlockManager.truncate``).
Today the engine samples at the last position of each span only.

``n > 1``: the prompt runs once; at its first sample the sequence forks into n (blocks shared,
copy-on-write of the partly filled last block). Beam search: ``beam.select_beams`` each time every live
beam has its logits; a beam kept twice is forked, a beam kept by no candidate is freed.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..generation import GenerationResult, Stopper, check_prompt, stop_ids
from ..kv_cache import kv_cache_bytes as kv_bytes_of
from ..sampling import SamplingParams, check_logits, make_generator, sample
from .batching import pack_flat, pack_rows
from .beam import BeamSearchParams, finalize, search_done, select_beams
from .block_manager import blocks_for
from .cache import PagedKVCache
from .scheduler import Scheduler
from .sequence import (CompletionOutput, Request, RequestMetrics, RequestOutput, Sequence)

DEFAULT_KV_BYTES = 512 * 2 ** 20  # the pool when neither num_blocks nor kv_cache_bytes is given (at most)
GREEDY = SamplingParams()


@dataclass
class StepRecord:
    """One step, for the timeline: ``runs`` (request_id, index, tokens, "prefill"/"decode"/"recompute"), ``preempted``
    (request_id, index), the forward's (B, T), blocks in use and KV slots holding tokens after it,
    blocks the running sequences would hold without sharing, its start / end (perf_counter s), and
    ``sampled``: the sequences that sampled (the rows of the output layer)."""

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
    records: list[StepRecord] = field(default_factory=list)

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


def _kind(seq: Sequence, n: int) -> str:
    """What a step does for a sequence: "recompute" (tokens computed before a preemption), "prefill"
    (prompt tokens) or "decode" (its newest token)."""
    if seq.num_output_tokens > 1 and seq.num_computed_tokens < seq.num_tokens - 1:
        return "recompute"
    return "prefill" if seq.is_prefill else "decode"


class LLMEngine:
    """Requests in, ``RequestOutput``s out, one step at a time (vLLM's ``LLMEngine``).

    Args:
        model: a ``minillm.model.Decoder``; tokenizer: for text prompts, stop strings and ``text`` (or None).
        block_size, num_blocks, kv_cache_bytes: the pool (``PagedKVCache``); without either size,
            ``DEFAULT_KV_BYTES`` or what max_num_seqs full-context sequences take, whichever is less.
        enable_prefix_caching: reuse full blocks across requests (``num_cached_tokens``).
        max_num_seqs, max_num_batched_tokens: the scheduler's limits.
        eos_ids: ids that end a sequence (default: the tokenizer's EOS).
        max_seq_len: context to use (default: the model's).
        layout: "flat" (default with the "bucketed" path: every scheduled token in one (1, N) row,
            ``batching.pack_flat``) or "rows" (``batching.pack_rows``: (B, T) rows, the only layout of the
            "indexed" and "gather" paths).
        row_width: force the rows' T (the "rows" layout; default: ``batching.choose_row_width``).
        record_logits: keep each sequence's next-token logits (tests compare them with a recompute).
        attention: the cache's path (``PagedKVCache``): "bucketed" (default: rows grouped by length, the
            cache attends), or "indexed" / "gather" (every row padded to the longest; the references).

    Raises:
        ValueError: from the pool and scheduler (sizes below 1); an unknown layout, or "flat" with
            another attention path than "bucketed" or with a row_width.
    """

    def __init__(self, model, tokenizer=None, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: float | None = None, enable_prefix_caching: bool = True, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 256, eos_ids=None, max_seq_len: int | None = None,
                 row_width: int | None = None, record_logits: bool = False, attention: str = "bucketed",
                 layout: str | None = None):
        # refused before the KV pool is allocated
        if layout is None:
            layout = "flat" if attention == "bucketed" and row_width is None else "rows"
        if layout not in ("flat", "rows") or (layout == "flat" and (attention != "bucketed" or row_width)):
            raise ValueError(f"layout: {layout!r} must be 'rows' or 'flat', and 'flat' needs attention='bucketed' "
                             f"and no row_width (got attention={attention!r}, row_width={row_width})")
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
        self.layout = layout
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.logits: dict[tuple[str, int], list[torch.Tensor]] = {}  # record_logits: (request, index) -> (V,) per sample
        self._generators: dict[tuple[str, int], torch.Generator] = {}  # (request, sample index)
        self._stoppers: dict[str, Stopper] = {}
        self.beam_outputs: dict[str, object] = {}  # request_id -> BeamSearchOutput of a finished beam search
        self._beam_logprobs: dict[int, torch.Tensor] = {}  # seq_id -> (V,) of a beam waiting for its siblings
        self._next_seq_id = self._arrivals = 0

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | BeamSearchParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. ``prompt``: a string (needs the tokenizer), ``{"prompt_token_ids": [...]}``
        (optionally with "prompt"), or a list of token ids. ``params``: ``SamplingParams`` (default:
        greedy, 64 tokens) or ``BeamSearchParams``.

        Raises:
            ValueError: a request_id in use, a prompt that is empty or does not fit the context, stop
                strings without a tokenizer, params of another type, or a request that could never fit
                the pool (prompt + max_tokens blocks, for each beam, above num_blocks; both sizes named).
        """
        params = GREEDY if params is None else params
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running; give each request its own id")
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"params: must be SamplingParams or BeamSearchParams, got {type(params).__name__}")
        text, ids = self._prompt_ids(prompt)
        ctx = check_prompt(self.model, ids, self.max_seq_len)
        beam = isinstance(params, BeamSearchParams)
        if not beam:
            self._stoppers[request_id] = Stopper(params, self.tokenizer, self.eos_ids)
        copies = params.beam_width if beam else 1
        per_seq = blocks_for(min(ctx, len(ids) + params.max_new_tokens), self.block_size)
        need = copies * per_seq
        if need > self.num_blocks:
            each = f" ({per_seq} for each of {copies} beams)" if beam else ""
            raise ValueError(f"request {request_id!r}: its prompt ({len(ids)} tokens) and max_tokens "
                             f"({params.max_new_tokens}) need {need} blocks of {self.block_size} tokens{each}, but "
                             f"the pool has {self.num_blocks} blocks; lower max_tokens or give more blocks")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        req = Request(request_id, text, ids, params, self._arrivals, RequestMetrics(arrival))
        self._arrivals += 1
        for k in range(1 if beam else params.n):
            self._generators[(request_id, k)] = self._generator(params, k)
        req.seqs.append(self._new_sequence(req, 0, list(ids)))
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])

    def abort_request(self, request_id) -> None:
        """Stop a request (or an iterable of them) now and return its blocks; unknown ids are ignored (as vLLM)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            req.aborted = True
            for seq in req.seqs:
                if not seq.is_finished:
                    self._finish_seq(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def block_table(self, request_id: str, index: int = 0) -> list[int]:
        """The physical blocks of a running sequence (``BlockManager.block_table``)."""
        seq = next(s for s in self.requests[request_id].seqs if s.index == index)
        return self.manager.block_table(seq.seq_id)

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, append, stop; returns a ``RequestOutput`` (cumulative, as
        vLLM's default) for every request that got a token or finished in this step.

        Raises:
            RuntimeError: nothing could be scheduled although requests wait (a bug: the add-time
                check guarantees that the oldest request fits the pool alone).
        """
        start = time.perf_counter()
        out = self.scheduler.schedule()
        preempted = list(out.preempted)
        while not out.scheduled and self.scheduler.has_unfinished():
            victim = self.scheduler.preempt_idle()
            if victim is None:
                raise RuntimeError(f"scheduler: nothing can run ({len(self.scheduler.waiting)} waiting, "
                                   f"{len(self.scheduler.running)} running, {self.manager.num_free_blocks} free "
                                   "blocks); this is a bug, please report it")
            preempted.append(victim)
            out = self.scheduler.schedule()
            preempted += out.preempted
        for seq in preempted:
            self._beam_logprobs.pop(seq.seq_id, None)
        self.stats.preemptions += len(preempted)
        if not out.scheduled:
            return []
        kinds = [(s.request_id, s.index, n, _kind(s, n)) for s, n in out.scheduled]
        spans = [(s.seq_id, s.num_computed_tokens, s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n])
                 for s, n in out.scheduled]
        if self.layout == "flat":
            rows = pack_flat(spans, self.model.device)
        else:
            rows = pack_rows(spans, max(a + len(t) for _, a, t in spans), self.model.device, self.row_width)
        self.cache.set_rows(rows.seq_ids, rows.widths)
        computed = {s.seq_id: s.num_computed_tokens + n for s, n in out.scheduled}
        ready = [s for s, _ in out.scheduled if computed[s.seq_id] == s.num_tokens]  # caught up: they sample
        # logits only at the ready sequences' last tokens: (R, V), one output projection per sampled token
        logits = self.model(rows.tokens, rows.input_pos, self.cache,
                            logits_indices=rows.logits_indices([s.seq_id for s in ready]))
        for seq, n in out.scheduled:
            req = self.requests[seq.request_id]
            if req.num_cached_tokens is None:  # its first admission: what the prefix cache served
                req.num_cached_tokens, req.metrics.first_scheduled_time = seq.num_computed_tokens, start
                self.stats.prompt_tokens += len(req.prompt_token_ids)
                self.stats.cached_tokens += req.num_cached_tokens
            seq.num_computed_tokens += n
        self._record_memory(len(self.stats.records), kinds, preempted, rows.shape, start)
        self.stats.records[-1].sampled = len(ready)
        touched = self._sample(ready, logits) if ready else []
        self.stats.records[-1].end = time.perf_counter()
        self.stats.steps += 1
        outputs = [self._output(req) for req in touched]
        for req in touched:
            if req.is_finished:
                self.requests.pop(req.request_id, None)
                self._stoppers.pop(req.request_id, None)
        return outputs

    def _sample(self, ready: list[Sequence], last: torch.Tensor) -> list[Request]:
        """Next tokens for the sequences that caught up, from their logits ``last`` (R, V); returns the
        requests touched (in first-seen order)."""
        # one logsumexp gives every chosen token's logprob (logit - lse) and check_logits' verdict: it is
        # finite exactly when a row has no NaN, no +inf and not only -inf (the error is check_logits')
        lse = torch.logsumexp(last, dim=-1)  # (R,)
        if not torch.isfinite(lse).all():
            check_logits(last)
        touched: dict[str, Request] = {}
        greedy = [i for i, s in enumerate(ready)
                  if not self.requests[s.request_id].is_beam_search and self.requests[s.request_id].params.greedy]
        picked = last if len(greedy) == len(ready) else last[greedy]  # every row greedy: no (R, V) copy
        greedy_tokens = dict(zip(greedy, picked.argmax(-1).tolist())) if greedy else {}
        lse = lse.tolist()
        for i, seq in enumerate(ready):
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
            if self.record_logits:
                self.logits.setdefault((req.request_id, seq.index), []).append(last[i].float().cpu())
            if req.is_beam_search:
                self._beam_logprobs[seq.seq_id] = torch.log_softmax(last[i], dim=-1)  # (V,), as the naive beam search
                continue
            ks = range(req.params.n) if not req.forked else [seq.index]  # the first sample draws for every fork
            draws = [greedy_tokens[i] if i in greedy_tokens else
                     int(sample(last[i:i + 1], req.params, self._generators[(req.request_id, k)])) for k in ks]
            n = len(draws)
            targets = [seq] + [self._fork(req, seq, k) for k in range(1, n)]
            req.forked = True
            for target, token in zip(targets, draws):
                self._append(req, target, token, float(last[i, token]) - lse[i])
        for req in touched.values():
            if req.is_beam_search:
                self._beam_step(req)
        return list(touched.values())

    # ---- sequences -----------------------------------------------------------------------------
    def _new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, req.request_id, index, (req.arrival_order, index), token_ids,
                       len(req.prompt_token_ids))
        self._next_seq_id += 1
        return seq

    def _fork(self, req: Request, parent: Sequence, index: int) -> Sequence:
        """A child sharing every block of ``parent`` (Kwon et al., Sec. 4.4), running from its state."""
        child = self._new_sequence(req, index, list(parent.token_ids))
        child.num_computed_tokens, child.cumulative_logprob = parent.num_computed_tokens, parent.cumulative_logprob
        self.manager.fork(parent.seq_id, child.seq_id)
        self.scheduler.add_running(child)
        req.seqs.append(child)
        return child

    def _append(self, req: Request, seq: Sequence, token: int, logprob: float) -> None:
        """A sampled token joins the known tokens; then EOS, stop strings, max_tokens and the context."""
        now = time.perf_counter()
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        self.manager.add_token_ids(seq.seq_id, [token])
        req.metrics.first_token_time = req.metrics.first_token_time or now
        req.metrics.last_token_time = now
        result = GenerationResult(req.prompt_token_ids, tokens=seq.output_token_ids)
        if self._stoppers[req.request_id].check(result):
            text = self.tokenizer.decode(seq.output_token_ids) if self.tokenizer is not None else ""
            seq.stop_reason = (next(s for s in req.params.stop if text[len(result.text):].startswith(s))
                               if result.finish_reason == "stop" else None)
            seq.text = result.text if result.finish_reason == "stop" else self._decode(seq.output_token_ids[:-1])
            self._finish_seq(seq, "stop")
        elif seq.num_output_tokens >= req.params.max_new_tokens or seq.num_tokens >= self.max_seq_len:
            seq.text = self._decode(seq.output_token_ids)
            self._finish_seq(seq, "length")

    def _finish_seq(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self._beam_logprobs.pop(seq.seq_id, None)
        self._generators.pop((seq.request_id, seq.index), None)
        req = self.requests.get(seq.request_id)
        if req is not None and req.is_finished:
            req.metrics.finished_time = time.perf_counter()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _generator(self, params, k: int) -> torch.Generator | None:
        """Sample k's generator: seeded with ``params.seed`` for k = 0 (as ``generate_cached``), with a
        seed derived from (seed, k) for the others; None for greedy and beam search."""
        if isinstance(params, BeamSearchParams) or params.greedy:
            return None
        if params.seed is None or k == 0:
            return make_generator(params, self.model.device)
        return make_generator(SamplingParams(seed=hash((params.seed, k)) % 2 ** 63), self.model.device)

    def _beam_step(self, req: Request) -> None:
        """Once every live beam has its logits: select (``beam.select_beams``), fork beams kept more than
        once (before any token is appended, so a fork copies its parent's state), free dropped beams."""
        beams = [s for s in req.seqs if not s.is_finished]
        if not all(s.seq_id in self._beam_logprobs for s in beams):
            return
        p = req.params
        lp = torch.stack([self._beam_logprobs.pop(s.seq_id) for s in beams])  # (K, V)
        live, closed = select_beams([s.cumulative_logprob for s in beams], lp, p.beam_width, self.eos_ids,
                                    p.ignore_eos)
        req.completed += [(beams[i].output_token_ids + [t], c) for i, t, c in closed]
        n_out = beams[0].num_output_tokens + 1
        stop = search_done(req.completed, live[0][2] if live else None, n_out, p)
        if stop or n_out >= p.max_tokens or beams[0].num_tokens + 1 >= self.max_seq_len:
            if not stop:
                req.completed += [(beams[i].output_token_ids + [t], c) for i, t, c in live]
            req.beam_output = self.beam_outputs[req.request_id] = finalize(req.prompt_token_ids, req.completed, p,
                                                                           self.tokenizer)
            for s in beams:
                self._finish_seq(s, "length")
            now = time.perf_counter()
            req.metrics.first_token_time = req.metrics.first_token_time or now
            return
        kept = Counter()
        targets = []
        for i, token, c in live:
            targets.append((beams[i] if not kept[i] else self._fork(req, beams[i], len(req.seqs)), token, c))
            kept[i] += 1
        for i, s in enumerate(beams):
            if not kept[i]:
                self._finish_seq(s, "stop")
        req.seqs = [t for t, _, _ in targets] + [s for s in req.seqs if s.is_finished]
        for seq, token, c in targets:
            seq.token_ids.append(token)
            seq.cumulative_logprob = c
            self.manager.add_token_ids(seq.seq_id, [token])
        req.metrics.first_token_time = req.metrics.first_token_time or time.perf_counter()

    # ---- outputs and accounting ----------------------------------------------------------------
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a text prompt needs a tokenizer; pass {'prompt_token_ids': [...]} instead")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"prompt: a dict prompt needs 'prompt_token_ids', got keys {sorted(prompt)}")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt: must be a string, {{'prompt_token_ids': [...]}} or a list of ids, "
                         f"got {type(prompt).__name__}")

    def _output(self, req: Request) -> RequestOutput:
        """The request's ``RequestOutput``: its samples by index, or its live beams (best first), or, once
        a beam search ends, its best hypotheses."""
        if req.beam_output is not None:
            outs = [CompletionOutput(i, h.text, h.tokens[len(req.prompt_token_ids):], h.cum_logprob, "length")
                    for i, h in enumerate(req.beam_output.sequences)]
        else:
            seqs = [s for s in req.seqs if not s.is_finished] if req.is_beam_search else sorted(req.seqs, key=lambda s: s.index)
            outs = [CompletionOutput(i if req.is_beam_search else s.index,
                                     s.text if s.is_finished else self._decode(s.output_token_ids),
                                     s.output_token_ids, s.cumulative_logprob, s.finish_reason, s.stop_reason)
                    for i, s in enumerate(seqs)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.is_finished,
                             req.num_cached_tokens or 0, req.metrics)

    def _record_memory(self, step, kinds, preempted, shape, start) -> None:
        """After the forward: blocks in use, slots of them holding tokens (shared blocks once), blocks
        the running sequences would hold unshared."""
        filled: dict[int, int] = {}
        unshared = 0
        for seq in self.scheduler.running:
            n = self.manager.num_tokens(seq.seq_id)
            table = self.manager.block_table(seq.seq_id)
            unshared += len(table)
            for j, block in enumerate(table):
                filled[block] = max(filled.get(block, 0), min(self.block_size, n - j * self.block_size))
        self.stats.records.append(StepRecord(step, kinds, [(s.request_id, s.index) for s in preempted], shape,
                                             self.manager.num_used_blocks, sum(filled.values()), unshared,
                                             start, start))
