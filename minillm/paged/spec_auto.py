"""``num_speculative_tokens="auto"``: each step's draft lengths from the step's cost and each sequence's
acceptance rate.

A draft at position j of a sequence whose drafts are accepted with probability alpha adds alpha^j expected
tokens (Leviathan et al. 2023, Sec. 3). A step of N tokens costs c(N) seconds (``measure_step_cost``, then
moved by each forward as run); with m drafts it emits E0 plus their gains and costs c(N + m) plus the draft
model's forwards, one per depth. Gains fall along a sequence, so the best m drafts are the m largest gains
over all sequences; ``choose_draft_lengths`` takes the m that maximises expected tokens per second. At
batch 1 on a CPU c(N) is flat and drafts are nearly free; at 64 sequences only well-accepted drafts pay.
A sequence's acceptance rate starts from a prior: 1 in 2 for prompt lookup (its drafts are free, so it tries
them), and for a draft model the rate ``measure_acceptance`` finds at start, so that a draft that would pay is
tried (a sequence that never drafts never learns its rate).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time

import numpy as np
import torch

from ..generation import generate_cached
from ..sampling_params import SamplingParams


def choose_draft_lengths(alphas: list[float], most: list[int], step_tokens: int, step_cost,
                         draft_cost=None, emitted: float | None = None, first_feed: list[float] | None = None,
                         catch_up: list[float] | None = None) -> list[int]:
    """Per sequence, the number of drafts (0..most[i]) that maximises the step's expected tokens/s.

    Args:
        alphas: each sequence's acceptance rate (0..1); most: the drafts it may carry.
        step_tokens: tokens the step computes without drafts (N); step_cost: N -> seconds.
        draft_cost: n -> seconds of one draft forward over n tokens (None for prompt lookup: free).
            Draft j of every sequence that drafts that far comes from the j-th forward, so the drafts
            cost the sum over depths j of draft_cost(tokens fed at depth j): one per sequence from depth 2 on,
            and at depth 1 what the draft has not yet seen of each sequence (``first_feed``).
        emitted: tokens the step emits without drafts (default: one per sequence).
        first_feed: tokens each sequence's first draft forward feeds in steady state (default 1).
        catch_up: seconds each sequence adds to the step if it drafts (default 0): its share of a
            catch-up forward over a prompt, or a stretch the draft sat out.
    Returns: the draft length of each sequence.
    """
    base = float(len(alphas) if emitted is None else emitted)
    # every candidate draft token, best first: (gain alpha^j, sequence, depth j); a merge of falling sequences
    gains = heapq.merge(*[[(a ** j, i, j) for j in range(1, m + 1)] for i, (a, m) in enumerate(zip(alphas, most))],
                        key=lambda g: -g[0])
    best, best_m, total, order = base / step_cost(step_tokens), 0, base, []
    at_depth, drafting = {}, 0.0  # tokens fed at each depth; seconds of the draft forwards
    for m, (gain, i, j) in enumerate(gains, start=1):
        total += gain
        order.append(i)
        if draft_cost is not None:
            n, fed = at_depth.get(j, 0), first_feed[i] if first_feed is not None and j == 1 else 1
            drafting += draft_cost(n + fed) - (draft_cost(n) if n else 0.0)
            drafting += catch_up[i] if catch_up is not None and j == 1 else 0.0
            at_depth[j] = n + fed
        rate = total / (step_cost(step_tokens + m) + drafting)
        if rate > best:
            best, best_m = rate, m
    ks = [0] * len(alphas)
    for i in order[:best_m]:
        ks[i] += 1
    return ks


class PiecewiseCost:
    """Seconds of a forward of N tokens, linear between measured points (and beyond the last, never falling);
    ``observe`` folds in the forwards the engine runs, so that the costs follow the machine's load. A point the
    engine has not run near yet takes the level (as run / at start) of the points it has, interpolated in log N
    (the start's points are the fastest of a few forwards, a step as run is slower: drafts priced at the start's
    level would look cheap)."""

    def __init__(self, points: list[tuple[int, float]]):
        self.measured = sorted(points)  # the start's (N, seconds)
        self.level: dict[int, float] = {}  # a point run near -> its seconds as run / at start
        self.points = self.measured  # the curve in use

    def observe(self, n: int, seconds: float, weight: float = 0.2) -> None:
        """A forward of n tokens took ``seconds``: the level of the nearest measured point (in log n) moves
        towards it by ``weight``, scaled from n to that point along the measured curve (set to it the first
        time, so that the run's level replaces the start's at once; one slow forward then weighs until the next)."""
        near, at_start = min(self.measured, key=lambda p: abs(math.log(p[0] / n)))
        ratio = seconds * self._at(near, self.measured) / self._at(n, self.measured) / at_start
        self.level[near] = (1 - weight) * self.level[near] + weight * ratio if near in self.level else ratio
        seen = sorted(self.level)
        levels = np.interp([math.log(m) for m, _ in self.measured], [math.log(m) for m in seen],
                           [self.level[m] for m in seen])
        # never falling with the tokens: levels differ between points (a prefill's against a decode step's), and a
        # cost that fell would make drafts look cheaper than free
        costs = itertools.accumulate((c * float(x) for (_, c), x in zip(self.measured, levels)), max)
        self.points = list(zip([m for m, _ in self.measured], costs))

    def __call__(self, n: int) -> float:
        return self._at(n, self.points)

    @staticmethod
    def _at(n: int, pts) -> float:
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, c0), (n1, c1) in zip(pts, pts[1:]):
            if n <= n1:
                return c0 + (c1 - c0) * (n - n0) / (n1 - n0)
        # past the last point along the last slope, never falling: two close points (a short context) can time
        # in the wrong order, and a cost that fell with the tokens would make long drafts look free
        (n0, c0), (n1, c1) = pts[-2], pts[-1]
        return c1 + max(0.0, c1 - c0) * (n - n1) / max(1, n1 - n0)


@torch.inference_mode()
def measure_step_cost(model, max_tokens: int, repeats: int = 3, every_logit: bool = True) -> PiecewiseCost:
    """c(N): the fastest of ``repeats`` forwards of N tokens, at N = 1, 2, 4, ... up to ``max_tokens`` or the
    model's context if shorter (the curve extrapolates past it); about a second for SmolLM2. Logits at every
    token, as a verifying step computes them, or (``every_logit=False``) at the last only, as a draft forward
    computes one per sequence: the output layer is a fifth of SmolLM2's weights."""
    max_tokens = min(max_tokens, model.config.max_seq_len)
    sizes = sorted({1 << i for i in range(max(1, max_tokens).bit_length())} | {max(1, max_tokens)})
    points = []
    for n in sizes:
        tokens = torch.zeros((1, n), dtype=torch.long, device=model.device)
        pos = torch.arange(n, device=model.device)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(tokens, pos, logits_indices=None if every_logit else torch.tensor([n - 1], device=model.device))
            best = min(best, time.perf_counter() - t0)
        points.append((n, best))
    return PiecewiseCost(points if len(points) > 1 else points + [(points[0][0] + 1, points[0][1])])


