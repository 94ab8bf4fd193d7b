"""A request's life in the engine, from ``add_request`` to its last ``RequestOutput``: checked and queued as
one sequence; each step it draws (a seeded generator per sample; a beam waits for its siblings), its first
sample forks into n, beams fork and finish, drawn tokens are appended, and it finishes or is aborted.

Kwon et al. 2023 (vLLM, arXiv 2309.06180), Sec. 4.4-4.5: a request is a group of sequences sharing blocks,
as vLLM's ``SequenceGroup`` and its output processor. Bookkeeping on the ``Scheduler`` and plain data only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from ..stops import GenerationResult, Stopper, check_prompt
from ..sampling_params import SamplingParams
from .beam import BeamSearchParams, EngineBeams
from .sampler import Draw, draw_tokens, sample_generator
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sequence import Request, Sequence


class RequestTracker:
    """The engine's requests (``requests``: request_id -> ``Request``) and what happens to their sequences.

    Args:
        model: the engine's ``Decoder``; tokenizer: for text prompts, stop strings and ``text`` (or None).
        scheduler: the engine's ``Scheduler``; eos_ids, max_seq_len: the engine's; spec: its ``SpecDecoder``.
        record_logits: keep each sequence's next-token logits in ``logits``: (request_id, index) -> [(V,)].
    """

    def __init__(self, model, tokenizer, scheduler, eos_ids, max_seq_len: int, spec=None,
                 record_logits: bool = False):
        self.model, self.tokenizer, self.scheduler, self.manager = model, tokenizer, scheduler, scheduler.manager
        self.eos_ids, self.max_seq_len, self.spec, self.record_logits = eos_ids, max_seq_len, spec, record_logits
        self.requests: dict[str, Request] = {}
        self.beams = EngineBeams(eos_ids, max_seq_len, tokenizer)
        self.logits: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._next_seq_id = self._arrivals = 0

    def add(self, request_id: str, prompt, params: SamplingParams | BeamSearchParams | None,
            arrival_time: float | None) -> None:
        """Check a request and queue its first sequence (``LLMEngine.add_request`` checks its id).

        Raises:
            ValueError: params of another type, a prompt that is empty or past the context, stop strings without a
                tokenizer, beams with speculation, a request that could never run (``Scheduler.check_fits``).
        """
        params = SamplingParams() if params is None else params  # greedy, 64 tokens
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

    # ---- a step's draws and appends ---------------------------------------------------------------
    def draw(self, ready: list[Sequence], logits: torch.Tensor) -> list[Draw]:
        """What each ready sequence draws (``sampler.Draw``): one token per sample it becomes (a request's
        first sample draws for all n), nothing for a beam (held for its siblings), a drafted sequence's
        verified run. Changes nothing if it raises."""
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
                self._drop_beam(seq)
            raise
        if self.record_logits:  # the rows of every token drawn (a run cut by a stop keeps its dropped tokens' rows)
            for i, seq in enumerate(ready):
                rows = self.spec.emitted_rows(logits, i, draws[i]) if self.spec is not None else last[i:i + 1]
                self.logits.setdefault((seq.request_id, seq.index), []).extend(rows.float().cpu())
        return draws

    def append(self, ready: list[Sequence], draws, outputs: list[RequestOutput], append) -> None:
        """Append each ready sequence's draws with ``append(req, seq, token, logprob)`` (the engine's:
        one token, then its stops), forking a request's first sample into n; step the beams; the touched
        requests' outputs join ``outputs``. A request whose append raises is aborted (its output says
        so), the others keep their tokens, and the first error is raised once all are done."""
        touched: dict[str, list] = {}
        for seq, drawn in zip(ready, draws):
            touched.setdefault(seq.request_id, []).append((seq, drawn))
        error = None
        for rid, items in touched.items():
            req = self.requests[rid]
            try:
                for seq, drawn in items:
                    if drawn.drafted:  # a verified run: roll back the rejected drafts, append the rest
                        self.spec.append(req, seq, drawn, append)
                    elif drawn.samples:  # a token per sample: a request's first sample forks into n
                        targets = [seq] + [self.fork(req, seq, k) for k in range(1, len(drawn.samples))]
                        req.forked = True
                        for target, [(token, logprob)] in zip(targets, drawn.samples):
                            append(req, target, token, logprob)
                if req.is_beam_search:
                    self.beams.step(req, self.fork, self.finish)
                outputs.append(self.output(req))
            except BaseException as e:  # noqa: B036  (its state may be half-appended: it ends, and says so)
                error = error or e
                self.abort(req)
                outputs.append(self.output(req))
            if req.is_finished:
                self.requests.pop(rid, None)
        if error is not None:
            raise error

    def check_stop(self, req: Request, seq: Sequence) -> None:
        """After a token joined ``seq``: finish it at EOS, a stop string or stop token id (``Stopper``),
        max_tokens or the end of the context, its text cut before a stop string."""
        result = GenerationResult(req.prompt_token_ids, tokens=seq.output_token_ids)
        if req.stopper.check(result):
            seq.stop_reason = req.stopper.stop_reason  # the stop string or stop token id (vLLM's), None for EOS
            seq.text = result.text if result.finish_reason == "stop" else self.decode(seq.output_token_ids[:-1])
            self.finish(seq, "stop")
        elif seq.num_output_tokens >= req.params.max_new_tokens or seq.num_tokens >= self.max_seq_len:
            seq.text = self.decode(seq.output_token_ids)
            self.finish(seq, "length")

    # ---- sequences -----------------------------------------------------------------------------
    def _new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, req.request_id, index, (req.arrival_order, index), token_ids,
                       len(req.prompt_token_ids))
        self._next_seq_id += 1
        return seq

    def fork(self, req: Request, parent: Sequence, index: int) -> Sequence:
        """A child sharing every block of ``parent`` (Sec. 4.4), running from its state, in one of its seats."""
        child = self._new_sequence(req, index, list(parent.token_ids))
        child.num_computed_tokens, child.cumulative_logprob = parent.num_computed_tokens, parent.cumulative_logprob
        req.seqs.append(child)  # first: an abort from here on finds it (and frees what it holds)
        self.manager.fork(parent.seq_id, child.seq_id, child.token_ids)  # the child's list is its ledger
        parent.seats -= 1
        self.scheduler.add_running(child)
        return child

    def _drop_beam(self, seq: Sequence) -> None:
        req = self.requests.get(seq.request_id)
        if req is None or req.is_beam_search:  # only beams hold log-probabilities in ``self.beams``
            self.beams.drop(seq.seq_id)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence ("stop", "length" or "abort"): its blocks go back, its beam and draft state go."""
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self._drop_beam(seq)
        if self.spec is not None:
            self.spec.forget(seq)
        req = self.requests.get(seq.request_id)
        if req is not None:
            req.generators.pop(seq.index, None)
            if req.is_finished:
                req.metrics.finished_time = time.perf_counter()

    def abort(self, req: Request) -> None:
        """End every sequence of the request ("abort"), free its blocks, forget it."""
        req.aborted = True
        for seq in req.seqs:
            if not seq.is_finished:
                self.finish(seq, "abort")
        req.metrics.finished_time = req.metrics.finished_time or time.perf_counter()
        self.requests.pop(req.request_id, None)  # its stopper and generators leave with it

    def abort_ids(self, request_id) -> set:
        """Abort a request id, or each id of an iterable (unknown ones ignored, as vLLM); returns the ids given."""
        ids = list(request_id) if isinstance(request_id, Iterable) and not isinstance(request_id, str) else [request_id]
        ids = [rid for rid in ids if _hashable(rid)]
        for rid in ids:
            if rid in self.requests:
                self.abort(self.requests[rid])
        return set(ids)

    def output(self, req: Request) -> RequestOutput:
        """The request's cumulative ``RequestOutput``: its samples by index, or its live beams (best first), or,
        once a beam search ends, its best hypotheses (also as ``beam_search_output``)."""
        if req.beam_output is not None:
            outs = [CompletionOutput(i, h.text, h.tokens[len(req.prompt_token_ids):], h.cum_logprob, "length")
                    for i, h in enumerate(req.beam_output.sequences)]
        else:
            seqs = ([s for s in req.seqs if not s.is_finished or req.aborted] if req.is_beam_search
                    else sorted(req.seqs, key=lambda s: s.index))
            outs = [CompletionOutput(i if req.is_beam_search else s.index,
                                     s.text if s.is_finished and s.finish_reason != "abort"
                                     else self.decode(s.output_token_ids),
                                     s.output_token_ids, s.cumulative_logprob, s.finish_reason, s.stop_reason)
                    for i, s in enumerate(seqs)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.is_finished,
                             req.num_cached_tokens or 0, req.metrics, req.beam_output)

    def decode(self, ids: list[int]) -> str:
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


def prompt_ids(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: a string (needs the tokenizer), ``{"prompt_token_ids": [...]}``
    (optionally with "prompt") or a list of ids.

    Raises:
        ValueError: a text prompt without a tokenizer, a dict without prompt_token_ids, another type.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: a text prompt needs a tokenizer; pass {'prompt_token_ids': [...]} instead")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise ValueError(f"prompt: a dict prompt needs 'prompt_token_ids', got keys {sorted(prompt)}")
        return prompt.get("prompt"), list(prompt["prompt_token_ids"])
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"prompt: must be a string, {{'prompt_token_ids': [...]}} or a list of ids, "
                     f"got {type(prompt).__name__}")
