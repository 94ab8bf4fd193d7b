"""Proposers: anything with ``propose(tokens, gamma, params, generator) -> (draft ids, draft_probs)``.
Prompt lookup (n-gram matches in the text so far; Saxena 2023) drafts for free; a draft model (a
smaller model sharing the tokenizer, ``minillm.speculative.draft``) samples its drafts.
"""

from __future__ import annotations

import torch

from ..kv_cache import KVCache
from ..sampling import logits_to_probs
from ..sampling_params import SamplingParams
from .rejection import draw


class NgramProposer:
    """Prompt lookup decoding (Saxena 2023): find the latest earlier occurrence of the last n tokens
    (n = max_n .. min_n) and propose the tokens that followed it. Deterministic: one-hot draft_probs.

    min_n = 1 by default: a one-token match drafts on almost every pass and is often wrong, so it
    pays only where a wrong draft costs the target little, as here, where ``minillm.linear.Linear``
    verifies several tokens for little more than one decode step (``bench spec`` prints that cost).
    Where verifying costs much more than a decode step, min_n = 2 drafts less often and less wrongly
    (docs/speculative.md compares the two)."""

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1):
        self.vocab_size, self.max_n, self.min_n = vocab_size, max_n, min_n

    def propose(self, tokens: list[int], gamma: int, params: SamplingParams, generator=None):
        draft = self.lookup(tokens, gamma)
        probs = torch.zeros(len(draft), self.vocab_size)
        probs[torch.arange(len(draft)), torch.tensor(draft, dtype=torch.long)] = 1.0
        return draft, probs

    def lookup(self, tokens: list[int], gamma: int) -> list[int]:
        """The draft alone: up to gamma tokens that followed the latest earlier match ([] if none)."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            suffix, last = tokens[-n:], tokens[-1]
            for end in range(len(tokens) - 2, n - 2, -1):  # a cheap test of the match's last token first
                if tokens[end] == last and tokens[end - n + 1:end + 1] == suffix:
                    return tokens[end + 1:end + 1 + gamma]
        return []


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
