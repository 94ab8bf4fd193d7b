"""Small analyses of speculative decoding runs for notebook 04 and its appendix: how often each draft
position was reached and accepted, the acceptance rate a draft needs for a target speedup, and the
tokens per pass that prompt lookup reaches over a grid of settings when a greedy answer is replayed.
"""

from __future__ import annotations

from ..sampling_params import SamplingParams
from .decode import replay_greedy
from .proposers import NgramProposer
from .rejection import expected_tokens_per_pass


def acceptance_counts(drafted: list[int], accepted: list[int]) -> tuple[list[int], list[int]]:
    """Per draft position j = 1 .. max k: how many passes tested draft j (it was drafted and drafts
    1..j-1 were accepted) and how many of those accepted it. Their ratio is
    ``SpeculativeStats.acceptance_by_position``; the counts say how much each rate rests on.

    Args:
        drafted, accepted: per target pass, the drafts proposed (k) and accepted (a <= k).

    Returns:
        (reached, accepted_at): two lists of max(drafted) ints.

    Raises:
        ValueError: lists of different lengths, or a pass that accepts more than it drafted.
    """
    if len(drafted) != len(accepted):
        raise ValueError(f"drafted ({len(drafted)} passes) and accepted ({len(accepted)}) must have one entry per pass")
    width = max(drafted, default=0)
    reached, ok = [0] * width, [0] * width
    for k, a in zip(drafted, accepted):
        if not 0 <= a <= k:
            raise ValueError(f"a pass accepted {a} of {k} drafts; accepted must lie in 0..drafted")
        for j in range(min(a + 1, k)):  # drafts past the first rejection are never tested
            reached[j] += 1
            ok[j] += j < a
    return reached, ok


def alpha_for_speedup(speedup: float, gamma: int, c: float, verify_ratio: float) -> float | None:
    """The smallest per-token acceptance rate alpha at which gamma drafts per pass reach ``speedup``
    over plain decoding, under Leviathan et al.'s i.i.d. model (2023, Eq. 1) with the verify cost
    measured: (1 - alpha^(gamma+1)) / (1 - alpha) tokens per pass for gamma c + verify_ratio decode
    steps per pass.

    Args:
        speedup: the speedup wanted (x, > 0).
        gamma: drafts per pass (>= 1).
        c: one draft token's cost in target decode steps.
        verify_ratio: verify(gamma + 1) / verify(1), the target forward over gamma + 1 tokens in decode steps.

    Returns:
        alpha in [0, 1] (to 1e-9), or None when even alpha = 1 falls short (gamma + 1 tokens per pass
        cannot pay for the pass).

    Raises:
        ValueError: gamma < 1, or a non-positive speedup or cost.
    """
    if gamma < 1:
        raise ValueError(f"gamma: must be >= 1, got {gamma}")
    if speedup <= 0 or verify_ratio <= 0 or c < 0:
        raise ValueError(f"speedup and verify_ratio must be > 0 and c >= 0, got {speedup}, {verify_ratio}, {c}")
    need = speedup * (gamma * c + verify_ratio)  # tokens per pass
    if need > gamma + 1:
        return None
    lo, hi = 0.0, 1.0  # expected_tokens_per_pass grows with alpha from 1 to gamma + 1
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_pass(mid, gamma) < need else (lo, mid)
    return hi if need > 1 else 0.0


def replay_grid(prompt_tokens: list[int], answer: list[int], vocab_size: int, gammas, min_ns=(1, 2, 3),
                max_n: int = 3) -> dict[int, dict[int, float]]:
    """Tokens per target pass that prompt lookup (``NgramProposer``) reaches on a known greedy answer,
    for every shortest match min_n and gamma, from ``replay_greedy`` (no target forward is run).

    Returns:
        {min_n: {gamma: tokens per target pass}}.

    Raises:
        ValueError: a min_n outside 1..max_n, or the errors of ``replay_greedy``.
    """
    if any(not 1 <= n <= max_n for n in min_ns):
        raise ValueError(f"min_ns: each must lie in 1..max_n = {max_n}, got {list(min_ns)}")
    return {n: {g: replay_greedy(NgramProposer(vocab_size, max_n=max_n, min_n=n), prompt_tokens, answer,
                                 SamplingParams(), num_speculative_tokens=g).tokens_per_target_pass
                for g in gammas}
            for n in min_ns}
