"""Speculative decoding inside the engine's step (Leviathan et al. 2023, Algorithm 1, batched as vLLM V1).

Before the scheduler plans a step, every running sequence in decode gets up to k drafts
(``Sequence.spec_token_ids``): prompt lookup (``NgramProposer``) or a draft model (``spec_draft``). They ride
after the sequence's pending token in the step's flat row, when the budget and the pool hold them; the
output layer runs at the pending token and each draft. ``draw`` verifies: greedy keeps the longest prefix
equal to the target's argmax, sampled requests are rejection-sampled, then one more token. ``append`` rolls
the rejected drafts back (computed count and slots), so the sequence is exactly one that never speculated;
only verified tokens name blocks in the prefix cache (docs/speculative.md).
"""

from __future__ import annotations

import itertools
import numbers
import os
from dataclasses import dataclass, field

import torch

from ..data import BENCH_PROMPT
from ..sampling import logits_to_probs
from ..speculative.proposers import NgramProposer
from ..speculative.rejection import draw, rejection_sample
from .sampler import Draw, checked_lse, draw_tokens, keyed_generator, restored_on_error
from .spec_draft import DraftRunner
from .spec_auto import choose_draft_lengths, measure_acceptance, measure_step_cost

METHODS = ("ngram", "draft_model")
KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
        "max_num_speculative_tokens", "step_cost"}
AUTO_MAX = 5  # the longest draft "auto" considers, unless max_num_speculative_tokens says otherwise
MAX_DRAFT = 64  # the longest draft a step may carry: each draft token holds a slot, and is rarely accepted that far
# acceptance drifts along a text (a copy begins after a preamble whose drafts fail): each committed step keeps
# this share of a sequence's counts, so old failures fade and a sequence that stopped drafting tries again
ALPHA_DECAY = 0.8


@dataclass
class SpeculativeConfig:
    """A checked ``speculative_config`` (vLLM's dict, plus "auto" lengths; ``check_speculative_config``)."""

    method: str
    num_speculative_tokens: int | str
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: object = None  # the draft Decoder (a path is loaded by check_speculative_config)
    max_num_speculative_tokens: int = AUTO_MAX
    step_cost: object = None  # "auto": tokens -> seconds of a forward (default: measured once)

    @property
    def auto(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def k(self) -> int:
        """The longest draft a step may carry."""
        return self.max_num_speculative_tokens if self.auto else self.num_speculative_tokens


def _positive(name, value, most: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"speculative_config: {name} is {value}, at most {most} (every draft token holds a KV slot; "
                         "a draft that long is never accepted in full)")
    return int(value)


def check_speculative_config(config, target, load=None) -> SpeculativeConfig | None:
    """Refuse a ``speculative_config`` naming the field, before any memory is taken; load a draft given as
    a path with ``load`` (path -> Decoder). None stays None (no speculation).

    Raises:
        ValueError: not a dict, an unknown key or method, a non-positive length, prompt_lookup_min above
            prompt_lookup_max, a draft_model without "model", or a draft with another vocabulary.
    """
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config: must be a dict such as {{'method': 'ngram', "
                         f"'num_speculative_tokens': 4}}, got {type(config).__name__}")
    unknown = sorted(set(config) - KEYS)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown}; the keys are {sorted(KEYS)}")
    method = config.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {METHODS}, got {method!r}")
    k = config.get("num_speculative_tokens")
    k = k if k == "auto" else _positive("num_speculative_tokens", k, MAX_DRAFT)
    most = _positive("max_num_speculative_tokens", config.get("max_num_speculative_tokens", AUTO_MAX), MAX_DRAFT)
    lo = _positive("prompt_lookup_min", config.get("prompt_lookup_min", 1))
    hi = _positive("prompt_lookup_max", config.get("prompt_lookup_max", max(3, lo)))
    if lo > hi:
        raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
    cost = config.get("step_cost")
    if cost is not None and not callable(cost):
        raise ValueError("speculative_config: step_cost must be a function of a step's token count (seconds)")
    draft = config.get("model")
    if method == "draft_model":
        if draft is None:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (a path or a Decoder)")
        if not isinstance(draft, (torch.nn.Module, str, os.PathLike)):
            raise ValueError(f"speculative_config: model must be a path load_model takes or a Decoder, got "
                             f"{type(draft).__name__}")
        if not isinstance(draft, torch.nn.Module):
            draft = load(draft)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"speculative_config: model has a vocabulary of {draft.config.vocab_size} ids, the "
                             f"target {target.config.vocab_size}; a draft must share the target's tokenizer")
    elif draft is not None:
        raise ValueError("speculative_config: 'model' is for method 'draft_model', not 'ngram'")
    return SpeculativeConfig(method, k, lo, hi, draft, most, cost)


