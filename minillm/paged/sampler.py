"""The engine's sample step: every ready sequence's next tokens from one forward's logits, in one pass.

Greedy rows take one batched argmax; a sampled row draws from its own generator (a seeded request draws
the same tokens alone as in any batch); logprobs come from one logsumexp and one gather, and everything
reaches the host in one copy (one device sync per step). A draw that raises restores its generators.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..sampling import check_logits, make_generator, sample
from ..sampling_params import SamplingParams


@dataclass
class Draw:
    """What one ready sequence draws in a step: ``samples``, per sample, its tokens [(token id, logprob)].

    A decode draws one sample of one token; a request's first draw with n > 1 draws n samples of one token (the
    sequence forks into n); a verified run (speculative decoding) is one sample of several tokens, the accepted
    drafts and then one more, with ``drafted`` and ``accepted`` counting the drafts examined and kept; a beam
    draws nothing here (its siblings are selected together, ``beam.py``)."""

    samples: list[list[tuple[int, float]]]
    drafted: int = 0
    accepted: int = 0


def sample_generator(params: SamplingParams, k: int, device) -> torch.Generator:
    """Sample k's generator: seeded with ``params.seed`` for k = 0 (as ``generate_cached``), with a seed
    derived from (seed, k) for the others; a fresh random seed when ``params.seed`` is None."""
    if params.seed is None or k == 0:
        return make_generator(params, device)
    return make_generator(SamplingParams(seed=hash((params.seed, k)) % 2 ** 63), device)


def keyed_generator(*key: int) -> torch.Generator:
    """A CPU generator seeded by a tuple of ints (a seed, a sample, a position): the same key gives the same random
    numbers in any batch, step or process (ints only: Python salts the hash of a string per process)."""
    return torch.Generator().manual_seed(hash(key) % 2 ** 63)


@contextmanager
def restored_on_error(generators):
    """The generators as they were if the block raises, so that a retried step draws the same tokens."""
    saved = [(g, g.get_state()) for g in generators if g is not None]
    try:
        yield
    except BaseException:
        for g, state in saved:
            g.set_state(state)
        raise


def checked_lse(logits: torch.Tensor) -> torch.Tensor:
    """Each row's logsumexp (R,), which gives every logprob (logit - lse). It is finite exactly when a row has
    no NaN, no +inf and not only -inf, so it is also ``check_logits``' verdict, whose error it raises."""
    lse = torch.logsumexp(logits, dim=-1)
    if not torch.isfinite(lse).all():
        check_logits(logits)
    return lse


def draw_tokens(logits: torch.Tensor, plans: list) -> list[Draw]:
    """The tokens each row of ``logits`` (R, V) draws, with their logprobs (log-softmax of the raw logits,
    as vLLM reports them).

    Args:
        plans: per row, None (the row draws nothing: a beam, selected elsewhere) or (params, generators):
            one draw per generator; greedy params take the argmax (their generators are None).
    Returns: per row, a ``Draw`` of one token per generator (none for a None plan).
    Raises:
        ValueError: logits with NaN, +inf or a row all -inf (``check_logits``); nothing is changed.
    """
    lse = checked_lse(logits)  # (R,)
    slots = [(i, plan[0], g) for i, plan in enumerate(plans) if plan is not None for g in plan[1]]  # g None: greedy
    if not slots:
        return [Draw([]) for _ in plans]
    index = torch.tensor([i for i, _, _ in slots], device=logits.device)
    greedy = any(g is None for _, _, g in slots)
    tokens = logits.argmax(-1)[index] if greedy else index.new_empty(len(slots))  # (K,): one argmax for every row
    with restored_on_error(g for _, _, g in slots):
        for j, (i, params, g) in enumerate(slots):
            if g is not None:
                tokens[j:j + 1] = sample(logits[i:i + 1], params, g)
        chosen = logits[index, tokens].double() - lse[index].double()
        host = torch.stack([tokens.double(), chosen]).tolist()  # token ids < 2**53: exact in float64
    draws, j = [], 0
    for plan in plans:
        c = 0 if plan is None else len(plan[1])
        draws.append(Draw([[(int(t), lp)] for t, lp in zip(host[0][j:j + c], host[1][j:j + c])]))
        j += c
    return draws
