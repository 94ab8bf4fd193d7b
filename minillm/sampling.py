"""Sampling: from logits to the next token (greedy, temperature, top-k, top-p).

``logits_to_probs`` is the one place where logits become the distribution a token is drawn from;
speculative decoding reuses it so that draft_probs and target_probs get the same processing.
Top-p is Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", Sec. 3.1. The parameters
(``SamplingParams``) live in ``sampling_params.py``.
"""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams


def check_logits(logits: torch.Tensor) -> torch.Tensor:
    """Return ``logits`` (B, V) if a distribution can be made from them; else raise ValueError (NaN or +inf,
    or a row that is all -inf). Every sampling path goes through it, greedy included."""
    if (torch.isnan(logits) | (logits == float("inf"))).any() or (logits == float("-inf")).all(-1).any():
        raise ValueError("logits: contain NaN or a row that is all -inf, so there is no distribution to sample "
                         "from (or +inf); the model's forward overflowed (try --dtype float32) or its weights "
                         "are corrupt")
    return logits


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from.

    Args:
        logits: (B, V) (any float dtype; computed in float32).
        params: temperature / top_k / top_p. Greedy gives a one-hot on the argmax.

    Returns:
        (B, V) float32 probabilities summing to 1 per row; tokens outside top-k / top-p get 0.

    Raises:
        ValueError: the logits hold NaN or +inf (or every logit of a row is -inf), so no distribution
            exists; this is the one check every sampling path (plain, batch, speculative) goes through.
    """
    logits = check_logits(logits.float())
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # subtract the max first: a tiny temperature then gives 0 and -inf (a one-hot), never inf - inf
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # drop a token when the tokens ranked above it already reach top_p; the most likely token always
        # stays (a top_p below float32's resolution would otherwise drop every token)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row: argmax if greedy, else a draw from ``logits_to_probs``.

    logits: (B, V). Returns (B,) int64.
    """
    if params.greedy:
        return check_logits(logits).argmax(-1)  # no one-hot to build for a decode step
    probs = logits_to_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator seeded with ``params.seed`` (or a random seed when it is None)."""
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g
