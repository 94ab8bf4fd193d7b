"""Speculative decoding with rejection sampling: the algorithm, two proposers (n-gram prompt lookup
and a draft model), the generation loop with KV-cache rollback, and the speedup models. The draft
model built for the embedded target is in ``minillm.draft``; the benchmark in ``minillm.bench_spec``.

A proposer drafts gamma tokens; the target scores all of them in one forward pass over its KV
cache; draft token x is accepted with probability ``min(1, target_probs(x) / draft_probs(x))``; at
the first rejection the replacement is drawn from the normalised residual
``max(0, target_probs - draft_probs)``; when all gamma are accepted a bonus token is drawn from the
target. The emitted tokens are distributed exactly as the target's own samples (Leviathan, Kalman,
Matias 2023, Algorithm 1 and Appendix A.1; Chen et al. 2023, Algorithm 2). We write
``target_probs`` / ``draft_probs`` because the two papers swap the letters p and q.

Rejected positions are rolled back with the cache's ``truncate``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .generation import GenerationResult, Stopper, check_prompt, check_token_ids, finish, stop_ids, synchronize
from .kv_cache import KVCache
from .sampling import SamplingParams, logits_to_probs, make_generator


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id from ``probs`` (V,) by inverse transform: the first index whose cumulative
    probability exceeds u * total, u ~ U[0, 1). Zero-probability ids are never drawn. Same law as
    ``torch.multinomial(probs, 1)``, which takes ~2 ms per draw over SmolLM2's 49,152 ids on one
    core; this takes ~0.1 ms."""
    cdf = probs.cumsum(-1)
    i = int(torch.searchsorted(cdf, torch.rand((), generator=generator, dtype=cdf.dtype) * cdf[-1], right=True))
    return i if i < len(cdf) else int(probs.nonzero()[-1])  # u * total rounded up to the total


def acceptance_probability(target_probs: torch.Tensor, draft_probs: torch.Tensor, token: int) -> float:
    """min(1, target_probs[token] / draft_probs[token]); draft_probs[token] > 0 since it was drafted."""
    q = float(draft_probs[token])
    return 1.0 if q <= 0 else min(1.0, float(target_probs[token]) / q)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, target_probs - draft_probs)), (V,). If the residual is all zero (only when the
    two distributions are equal, where rejection has probability 0) the target distribution."""
    r = (target_probs - draft_probs).clamp_min(0)
    s = r.sum()
    return target_probs if s <= 0 else r / s


def emitted_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """The exact law (V,) of the first token one step emits, without sampling: the draft x is kept
    with probability draft_probs(x) min(1, target_probs(x) / draft_probs(x)) = min(draft_probs(x),
    target_probs(x)), and with the remaining probability 1 - sum(min(...)) a token is drawn from the
    residual. Equals target_probs for any draft_probs (Leviathan et al. 2023, Appendix A.1)."""
    kept = torch.minimum(target_probs, draft_probs)
    return kept + (1 - kept.sum()) * residual_distribution(target_probs, draft_probs)


def rejection_sample(draft_tokens: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Verify drafted tokens against the target (Leviathan et al. 2023, Algorithm 1).

    Args:
        draft_tokens: the gamma drafted ids (gamma may be 0).
        draft_probs: (gamma, V) the distributions they were drawn from (one-hot for a deterministic
            proposer), after the same processing (temperature, top-k, top-p) as the target's.
        target_probs: (gamma + 1, V) the target's distributions at each drafted position and one past
            the last (for the bonus token).
        generator: the random source (seeded for reproducibility).

    Returns:
        (emitted tokens: the accepted drafts then one token from the residual or the bonus,
         number of drafts accepted).
    """
    for i, x in enumerate(draft_tokens):
        u = torch.rand((), generator=generator)
        if float(u) >= acceptance_probability(target_probs[i], draft_probs[i], x):
            replacement = draw(residual_distribution(target_probs[i], draft_probs[i]), generator)
            return list(draft_tokens[:i]) + [replacement], i
    bonus = draw(target_probs[len(draft_tokens)], generator)
    return list(draft_tokens) + [bonus], len(draft_tokens)


