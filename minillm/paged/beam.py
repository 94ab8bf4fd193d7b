"""Beam search: the selection rule shared by the engine and by a naive baseline that recomputes every beam.

Kwon et al. 2023 (vLLM, arXiv 2309.06180), Sec. 4.4: a request's beams share blocks; a beam kept by several
candidates is forked, one that no candidate keeps is freed. ``beam_search_naive`` shares nothing and must
give the same beams.

The rule (``select_beams``, as transformers' ``generate(num_beams=k)``): candidates are every live beam's
2k most likely next tokens, scored by the beam's cumulative log-probability plus the token's; walking them
from the best, an EOS ranked among the first k closes a hypothesis, any other becomes a live beam until
there are k. The search ends at ``max_tokens``, with no live beam, or (early_stopping=False) when k
hypotheses are closed and the best live beam cannot beat the worst. Hypotheses are ranked by
``cumulative_logprob / len(output tokens) ** length_penalty`` (EOS counted).
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field

import torch

from ..stops import check_prompt
from .config import check_count


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams (>= 1), ``max_tokens`` new tokens at most (>= 1),
    ``ignore_eos`` (EOS then closes nothing), ``length_penalty`` (0 ranks by log-probability alone).

    Raises:
        ValueError: naming the field.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            check_count(name, getattr(self, name))
        if self.temperature != 0.0:
            raise ValueError(f"temperature: beam search here is deterministic (0), got {self.temperature}")
        if not isinstance(self.length_penalty, numbers.Real) or self.length_penalty != self.length_penalty:
            raise ValueError(f"length_penalty: must be a number, got {self.length_penalty!r}")

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens


@dataclass
class BeamSearchSequence:
    """One hypothesis: ``tokens`` (prompt then output, as vLLM), ``cum_logprob``, ``text`` (the output)."""

    tokens: list[int]
    cum_logprob: float
    text: str = ""
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """vLLM's ``BeamSearchOutput``: the best ``beam_width`` hypotheses, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def score(cum_logprob: float, num_output_tokens: int, length_penalty: float) -> float:
    """The ranking of a hypothesis: cum_logprob / num_output_tokens ** length_penalty."""
    return cum_logprob / max(1, num_output_tokens) ** length_penalty


def select_beams(cum_logprobs: list[float], logprobs: torch.Tensor, beam_width: int, eos_ids=(),
                 ignore_eos: bool = False):
    """One step of the rule in the module docstring.

    Args:
        cum_logprobs: (K,) the live beams' cumulative log-probabilities.
        logprobs: (K, V) float32 log-softmax of each beam's next-token logits.

    Returns:
        (live, closed): lists of (parent beam index, token id, new cumulative log-probability); live has
        at most beam_width entries, best first; closed are EOS candidates ranked among the first beam_width.
    """
    K, V = logprobs.shape
    top = torch.topk(logprobs.float(), min(2 * beam_width, V), dim=-1)  # (K, 2k) each
    scores = top.values + torch.tensor(cum_logprobs, dtype=torch.float32, device=logprobs.device)[:, None]
    order = torch.argsort(scores.reshape(-1), descending=True, stable=True)
    # one copy to the host (float64 holds every token id and float32 score exactly)
    n = order.numel()
    host = torch.cat([order.double(), top.indices.reshape(-1).double(), scores.reshape(-1).double()]).tolist()
    order, indices, flat_scores = host[:n], host[n:2 * n], host[2 * n:]
    live, closed = [], []
    for rank, flat in enumerate(order):
        flat = int(flat)
        parent = flat // top.indices.shape[1]
        token, total = int(indices[flat]), flat_scores[flat]
        if token in eos_ids and not ignore_eos:
            if rank < beam_width:
                closed.append((parent, token, total))
            continue
        live.append((parent, token, total))
        if len(live) == beam_width:
            break
    return live, closed


def search_done(closed: list[tuple[list[int], float]], best_live: float | None, num_output_tokens: int,
                params: BeamSearchParams) -> bool:
    """Whether the search ends: no live beam, or beam_width hypotheses closed and the best live beam's
    score (at its current length) no better than the worst closed one's."""
    if best_live is None:
        return True
    if len(closed) < params.beam_width:
        return False
    worst = sorted(score(c, len(t), params.length_penalty) for t, c in closed)[-params.beam_width]
    return worst >= score(best_live, num_output_tokens, params.length_penalty)


