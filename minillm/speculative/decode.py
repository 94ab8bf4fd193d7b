"""The speculative decoding loop (Leviathan et al. 2023, Algorithm 1, looped): a proposer drafts
gamma tokens; the target scores all of them in one forward pass over its KV cache; the rejection step
(``speculative.rejection``) keeps a prefix, and the rejected positions are rolled back with the
cache's ``truncate``. Also ``replay_greedy`` (the passes a greedy run takes, counted from its answer)
and ``predicted_speedup`` (the speedup predicted from measured alpha and verify costs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..generation import prefill
from ..stops import GenerationResult, Stopper, check_prompt, check_token_ids, finish, stop_ids
from ..kv_cache import KVCache
from ..sampling import logits_to_probs, make_generator
from ..sampling_params import SamplingParams
from ..timing import synchronize
from .rejection import expected_tokens_per_pass, rejection_sample


@dataclass
class SpeculativeStats:
    """Per target pass: tokens drafted (k, which varies for prompt lookup: 0 when nothing matches),
    drafts accepted, tokens emitted, and seconds spent drafting and verifying (verification includes
    the target's forward over 1 + k tokens, ``logits_to_probs`` and ``rejection_sample``).

    ``emitted`` is accepted + 1 (the replacement or bonus token) except in a pass that EOS or a stop
    string ends early, which keeps fewer; left empty, accepted + 1 is assumed."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    draft_s: list[float] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)

    def add_pass(self, drafted: int, accepted: int, emitted: int, draft_s: float, verify_s: float) -> None:
        """Records one target pass."""
        self.drafted.append(drafted)
        self.accepted.append(accepted)
        self.emitted.append(emitted)
        self.draft_s.append(draft_s)
        self.verify_s.append(verify_s)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens (drafts after a rejection count as drafted, not accepted)."""
        return sum(self.accepted) / max(1, sum(self.drafted))

    @property
    def alpha(self) -> float:
        """Leviathan et al.'s alpha (Sec. 3.1, the expected acceptance probability of one draft
        token), estimated as accepted / examined: drafts after the first rejection are never tested,
        so they are not counted (with i.i.d. acceptances this is the maximum-likelihood estimate)."""
        examined = sum(min(a + 1, k) for k, a in zip(self.drafted, self.accepted))
        return sum(self.accepted) / max(1, examined)

    @property
    def tokens_per_target_pass(self) -> float:
        """Emitted tokens per target forward: accepted drafts + 1 (the replacement or bonus), or
        fewer in a pass where generation stopped."""
        emitted = self.emitted or [a + 1 for a in self.accepted]
        return sum(emitted) / max(1, len(emitted))

    def acceptance_by_position(self) -> list[float]:
        """P(draft j accepted | drafts 1..j-1 accepted) for j = 1..max k; nan where never reached."""
        reached, ok = [0] * max(self.drafted, default=0), [0] * max(self.drafted, default=0)
        for k, a in zip(self.drafted, self.accepted):
            for j in range(min(a + 1, k)):
                reached[j] += 1
                ok[j] += j < a
        return [o / r if r else float("nan") for o, r in zip(ok, reached)]


class _Lap:
    """A stopwatch for the phases of a pass: ``lap()`` is the seconds since the previous lap (or the start)."""

    def __init__(self):
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds


def _check_args(target, proposer, prompt_tokens, params, num_speculative_tokens, max_seq_len) -> int:
    """``speculative_generate``'s checks (its Raises); returns the context length in tokens."""
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int):
        raise ValueError(f"num_speculative_tokens: must be an int, got {num_speculative_tokens!r}")
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens: must be >= 1, got {num_speculative_tokens}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params: must be a SamplingParams, got {type(params).__name__}")
    ctx = check_prompt(target, prompt_tokens, max_seq_len)
    vocab = getattr(proposer, "vocab_size", None)  # a student's proposer may not say
    if vocab is not None and vocab != target.config.vocab_size:
        raise ValueError(f"proposer: drafts over a vocabulary of {vocab} ids, the target has "
                         f"{target.config.vocab_size}; the draft must share the target's tokenizer")
    return ctx


def _keep(stopper: Stopper, result: GenerationResult, emitted: list[int], max_new_tokens: int, on_token,
          pass_s: float) -> tuple[int, bool]:
    """Emits a pass's ids into ``result`` up to EOS, a stop string or ``max_new_tokens``, sharing the pass's
    seconds equally among the ones kept; returns how many it kept and whether generation is done."""
    done, kept = False, 0
    while kept < len(emitted) and not done and len(result.tokens) < max_new_tokens:
        kept += 1
        done = stopper.emit(result, emitted[kept - 1], 0.0, on_token)
    result.step_s[-kept:] = [pass_s / kept] * kept
    return kept, done