@dataclass
class SpecDecodingStats:
    """vLLM's counters: drafts (sequences that carried any draft into a step), draft tokens, accepted
    tokens, and accepted tokens per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_accepted_tokens_per_pos += [0] * (drafted - len(self.num_accepted_tokens_per_pos))
        for j in range(accepted):
            self.num_accepted_tokens_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafted sequence gains per step: 1 + accepted / drafts (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def keyed_run(drafts: list[int], target_probs: torch.Tensor, seed: int, position: int) -> tuple[list[int], int]:
    """Rejection sampling with a one-hot q (prompt lookup), one uniform per position: the token at
    ``position + j`` is ``draw(target_probs[j])`` with a generator seeded by (seed, position + j), and the draft
    there is accepted when it equals that token. The same law as ``rejection_sample``, and a seeded request's
    tokens depend on its seed and logits alone, not on how many drafts the batch left it.
    Returns (emitted tokens, drafts accepted)."""
    for j in range(len(drafts) + 1):
        token = draw(target_probs[j], keyed_generator(seed, position + j))
        if j == len(drafts) or token != drafts[j]:
            return drafts[:j] + [token], j
    raise AssertionError("unreachable")


class SpecDecoder:
    """The engine's speculation: ``propose`` before the scheduler, ``logits_indices`` for the forward,
    ``draw`` (verification) after it, ``append`` (rollback and tokens) when the step commits."""

    def __init__(self, config: SpeculativeConfig, model, tokenizer, scheduler, requests: dict, max_seq_len: int,
                 steps):
        """``model``: the target; ``scheduler``: the engine's (its pool and limits); ``requests``: the engine's
        live requests by id (a sequence's sampling parameters); ``steps()``: the engine's committed steps."""
        self.config, self.requests, self.max_seq_len, self.steps = config, requests, max_seq_len, steps
        self.manager, self.budget = scheduler.manager, scheduler.max_num_batched_tokens
        self.stats = SpecDecodingStats()
        self.ngram = NgramProposer(model.config.vocab_size, config.prompt_lookup_max, config.prompt_lookup_min)
        self.draft = None
        if config.method == "draft_model":
            self.draft = DraftRunner(config.model, scheduler, config.k, config.auto)
        self.step_cost = config.step_cost
        if config.auto and self.step_cost is None:
            self.step_cost = measure_step_cost(model, self.budget)
        # the acceptance rate a sequence starts from (as two drafts' worth of evidence): a draft model's measured
        # at start on a short text of its own where the engine can tokenize one, else 1 in 2
        self.prior = 0.5
        if config.auto and self.draft is not None and tokenizer is not None:
            measured = measure_acceptance(config.model, model, tokenizer.encode(BENCH_PROMPT))
            self.prior = 0.5 if measured is None else measured
        self._alpha: dict[int, tuple[float, float, int]] = {}  # seq_id -> (accepted, examined) drafts at a step
        self._counts: list[int] = []  # rows of each ready sequence in the last forward

    # ---- before the scheduler --------------------------------------------------------------------
    def propose(self, running) -> None:
        """Draft tokens for every running sequence in decode (one pending token); none for beams."""
        seqs = []
        for seq in running:
            seq.spec_token_ids = []
            req = self.requests.get(seq.request_id)
            # one token left to compute, and not the prompt's last: at the first draw a request with n > 1 forks,
            # and each of its samples draws its own first token
            if (req is None or req.is_beam_search or seq.num_tokens - seq.num_computed_tokens != 1
                    or seq.num_output_tokens == 0):
                continue
            room = self._room(seq, req)
            if room > 1:  # at most room - 1 drafts: the step emits at most room tokens
                seqs.append((seq, req, min(self.config.k, room - 1)))
        if self.draft is not None:
            self.draft.begin()
            self.draft.release(running)
            if seqs:  # "auto" cuts a draft model's lengths before it drafts, prompt lookup's after
                self.draft.propose(self._auto(seqs, running, [k for _, _, k in seqs]) if self.config.auto else seqs)
            return
        for seq, _, k in seqs:
            seq.spec_token_ids = self.ngram.lookup(seq.token_ids, k)
        if self.config.auto and seqs:
            self._auto(seqs, running, [len(seq.spec_token_ids) for seq, _, _ in seqs])

    def _auto(self, seqs, running, most):
        """Cut each sequence's draft to the length ``choose_draft_lengths`` picks for this step."""
        own = sum(min(s.num_tokens - s.num_computed_tokens, self.budget)
                  for s in running if s.num_tokens > s.num_computed_tokens)
        alphas = [self.alpha(seq.seq_id) for seq, _, _ in seqs]
        feeds = catch_up = None
        if self.draft is not None:
            priced = [self._first_feed(seq, req, a, m) for (seq, req, _), a, m in zip(seqs, alphas, most)]
            feeds, catch_up = [f for f, _ in priced], [c for _, c in priced]
        ks = choose_draft_lengths(alphas, most, own, self.step_cost, self.draft.forward_cost if self.draft else None,
                                  first_feed=feeds, catch_up=catch_up)
        for (seq, _, _), k in zip(seqs, ks):
            del seq.spec_token_ids[k:]
        return [(seq, req, k) for (seq, req, _), k in zip(seqs, ks) if k > 0]

    def _room(self, seq, req) -> int:
        """Tokens the sequence may still emit: its max_tokens, or its context, whichever ends first."""
        return min(req.params.max_new_tokens - seq.num_output_tokens, self.max_seq_len - seq.num_tokens + 1)

    def _first_feed(self, seq, req, alpha: float, most: int) -> tuple[float, float]:
        """(tokens, seconds): what a sequence's first draft forward is priced at. In steady state the draft has
        read every draft it wrote but the last, so it feeds the target's token after the accepted run, plus the
        last draft when all were accepted: 1 + alpha^most tokens. A prompt, or a stretch the draft sat out, is a
        catch-up that serves every later step of the sequence: its seconds (a forward over the whole stretch)
        are shared among the steps left, about its room (max_tokens - output, or the context left) over
        1 + alpha + ... + alpha^most."""
        steady = 1 + alpha ** most
        feed = self.draft.feed(seq)
        if feed <= steady:
            return feed, 0.0
        left = max(1.0, self._room(seq, req) / sum(alpha ** j for j in range(most + 1)))
        # two estimates (one as run, one from the start's curve) can be ordered wrongly for close token counts
        return steady, max(0.0, self.draft.forward_cost(feed) - self.draft.forward_cost(steady)) / left

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step's forward of num_tokens took ``seconds``: "auto"'s measured costs follow (not given ones)."""
        if self.config.auto and self.config.step_cost is None:
            self.step_cost.observe(num_tokens, seconds)

    def alpha(self, seq_id: int) -> float:
        """The sequence's acceptance rate (accepted / examined drafts, faded by ``ALPHA_DECAY``), from ``prior``."""
        accepted, examined = self._faded(seq_id)
        return (accepted + 2.0 * self.prior) / (examined + 2.0)

    def _faded(self, seq_id: int) -> tuple[float, float]:
        """(accepted, examined) as of now, faded by the steps committed since (read, not written, while a step
        is planned: a failed step leaves them as they were)."""
        accepted, examined, at = self._alpha.get(seq_id, (0.0, 0.0, 0))
        keep = ALPHA_DECAY ** (self.steps() - at)
        return accepted * keep, examined * keep

    def discard(self, running) -> None:
        """A failed step: its drafts are dropped (the next step proposes again)."""
        for seq in running:
            seq.spec_token_ids = []
        if self.draft is not None:
            self.draft.restore()

    # ---- the forward and the verification ---------------------------------------------------------
    def logits_indices(self, rows, ready) -> torch.Tensor:
        """Flat indices of each ready sequence's pending token and drafts (its last 1 + d tokens)."""
        self._counts = [1 + len(s.spec_token_ids) for s in ready]
        if rows.widths is not None:  # one flat row: a sequence's tokens are side by side
            idx = [rows.last[s.seq_id][1] - c + 1 + j for s, c in zip(ready, self._counts) for j in range(c)]
        else:
            T, pos = rows.tokens.shape[1], rows.input_pos.tolist()
            where = {(s, p): b * T + t for b, (s, row) in enumerate(zip(rows.seq_ids, pos)) for t, p in enumerate(row)}
            idx = [where[(s.seq_id, s.num_tokens - 1 + j)] for s, c in zip(ready, self._counts) for j in range(c)]
        return torch.tensor(idx, dtype=torch.long, device=rows.tokens.device)

    def last_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Each ready sequence's logits after its last scheduled token (R, V)."""
        if len(self._counts) == logits.shape[0]:
            return logits
        return logits[torch.tensor(list(itertools.accumulate(self._counts)), device=logits.device) - 1]

    def emitted_rows(self, logits: torch.Tensor, i: int, drawn: Draw) -> torch.Tensor:
        """The logits rows the i-th ready sequence's drawn tokens come from: a verified run's from its pending
        token on (one per token), else its last row."""
        end = sum(self._counts[:i + 1])
        if drawn.drafted:
            return logits[end - self._counts[i]:end - self._counts[i] + len(drawn.samples[0])]
        return logits[end - 1:end]

    def draw(self, logits: torch.Tensor, plans: list, ready) -> list[Draw]:
        """What each ready sequence draws: a verified run for a drafted one, else one token per sample
        (``draw_tokens``; with prompt lookup a sampled row draws by position). Generators are restored on error."""
        mine = [i for i, (s, p) in enumerate(zip(ready, plans))
                if p is not None and (s.spec_token_ids or (self.draft is None and not p[0].greedy))]
        if not mine:
            return draw_tokens(self.last_rows(logits), plans)
        plain = [None if i in set(mine) else p for i, p in enumerate(plans)]
        with restored_on_error(g for p in plans if p is not None for g in p[1]):
            verified = self._verify(logits, plans, ready, mine)
            draws = draw_tokens(self.last_rows(logits), plain)
        for i, drawn in zip(mine, verified):
            draws[i] = drawn
        return draws

    def _verify(self, logits, plans, ready, mine) -> list[Draw]:
        """Greedy: the longest prefix of drafts equal to the target's argmax, then the argmax after it. Sampled:
        ``keyed_run`` per sample (prompt lookup) or ``rejection_sample`` against the draft's q. Returns a ``Draw``
        per sequence: a verified run for a drafted one, else one token per sample."""
        starts = [e - c for e, c in zip(itertools.accumulate(self._counts), self._counts)]
        lse = checked_lse(logits)
        top = logits.argmax(-1).tolist()
        found, rows, toks = [], [], []
        for i in mine:
            seq, (params, gens) = ready[i], plans[i]
            drafts, a0 = seq.spec_token_ids, starts[i]
            if params.greedy:
                a = 0
                while a < len(drafts) and drafts[a] == top[a0 + a]:
                    a += 1
                runs = [(drafts[:a] + [top[a0 + a]], a)]
            elif self.draft is None:  # prompt lookup: q is one-hot, one keyed uniform per position
                target = logits_to_probs(logits[a0:a0 + len(drafts) + 1], params)
                runs = [keyed_run(drafts, target, g.initial_seed(), seq.num_tokens) for g in gens]
            else:
                target = logits_to_probs(logits[a0:a0 + len(drafts) + 1], params)
                runs = [rejection_sample(drafts, self.draft.probs(seq), target, gens[0])]
            found.append((len(drafts), runs))
            for emitted, _ in runs:
                rows += range(a0, a0 + len(emitted))
                toks += emitted
        rows_t = torch.tensor(rows, device=logits.device)
        lps = (logits[rows_t, torch.tensor(toks, device=logits.device)].double() - lse[rows_t].double()).tolist()
        out, j = [], 0
        for d, runs in found:
            samples = []
            for emitted, _ in runs:
                samples.append(list(zip(emitted, lps[j:j + len(emitted)])))
                j += len(emitted)
            out.append(Draw(samples, d, runs[0][1]) if d else Draw(samples))
        return out

    # ---- once the step commits -----------------------------------------------------------------------
    def append(self, req, seq, run: Draw, append) -> None:
        """Roll the rejected drafts back (computed count and slots, as if never drafted), count the step, then
        append the run's tokens with ``append`` (the engine's, with its stops) until the sequence finishes."""
        seq.num_computed_tokens -= run.drafted - run.accepted
        self.manager.truncate(seq.seq_id, seq.num_computed_tokens, keep_token_ids=True)
        seq.spec_token_ids = []
        self.stats.observe(run.drafted, run.accepted)
        if req.metrics.spec_decoding is None:
            req.metrics.spec_decoding = SpecDecodingStats()
        req.metrics.spec_decoding.observe(run.drafted, run.accepted)
        accepted, examined = self._faded(seq.seq_id)
        self._alpha[seq.seq_id] = (accepted + run.accepted, examined + min(run.accepted + 1, run.drafted),
                                   self.steps())
        for token, logprob in run.samples[0]:
            append(req, seq, token, logprob)
            if seq.is_finished:
                break

    def forget(self, seq) -> None:
        """A finished or aborted sequence: its acceptance record and its draft KV go."""
        self._alpha.pop(seq.seq_id, None)
        seq.spec_token_ids = []
        if self.draft is not None:
            self.draft.forget(seq)
