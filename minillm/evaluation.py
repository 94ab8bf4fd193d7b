"""Perplexity: how well a model (or a model with a lossy KV cache or quantized weights) predicts
held-out text.

``perplexity = exp(mean negative log-likelihood)`` over non-overlapping windows of ``seqlen``
tokens (each window starts a fresh context, as in the GPTQ paper's WikiText-2 protocol); the first
token of each window is only context. KL divergence compares next-token distributions with a
reference model's on the same windows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def windows(tokens: list[int], seqlen: int, max_tokens: int | None = None) -> list[torch.Tensor]:
    """Split ``tokens`` (truncated to ``max_tokens``) into full windows of ``seqlen``.

    Raises:
        ValueError: seqlen < 2, or fewer than ``seqlen`` tokens.
    """
    if seqlen < 2:
        raise ValueError(f"seqlen: must be >= 2, got {seqlen}")
    tokens = tokens[:max_tokens] if max_tokens else tokens
    n = len(tokens) // seqlen
    if n == 0:
        raise ValueError(f"seqlen: the text has {len(tokens)} tokens, fewer than one window of {seqlen}")
    return [torch.tensor(tokens[i * seqlen:(i + 1) * seqlen]) for i in range(n)]


@torch.inference_mode()
def perplexity(model, tokens: list[int], seqlen: int = 512, max_tokens: int | None = None, make_cache=None,
               progress: bool = False) -> dict:
    """Perplexity of ``model`` on ``tokens``.

    Args:
        model: a ``Decoder``.
        tokens: the text's ids.
        seqlen: window length in tokens (no overlap, stride = seqlen).
        max_tokens: use at most this many tokens.
        make_cache: None (no cache) or a function ``() -> cache`` (e.g. an ``Int8KVCache``): each
            window is then run through that cache, so attention reads what the cache stored.
        progress: show a progress bar.

    Returns:
        {"perplexity", "nll" (mean, nats/token), "tokens" (scored), "seqlen", "windows"}.
    """
    from tqdm.auto import tqdm

    device = model.device
    total, count = 0.0, 0
    ws = windows(tokens, seqlen, max_tokens)
    for w in tqdm(ws, desc="perplexity", disable=not progress, leave=False):
        w = w.to(device)[None]  # (1, seqlen)
        logits = model(w, torch.arange(seqlen, device=device), make_cache() if make_cache else None)
        total += F.cross_entropy(logits[0, :-1], w[0, 1:], reduction="sum").item()
        count += seqlen - 1
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count, "seqlen": seqlen,
            "windows": len(ws)}
