"""Log-probabilities for the server: the model's own, from a forward of the model on the same tokens.

What lm-eval's loglikelihood requests and OpenAI's ``logprobs`` read: for each token, log p(token | the tokens
before it) under the model's raw logits (a log-softmax before temperature, top-k and top-p, as vLLM reports by
default), and the top-k alternatives at that position. A ``Scorer`` runs the model over a sequence in chunks
through its own contiguous KV cache (``minillm.kv_cache.KVCache``), so a stream's tokens are scored as they
arrive and a long prompt never holds more than ``CHUNK`` rows of (V,) logits. The server runs every scorer on
the engine thread, between steps (``EngineLoop.call``): one thread drives the model. The formatting functions
turn the entries into OpenAI's two shapes: legacy completions' ``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset`` and chat's ``content`` list.
"""

from __future__ import annotations

import math

import torch

from ..kv_cache import KVCache

#: the most alternatives a request may ask for per token (vLLM's default max_logprobs is 20, as OpenAI's limit)
MAX_LOGPROBS = 20
#: tokens per forward when scoring: bounds the (CHUNK, V) float32 logits a long prompt makes (49152 x 256 x 4 B
#: = 48 MiB for SmolLM2)
CHUNK = 256
#: what a log-probability of -inf is reported as (JSON has no infinity; vLLM reports the same floor)
FLOOR = -9999.0


class Scorer:
    """One sequence's log-probabilities, fed in order: ``extend(ids)`` returns an entry per token.

    Args:
        model: the ``Decoder`` the engine serves; capacity: the sequence's length at most (prompt + max_tokens),
            the size of the scorer's KV cache; top: alternatives per token (0: the chosen token's only).

    An entry is None for the sequence's first token (nothing predicts it), else (logprob, [(id, logprob), ...]) with
    the ``top`` most likely tokens, best first; the chosen token's logprob and an alternative's come from the same
    tensor, so a greedy token's logprob equals the top one exactly (lm-eval's ``is_greedy`` compares them).
    """

    def __init__(self, model, capacity: int, top: int):
        self.model, self.top = model, top
        self.cache = KVCache(model.config, 1, capacity, dtype=model.dtype, device=model.device)
        self.length = 0
        self.last: torch.Tensor | None = None  # (V,) log-probabilities of the token after the last one fed

    @torch.inference_mode()
    def extend(self, token_ids: list[int], want: bool = True) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Feed ``token_ids`` after those fed before; their entries (an empty list if not ``want``: the prompt
        of a request that does not echo only sets the state)."""
        entries = []
        for start in range(0, len(token_ids), CHUNK):
            chunk = token_ids[start:start + CHUNK]
            tokens = torch.tensor([chunk], device=self.model.device)  # (1, T)
            pos = torch.arange(self.length, self.length + len(chunk), device=self.model.device)
            logprobs = torch.log_softmax(self.model(tokens, pos, self.cache)[0].float(), dim=-1)  # (T, V)
            if want and self.last is None:  # the sequence's first token: nothing predicts it
                entries += [None] + _entries(logprobs[:-1], chunk[1:], self.top)
            elif want:  # the row predicting chunk[j] is the one after chunk[j - 1]: the previous chunk's last for j = 0
                entries += _entries(torch.cat([self.last[None], logprobs[:-1]]), chunk, self.top)
            self.last, self.length = logprobs[-1], self.length + len(chunk)
        return entries


def _entries(rows: torch.Tensor, token_ids: list[int], top: int) -> list:
    """Row i (V,) scores token_ids[i]: (its logprob, its ``top`` alternatives); one copy to the host."""
    if not token_ids:
        return []
    chosen = rows.gather(1, torch.tensor(token_ids, device=rows.device)[:, None])[:, 0]  # (T,)
    if top:
        values, ids = rows.topk(top, dim=-1)  # (T, top)
        values, ids = values.tolist(), ids.tolist()
    else:
        values = ids = [[] for _ in token_ids]
    return [(_finite(lp), [(i, _finite(v)) for i, v in zip(ii, vv)]) for lp, ii, vv in zip(chosen.tolist(), ids, values)]


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


# ---- OpenAI's shapes ----------------------------------------------------------------------------------------
def token_text(tokenizer, token_id: int) -> str:
    """A token as a string: its UTF-8 text, or vLLM's "bytes:\\xNN" spelling when its bytes do not end a character."""
    raw = token_bytes(tokenizer, token_id)
    if raw is None:  # an id past the tokenizer's vocabulary (a model's padding rows)
        return f"token_id:{token_id}"
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def token_bytes(tokenizer, token_id: int) -> bytes | None:
    try:
        return tokenizer.encoding.decode_single_token_bytes(token_id)
    except KeyError:
        return None


def completion_logprobs(tokenizer, token_ids: list[int], entries: list, top: int, text_offset: int = 0) -> dict:
    """Legacy completions' ``logprobs`` for ``token_ids`` and their entries: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (each a {token: logprob} of the chosen token and the ``top`` best, or None for a first
    token) and ``text_offset`` (characters into the choice's text, from ``text_offset``), as vLLM writes them."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        logprob, best = entry
        token_logprobs.append(logprob)
        alternatives = {text: logprob}
        for i, v in best[:top]:
            alternatives.setdefault(token_text(tokenizer, i), v)
        top_logprobs.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], entries: list, top: int) -> dict:
    """Chat's ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""
    def item(token_id: int, logprob: float) -> dict:
        raw = token_bytes(tokenizer, token_id)
        return {"token": token_text(tokenizer, token_id), "logprob": logprob,
                "bytes": None if raw is None else list(raw)}

    return {"content": [{**item(t, e[0]), "top_logprobs": [item(i, v) for i, v in e[1][:top]]}
                        for t, e in zip(token_ids, entries)]}