@torch.inference_mode()
def measure_acceptance(draft, target, prompt: list[int], n: int = 32) -> float | None:
    """A draft model's acceptance rate, measured once at start: the draft continues ``prompt`` greedily for n
    tokens, the target reads them in one forward, and the share of those tokens that equal the target's argmax
    is returned (greedy verification's alpha along text the draft writes, as it drafts). A prior only: each
    sequence's own acceptance replaces it as its drafts are verified. None where there is nothing to measure on:
    an empty prompt, ids outside either vocabulary, or no room for a token after the prompt in either context."""
    vocab = min(draft.config.vocab_size, target.config.vocab_size)
    n = min(n, draft.config.max_seq_len - len(prompt), target.config.max_seq_len - len(prompt))
    if not prompt or n < 1 or not all(0 <= t < vocab for t in prompt):
        return None
    out = generate_cached(draft, prompt, SamplingParams(max_tokens=n, ignore_eos=True), max_seq_len=len(prompt) + n)
    ids = list(prompt) + out.tokens
    logits = target(torch.tensor([ids], device=target.device), torch.arange(len(ids), device=target.device),
                    logits_indices=torch.arange(len(prompt) - 1, len(ids) - 1, device=target.device))
    return (logits.reshape(-1, logits.shape[-1]).argmax(-1).cpu() == torch.tensor(out.tokens)).float().mean().item()