# ---------------------------------------------------------------------------------------------
# Proposers: anything with ``propose(tokens, gamma, params, generator) -> (draft ids, draft_probs)``


class NgramProposer:
    """Prompt lookup decoding (Saxena 2023): find the latest earlier occurrence of the last n tokens
    (n = max_n .. min_n) and propose the tokens that followed it. Deterministic: one-hot draft_probs.

    min_n = 1 by default: a one-token match drafts on almost every pass and is often wrong, so it
    pays only where a wrong draft costs the target little. With oneDNN's packed weights
    (``minillm.model.Linear``) verifying 5 tokens costs 1.0-1.15 decode steps on the 2-core CPU, and
    one-token matches measured better than or equal to two-token ones on 5 of the 6 workloads
    ``bench spec`` had then (summarise 1.36x vs 1.16x, chat 1.09x vs 0.98x; edit code 1.44x vs 1.51x). When
    verifying costs more (with MKL's small GEMMs it was 1.86 decode steps), use min_n = 2: then
    one-token matches measured 0.56-0.75x of plain decoding on the open-ended workloads."""

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1):
        self.vocab_size, self.max_n, self.min_n = vocab_size, max_n, min_n

    def propose(self, tokens: list[int], gamma: int, params: SamplingParams, generator=None):
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    draft = tokens[start + n:start + n + gamma]
                    probs = torch.zeros(len(draft), self.vocab_size)
                    probs[torch.arange(len(draft)), torch.tensor(draft, dtype=torch.long)] = 1.0
                    return draft, probs
        return [], torch.zeros(0, self.vocab_size)


class DraftModelProposer:
    """A smaller model sharing the tokenizer drafts gamma tokens autoregressively, sampling from
    ``logits_to_probs(draft logits, params)`` (exactly the distribution reported as draft_probs).
    Its own KV cache is rolled back to the longest prefix it shares with the accepted text.

    Args:
        draft_model: a ``Decoder`` with the target's vocabulary.
        max_seq_len: the target's context; a draft with a shorter context drafts fewer tokens near
            its end and none past it (the target then goes on alone, one token per pass).
    """

    def __init__(self, draft_model, max_seq_len: int):
        self.model = draft_model
        self.vocab_size = draft_model.config.vocab_size
        self.max_seq_len = min(max_seq_len, draft_model.config.max_seq_len)
        self.cache = KVCache(draft_model.config, 1, self.max_seq_len, draft_model.dtype, draft_model.device)
        self.cached: list[int] = []

    @torch.inference_mode()
    def propose(self, tokens: list[int], gamma: int, params: SamplingParams, generator=None):
        # the last draft is not fed back: positions up to len(tokens) + gamma - 2 go into the cache
        gamma = min(gamma, self.max_seq_len - len(tokens) + 1)
        if gamma < 1:
            return [], torch.zeros(0, self.vocab_size)
        keep = 0
        while keep < min(len(self.cached), len(tokens) - 1) and self.cached[keep] == tokens[keep]:
            keep += 1
        self.cache.truncate(keep)
        self.cached = self.cached[:keep]
        device = self.model.device
        feed = tokens[keep:]
        draft, probs = [], []
        for _ in range(gamma):
            pos = torch.arange(len(self.cached), len(self.cached) + len(feed), device=device)
            logits = self.model(torch.tensor([feed], device=device), pos, self.cache)[0, -1]
            self.cached += feed
            p = logits_to_probs(logits[None], params)[0].cpu()  # the generator lives on the CPU
            x = int(p.argmax()) if params.greedy else draw(p, generator)
            draft.append(x)
            probs.append(p)
            feed = [x]
        return draft, torch.stack(probs)


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