def finalize(prompt: list[int], closed: list[tuple[list[int], float]], params: BeamSearchParams,
             tokenizer=None) -> BeamSearchOutput:
    """The best beam_width hypotheses (output token ids, cum_logprob) as a ``BeamSearchOutput``; ties in
    score keep the order given (closed first, then live beams by rank)."""
    ranked = sorted(closed, key=lambda h: -score(h[1], len(h[0]), params.length_penalty))[:params.beam_width]
    return BeamSearchOutput([
        BeamSearchSequence(list(prompt) + list(t), c, tokenizer.decode(t) if tokenizer is not None else "",
                           score(c, len(t), params.length_penalty)) for t, c in ranked])


class EngineBeams:
    """The engine's beam bookkeeping (Sec. 4.4): each live beam's next-token log-softmax waits here until
    every live beam of its request has one; then ``step`` applies the rule once."""

    def __init__(self, eos_ids, max_seq_len: int, tokenizer=None):
        self.eos_ids, self.max_seq_len, self.tokenizer = eos_ids, max_seq_len, tokenizer
        self.logprobs: dict[int, torch.Tensor] = {}  # seq_id -> (V,) of a beam waiting for its siblings

    def hold(self, seq, logits: torch.Tensor) -> None:
        """Keep a beam's log-softmax of its (V,) next-token logits, as the naive search computes it."""
        self.logprobs[seq.seq_id] = torch.log_softmax(logits, dim=-1)

    def drop(self, seq_id: int) -> None:
        self.logprobs.pop(seq_id, None)

    def step(self, req, fork, finish) -> None:
        """Once every live beam of ``req`` has its logits, one step of the rule: beams kept more than once fork
        (before any token is appended, so a fork copies its parent's state), dropped ones finish, and the live
        beams share the request's beam_width seats; when the search ends, ``req.beam_output`` holds its best
        hypotheses. ``fork`` and ``finish`` are the ``RequestTracker``'s."""
        beams, p = [s for s in req.seqs if not s.is_finished], req.params
        if not all(s.seq_id in self.logprobs for s in beams):
            return
        lp = torch.stack([self.logprobs.pop(s.seq_id) for s in beams])  # (K, V)
        live, closed = select_beams([s.cumulative_logprob for s in beams], lp, p.beam_width, self.eos_ids,
                                    p.ignore_eos)
        req.completed += [(beams[i].output_token_ids + [t], c) for i, t, c in closed]
        n_out = beams[0].num_output_tokens + 1
        stop = search_done(req.completed, live[0][2] if live else None, n_out, p)
        if stop or n_out >= p.max_tokens or beams[0].num_tokens + 1 >= self.max_seq_len:
            if not stop:
                req.completed += [(beams[i].output_token_ids + [t], c) for i, t, c in live]
            req.beam_output = finalize(req.prompt_token_ids, req.completed, p, self.tokenizer)
        req.metrics.first_token_time = req.metrics.first_token_time or time.perf_counter()
        if req.beam_output is not None:
            for s in beams:
                finish(s, "length")
            return
        targets, kept = [], set()
        for i, _, _ in live:
            targets.append(fork(req, beams[i], len(req.seqs)) if i in kept else beams[i])
            kept.add(i)
        for i, s in enumerate(beams):
            if i not in kept:
                finish(s, "stop")
        req.seqs = targets + [s for s in req.seqs if s.is_finished]
        for j, (seq, (_, token, c)) in enumerate(zip(targets, live)):
            seq.seats = 1 if j else p.beam_width - (len(targets) - 1)
            seq.token_ids.append(token)
            seq.cumulative_logprob = c


@torch.inference_mode()
def beam_search_naive(model, prompt_token_ids: list[int], params: BeamSearchParams, *, eos_ids=(),
                      tokenizer=None) -> BeamSearchOutput:
    """Beam search that recomputes every beam's whole sequence every step (no cache, no sharing): the
    baseline of ``LLM.beam_search``, same rule, same result.

    Raises:
        ValueError: as ``minillm.generation.check_prompt``.
    """
    ctx = check_prompt(model, prompt_token_ids, None)
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    closed: list[tuple[list[int], float]] = []
    for step in range(min(params.max_tokens, ctx - len(prompt_token_ids))):
        logprobs = []
        for out, _ in beams:
            ids = torch.tensor([list(prompt_token_ids) + out], device=model.device)
            logits = model(ids, torch.arange(ids.shape[1], device=model.device))[0, -1]  # (V,)
            logprobs.append(torch.log_softmax(logits.float(), -1))
        live, done = select_beams([c for _, c in beams], torch.stack(logprobs), params.beam_width, eos_ids,
                                  params.ignore_eos)
        closed += [(beams[p][0] + [t], c) for p, t, c in done]
        beams = [(beams[p][0] + [t], c) for p, t, c in live]
        if search_done(closed, beams[0][1] if beams else None, step + 1, params):
            beams = []
            break
    return finalize(prompt_token_ids, closed + beams, params, tokenizer)