def _verify(target, cache: KVCache, tokens: list[int], draft: list[int], draft_probs, params: SamplingParams,
            gen) -> tuple[list[int], int]:
    """One target pass: the target scores the pending token (``tokens[-1]``) and the drafts in one forward,
    ``rejection_sample`` keeps a prefix, and the cache rolls back to it; returns the emitted ids and the
    number of drafts accepted."""
    start, device = len(tokens) - 1, target.device
    feed = torch.tensor([[tokens[-1]] + draft], device=device)  # (1, 1 + k)
    logits = target(feed, torch.arange(start, start + feed.shape[1], device=device), cache)[0]
    target_probs = logits_to_probs(logits, params).cpu()  # (1 + k, V)
    # greedy: target and draft probabilities are one-hot, so acceptance is an exact comparison
    emitted, n_ok = rejection_sample(draft, draft_probs, target_probs, gen)
    cache.truncate(start + 1 + n_ok)  # roll back the rejected drafts' keys and values
    return emitted, n_ok


@torch.inference_mode()
def speculative_generate(target, proposer, prompt_tokens: list[int], params: SamplingParams = SamplingParams(), *,
                         num_speculative_tokens: int = 4, max_seq_len: int | None = None, tokenizer=None,
                         on_token: Callable[[int], None] | None = None,
                         eos_ids: set[int] | None = None) -> tuple[GenerationResult, SpeculativeStats]:
    """Generate with speculative decoding (batch 1; Leviathan et al. 2023, Algorithm 1, looped).
    At temperature 0 the tokens equal the target's greedy tokens for any proposer; when sampling
    they follow the target's distribution. Each pass the proposer drafts k <= gamma tokens, the target
    scores the pending token and the drafts in one forward, ``rejection_sample`` keeps a prefix, and
    ``KVCache.truncate`` rolls the cache back to it (a paged cache frees its blocks the same way).

    Args:
        target: the ``Decoder`` whose distribution is reproduced.
        proposer: a ``NgramProposer``, ``DraftModelProposer`` or any object with ``propose``.
        num_speculative_tokens: gamma, the most drafts per target pass (>= 1).
        on_token: called with each emitted id as soon as its pass is verified (streaming).
        Other arguments as ``minillm.generation.generate_cached``.

    Returns:
        (GenerationResult, SpeculativeStats). ``step_s`` shares each pass's time equally among the
        tokens it emitted; ``prefill_s`` also holds the prompt's forward, as in ``generate_cached``.

    Raises:
        ValueError: gamma < 1, or the prompt errors of ``generate_cached``.
    """
    ctx = _check_args(target, proposer, prompt_tokens, params, num_speculative_tokens, max_seq_len)
    device, gen, clock = target.device, make_generator(params, "cpu"), _Lap()
    stopper = Stopper(params, tokenizer, stop_ids(tokenizer, eos_ids))
    cache = KVCache(target.config, 1, ctx, target.dtype, device)
    result, stats, tokens = GenerationResult(prompt_tokens=list(prompt_tokens)), SpeculativeStats(), list(prompt_tokens)
    # invariant: the target cache holds every token but the last one, which is "pending"
    if len(tokens) > 1:
        prefill(target, torch.tensor([tokens[:-1]], device=device), cache)
    synchronize(device)
    prompt_s = clock.lap()  # the prompt's forward, before the first pass
    while len(result.tokens) < params.max_new_tokens and len(tokens) < ctx:
        room = min(num_speculative_tokens, ctx - len(tokens) - 1, params.max_new_tokens - len(result.tokens) - 1)
        draft, draft_probs = proposer.propose(tokens, room, params, gen) if room > 0 else ([], None)
        draft, draft_s = draft[:room], clock.lap()
        emitted, n_ok = _verify(target, cache, tokens, draft, draft_probs, params, gen)
        verify_s = clock.lap()
        kept, done = _keep(stopper, result, emitted, params.max_new_tokens, on_token, draft_s + verify_s)
        tokens += emitted[:kept]
        stats.add_pass(len(draft), n_ok, kept, draft_s, verify_s)
        if done:
            break
    return finish(result, tokenizer, prompt_s), stats  # the first new token waited for the prompt's forward