@torch.inference_mode()
def speculative_generate(target, proposer, prompt_tokens: list[int], params: SamplingParams = SamplingParams(), *,
                         num_speculative_tokens: int = 4, max_seq_len: int | None = None, tokenizer=None,
                         on_token: Callable[[int], None] | None = None,
                         eos_ids: set[int] | None = None) -> tuple[GenerationResult, SpeculativeStats]:
    """Generate with speculative decoding (batch 1; Leviathan et al. 2023, Algorithm 1, looped).
    At temperature 0 the tokens equal the target's greedy tokens for any proposer; when sampling
    they follow the target's distribution.

    Each pass: the proposer drafts k <= gamma tokens; the target runs one forward over the pending
    token and the k drafts, (1, 1 + k), giving target_probs (1 + k, V); ``rejection_sample`` keeps
    a prefix; the cache is truncated to the kept positions (``KVCache.truncate``: a rollback that
    only moves the fill length, so a paged cache can free the blocks past it the same way).

    Args:
        target: the ``Decoder`` whose distribution is reproduced.
        proposer: a ``NgramProposer``, ``DraftModelProposer`` or any object with ``propose``.
        num_speculative_tokens: gamma, the most drafts per target pass (>= 1).
        on_token: called with each emitted id as soon as its pass is verified (streaming).
        Other arguments as ``minillm.generation.generate_cached``.

    Returns:
        (GenerationResult, SpeculativeStats). ``step_s`` shares each pass's time equally among the
        tokens it emitted; the first token's share also holds the prompt's forward (all tokens but the
        last), so ``prefill_s`` is the time from the start to the first new token, as in
        ``generate_cached``.

    Raises:
        ValueError: gamma < 1, or the prompt errors of ``generate_cached``.
    """
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens: must be >= 1, got {num_speculative_tokens}")
    ctx = check_prompt(target, prompt_tokens, max_seq_len)
    device = target.device
    stopper = Stopper(params, tokenizer, stop_ids(tokenizer, eos_ids))
    vocab = getattr(proposer, "vocab_size", None)  # a student's proposer may not say
    if vocab is not None and vocab != target.config.vocab_size:
        raise ValueError(f"proposer: drafts over a vocabulary of {vocab} ids, the target has "
                         f"{target.config.vocab_size}; the draft must share the target's tokenizer")
    gen = make_generator(params, "cpu")
    cache = KVCache(target.config, 1, ctx, target.dtype, device)
    result, stats = GenerationResult(prompt_tokens=list(prompt_tokens)), SpeculativeStats()
    tokens = list(prompt_tokens)
    # invariant: the target cache holds every token but the last one, which is "pending"
    t_start = time.perf_counter()
    if len(tokens) > 1:
        target(torch.tensor([tokens[:-1]], device=device), torch.arange(len(tokens) - 1, device=device), cache)
    synchronize(device)
    t0 = time.perf_counter()
    prompt_s = t0 - t_start  # the prompt's forward, before the first pass
    while len(result.tokens) < params.max_new_tokens and len(tokens) < ctx:
        room = min(num_speculative_tokens, ctx - len(tokens) - 1, params.max_new_tokens - len(result.tokens) - 1)
        draft, draft_probs = proposer.propose(tokens, room, params, gen) if room > 0 else ([], None)
        draft = draft[:room]
        t1 = time.perf_counter()
        start = len(tokens) - 1
        feed = torch.tensor([[tokens[-1]] + draft], device=device)  # (1, 1 + k)
        logits = target(feed, torch.arange(start, start + feed.shape[1], device=device), cache)[0]
        target_probs = logits_to_probs(logits, params).cpu()  # (1 + k, V)
        # greedy: target and draft probabilities are one-hot, so acceptance is an exact comparison
        emitted, n_ok = rejection_sample(draft, draft_probs, target_probs, gen)
        cache.truncate(start + 1 + n_ok)  # roll back the rejected drafts' keys and values
        now = time.perf_counter()
        done, kept = False, 0
        for x in emitted:
            result.tokens.append(x)
            tokens.append(x)
            kept += 1
            if on_token is not None:
                on_token(x)
            done = stopper.check(result)  # EOS or a stop string (sets finish_reason)
            if done or len(result.tokens) >= params.max_new_tokens:
                break
        result.step_s += [(now - t0) / kept] * kept
        stats.drafted.append(len(draft))
        stats.accepted.append(n_ok)
        stats.emitted.append(kept)
        stats.draft_s.append(t1 - t0)
        stats.verify_s.append(now - t1)
        t0 = now
        if done:
            break
    if result.step_s:
        result.step_s[0] += prompt_s  # the first new token waited for the prompt's forward too
    result.prefill_s = result.step_s[0] if result.step_s else prompt_s
    result.decode_s = sum(result.step_s[1:])
    return finish(result, tokenizer), stats


