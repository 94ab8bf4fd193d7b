"""Speculative sampling's rejection step: draft token x is accepted with probability
``min(1, target_probs(x) / draft_probs(x))``; at the first rejection the replacement is drawn from the
normalised residual ``max(0, target_probs - draft_probs)``; when every draft is accepted a bonus token
is drawn from the target. The emitted tokens are distributed exactly as the target's own samples
(Leviathan, Kalman, Matias 2023, Algorithm 1 and Appendix A.1; Chen et al. 2023, Algorithm 2). We
write ``target_probs`` / ``draft_probs`` because the two papers swap the letters p and q.

Also the theory of what it buys: expected tokens per target pass and the walltime improvement
(Leviathan et al. 2023, Sec. 3.1-3.4).
"""

from __future__ import annotations

import torch


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


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    """E[tokens emitted per target pass] = (1 - alpha^(gamma+1)) / (1 - alpha) for i.i.d.
    acceptances with probability alpha (Leviathan et al. 2023, Eq. 1); gamma + 1 when alpha = 1."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected walltime improvement (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)), with c the
    draft's cost per token relative to a target decode step (Leviathan et al. 2023, Theorem 3.8).
    It assumes that verifying gamma + 1 tokens costs one decode step and that every pass drafts gamma."""
    return expected_tokens_per_pass(alpha, gamma) / (gamma * c + 1)