def replay_greedy(proposer, prompt_tokens: list[int], answer: list[int], params: SamplingParams = SamplingParams(), *,
                  num_speculative_tokens: int = 4) -> SpeculativeStats:
    """The target passes greedy speculative decoding takes to emit a known greedy ``answer``, without running
    the target: at temperature 0 a draft is accepted exactly when it equals the answer's next token (Leviathan
    et al. 2023, Sec. 2.3, a one-hot target). The passes are ``speculative_generate``'s: up to min(gamma, tokens
    left - 1) drafts, accepted up to the first mismatch, plus one token. Exact for an answer cut by max_new_tokens;
    for one ended by EOS or a stop string the passes are the live run's, while ``drafted``, ``accepted`` and
    ``alpha`` can differ in the last passes (docs/speculative.md, "The draft model and the replay").

    Args:
        proposer: a deterministic proposer (prompt lookup; a draft model at temperature 0).
        prompt_tokens, answer: the prompt ids and the greedy ids generated after them.
        params: greedy ``SamplingParams``, passed to ``proposer.propose`` (with generator None).
        num_speculative_tokens: gamma, the most drafts per pass (>= 1).

    Returns:
        ``SpeculativeStats`` with drafted, accepted and emitted per pass (timings empty).

    Raises:
        ValueError: num_speculative_tokens < 1, sampling ``params`` (the replay holds at greedy
            only), an empty prompt, or ids outside the proposer's vocabulary.
    """
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens: must be >= 1, got {num_speculative_tokens}")
    if not isinstance(params, SamplingParams) or not params.greedy:
        raise ValueError(f"params: replay holds at greedy only (SamplingParams with temperature 0), got {params!r}")
    if len(prompt_tokens) == 0:
        raise ValueError("prompt_tokens: is empty; give at least one token")
    vocab = getattr(proposer, "vocab_size", None)  # a student's proposer may not say
    if vocab is not None:
        check_token_ids("prompt_tokens", prompt_tokens, vocab)
        check_token_ids("answer", answer, vocab)
    stats, tokens, i = SpeculativeStats(), list(prompt_tokens), 0
    while i < len(answer):
        room = min(num_speculative_tokens, len(answer) - i - 1)
        draft = proposer.propose(tokens, room, params, None)[0][:room] if room > 0 else []
        n_ok = 0
        while n_ok < len(draft) and draft[n_ok] == answer[i + n_ok]:
            n_ok += 1
        tokens += answer[i:i + n_ok + 1]
        i += n_ok + 1
        stats.drafted.append(len(draft))
        stats.accepted.append(n_ok)
        stats.emitted.append(n_ok + 1)
    return stats


def predicted_speedup(stats: SpeculativeStats, verify_cost: dict[int, float], draft_cost: float = 0.0) -> dict:
    """Speedup over plain decoding predicted from measured quantities, pass by pass.

    Cost of pass i in decode steps: verify_cost[1 + k_i] / verify_cost[1] + draft_cost * k_i, with
    k_i the tokens drafted in that pass (prompt lookup often drafts 0). Tokens of pass i: either the
    measured tokens it emitted (a_i + 1, fewer in a pass where generation stopped), or (i.i.d. model)
    ``expected_tokens_per_pass(alpha, k_i)``.

    Args:
        stats: one run's ``SpeculativeStats``.
        verify_cost: {k: seconds of one target forward over k tokens} for k = 1 .. max k + 1
            (``minillm.timing.measure_verify``); k = 1 is a decode step.
        draft_cost: c, seconds of one draft token / seconds of one target decode step (0 for n-gram).

    ``predicted_speedup_after_first_token`` is the same prediction on the accounting of a measured
    speedup of ``decode_tokens_per_s``, which counts the tokens after the first and the time after the
    first token's share of its pass (``finish``): the first pass then weighs only (e_1 - 1) / e_1 of its
    cost, and (sum of e_i) - 1 tokens are counted. With few passes (a large gamma on a short answer) the
    two predictions differ most, since the first pass often keeps a single token.

    Returns:
        dict: cost_per_pass (decode steps), tokens_per_pass (measured), tokens_per_pass_alpha,
        predicted_speedup (measured tokens / cost), predicted_speedup_alpha,
        predicted_speedup_after_first_token (0 when the run emitted a single token).

    Raises:
        ValueError: no passes, or a k + 1 missing from verify_cost.
    """
    if not stats.drafted:
        raise ValueError("stats: no target passes recorded")
    missing = sorted({k + 1 for k in stats.drafted} - verify_cost.keys())
    if missing or 1 not in verify_cost:
        raise ValueError(f"verify_cost: needs the forward time for k = 1 and {missing}")
    n, alpha = len(stats.drafted), stats.alpha
    cost = sum(verify_cost[1 + k] / verify_cost[1] + draft_cost * k for k in stats.drafted) / n
    tokens = stats.tokens_per_target_pass
    tokens_alpha = sum(expected_tokens_per_pass(alpha, k) for k in stats.drafted) / n
    emitted = stats.emitted or [a + 1 for a in stats.accepted]
    first = verify_cost[1 + stats.drafted[0]] / verify_cost[1] + draft_cost * stats.drafted[0]
    after_tokens, after_cost = sum(emitted) - 1, n * cost - first / max(1, emitted[0])
    after = after_tokens / after_cost if after_tokens > 0 and after_cost > 0 else 0.0
    return {"cost_per_pass": cost, "tokens_per_pass": tokens, "tokens_per_pass_alpha": tokens_alpha,
            "predicted_speedup": tokens / cost, "predicted_speedup_alpha": tokens_alpha / cost,
            "predicted_speedup_after_first_token": after}