def replay_greedy(proposer, prompt_tokens: list[int], answer: list[int], params: SamplingParams = SamplingParams(), *,
                  num_speculative_tokens: int = 4) -> SpeculativeStats:
    """The target passes greedy speculative decoding takes to emit a known greedy ``answer``, found
    without running the target: at temperature 0 a draft is accepted exactly when it equals the target's
    argmax, which is the answer's next token (Leviathan et al. 2023, Sec. 2.3 with one-hot target_probs).

    What a proposer or a gamma would give on an answer can so be asked in milliseconds, for instance
    the most tokens per pass that prompt lookup can reach on an answer written in the model's own
    words. The passes follow ``speculative_generate``'s: k <= min(gamma, tokens still to emit - 1)
    drafts, accepted up to the first mismatch, plus one token.

    Exact for an answer cut by ``max_new_tokens``. For an answer that ended with EOS or a stop string,
    a live run may also draft, and even accept, tokens past the answer's end in the passes whose
    window reaches it (what the target would say after EOS is unknown here); the replay drafts only
    up to the end. The number of passes and the tokens emitted by each (so ``tokens_per_target_pass``)
    are still the live run's; ``drafted``, ``accepted`` and ``alpha`` can differ in those passes. Both
    hold for proposers whose shorter drafts are prefixes of their longer ones (both built-in ones).

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


# ---------------------------------------------------------------------------------------------
# Theory: tokens per pass and speedup (Leviathan et al. 2023, Sec. 3.1-3.4)


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    """E[tokens emitted per target pass] = (1 - alpha^(gamma+1)) / (1 - alpha) for i.i.d.
    acceptances with probability alpha (Leviathan et al. 2023, Eq. 1); gamma + 1 when alpha = 1."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected walltime improvement (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)), with c the
    draft's cost per token relative to a target decode step (Leviathan et al. 2023, Theorem 3.8).
    It assumes that verifying gamma + 1 tokens costs one decode step and that every pass drafts gamma."""
    return expected_tokens_per_pass(alpha, gamma) / (gamma * c + 1)


def predicted_speedup(stats: SpeculativeStats, verify_cost: dict[int, float], draft_cost: float = 0.0) -> dict:
    """Speedup over plain decoding predicted from measured quantities, pass by pass.

    Cost of pass i in decode steps: verify_cost[1 + k_i] / verify_cost[1] + draft_cost * k_i, with
    k_i the tokens drafted in that pass (prompt lookup often drafts 0). Tokens of pass i: either the
    measured tokens it emitted (a_i + 1, fewer in a pass where generation stopped), or (i.i.d. model)
    ``expected_tokens_per_pass(alpha, k_i)``.

    Args:
        stats: one run's ``SpeculativeStats``.
        verify_cost: {k: seconds of one target forward over k tokens} for k = 1 .. max k + 1
            (``measurements.measure_verify``); k = 1 is a decode step.
        draft_cost: c, seconds of one draft token / seconds of one target decode step (0 for n-gram).

    Returns:
        dict: cost_per_pass (decode steps), tokens_per_pass (measured), tokens_per_pass_alpha,
        predicted_speedup (measured tokens / cost), predicted_speedup_alpha.

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
    return {"cost_per_pass": cost, "tokens_per_pass": tokens, "tokens_per_pass_alpha": tokens_alpha,
            "predicted_speedup": tokens / cost, "predicted_speedup_alpha": tokens_alpha / cost}
