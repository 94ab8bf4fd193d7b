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


def windows(tokens: list[int], seqlen: int, max_tokens: int | None = None,
            context: int | None = None) -> list[torch.Tensor]:
    """Split ``tokens`` (truncated to ``max_tokens``) into full windows of ``seqlen``.

    Raises:
        ValueError: seqlen < 2 or longer than the model's ``context``, or fewer than ``seqlen`` tokens.
    """
    if seqlen < 2:
        raise ValueError(f"seqlen: must be >= 2, got {seqlen}")
    tokens = tokens[:max_tokens] if max_tokens else tokens
    n = len(tokens) // seqlen
    if n == 0:
        raise ValueError(f"seqlen: the text has {len(tokens)} tokens, fewer than one window of {seqlen}")
    if context is not None and seqlen > context:
        raise ValueError(f"seqlen: windows of {seqlen} tokens do not fit the model's context of {context} tokens; "
                         f"use a seqlen of {context} or less")
    return [torch.tensor(tokens[i * seqlen:(i + 1) * seqlen]) for i in range(n)]


@torch.inference_mode()
def reference_logprobs(model, tokens: list[int], seqlen: int = 512, max_tokens: int | None = None,
                       progress: bool = False) -> list[torch.Tensor]:
    """The reference model's next-token log-probabilities on every window, for ``perplexity(...,
    reference=...)``: a list of (seqlen - 1, V) float32 tensors (4,096 tokens of a 49,152-token
    vocabulary take 800 MB; float16 would bias small KL values by ~1e-3 nats)."""
    from tqdm.auto import tqdm

    out = []
    for w in tqdm(windows(tokens, seqlen, max_tokens, model.config.max_seq_len), desc="reference", disable=not progress, leave=False):
        w = w.to(model.device)[None]
        logits = model(w, torch.arange(seqlen, device=model.device))[0, :-1]
        out.append(F.log_softmax(logits.float(), dim=-1).cpu())
    return out


@torch.inference_mode()
def perplexity(model, tokens: list[int], seqlen: int = 512, max_tokens: int | None = None, make_cache=None,
               progress: bool = False, reference: list[torch.Tensor] | None = None) -> dict:
    """Perplexity of ``model`` on ``tokens``.

    Args:
        model: a ``Decoder``.
        tokens: the text's ids.
        seqlen: window length in tokens (no overlap, stride = seqlen).
        max_tokens: use at most this many tokens.
        make_cache: None (no cache) or a function ``() -> cache`` (e.g. an ``Int8KVCache``): each
            window is then run through that cache, so attention reads what the cache stored.
        progress: show a progress bar.
        reference: ``reference_logprobs`` of another model (e.g. the float model) on the same tokens,
            seqlen and max_tokens: adds the mean KL divergence KL(reference || model) in nats/token
            and the share of positions where both pick the same top-1 token.

    Returns:
        {"perplexity", "nll" (mean, nats/token), "tokens" (predictions scored: seqlen - 1 per window,
        whose first token is only context), "seqlen", "windows", "text_tokens" (the text's length),
        "tokens_in_windows" (the tokens read: whole windows of the first ``max_tokens``)} and, with a
        reference, "kl" and "top1_agreement".

    Raises:
        ValueError: see ``windows``; a reference computed on other windows.
    """
    from tqdm.auto import tqdm

    device = model.device
    total, count, kl, agree = 0.0, 0, 0.0, 0
    ws = windows(tokens, seqlen, max_tokens, model.config.max_seq_len)
    if reference is not None and (len(reference) != len(ws) or reference[0].shape[0] != seqlen - 1):
        raise ValueError("reference: computed on other windows; call reference_logprobs with the same tokens, "
                         "seqlen and max_tokens")
    for k, w in enumerate(tqdm(ws, desc="perplexity", disable=not progress, leave=False)):
        w = w.to(device)[None]  # (1, seqlen)
        logits = model(w, torch.arange(seqlen, device=device), make_cache() if make_cache else None)[0, :-1]
        total += F.cross_entropy(logits, w[0, 1:], reduction="sum").item()
        count += seqlen - 1
        if reference is not None:
            logq = F.log_softmax(logits.float(), dim=-1)  # (T - 1, V)
            logp = reference[k].to(device)
            kl += (logp.exp() * (logp - logq)).sum().item()
            agree += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
    out = {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count, "seqlen": seqlen,
           "windows": len(ws), "text_tokens": len(tokens), "tokens_in_windows": len(ws) * seqlen}
    if reference is not None:
        out.update(kl=kl / count, top1_agreement=agree / count)
    return out
