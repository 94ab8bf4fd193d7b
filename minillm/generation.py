"""Autoregressive generation, two ways with one signature.

* ``generate_naive``: every step runs the model over the whole sequence so far (no cache). Step t
  processes t tokens, so N new tokens after a P-token prompt cost sum(P..P+N-1) token-forwards:
  quadratic in length.
* ``generate_cached``: **prefill** runs the prompt once and fills a preallocated KV cache; each
  **decode** step then runs one token and reads the cached keys/values: linear in length.

At temperature 0 both produce the same tokens (tested against each other and transformers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .kv_cache import KVCache
from .sampling import SamplingParams, make_generator, sample


@dataclass
class GenerationResult:
    """What a generation produced and how long it took.

    Fields:
        prompt_tokens: the prompt's ids.
        tokens: the new ids (the stop token included; a stop string's tokens included).
        text: decoded new text, cut before a stop string ("" without a tokenizer).
        finish_reason: "eos", "stop" (a stop string), "length" (max_new_tokens or the context).
        prefill_s: seconds from the start to the first new token (prefill + its sampling).
        decode_s: seconds for the remaining tokens.
        step_s: seconds per new token, the first one being the prefill.
    """

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    step_s: list[float] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first (the prefill's) token; 0 when there is only one."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_prompt(model, prompt_tokens: list[int], max_seq_len: int | None) -> int:
    """Validate the prompt against the context; returns the context length to use.

    Raises:
        ValueError: empty prompt, ids outside the vocabulary, or a prompt that leaves no room
            for one new token.
    """
    ctx = model.config.max_seq_len if max_seq_len is None else min(max_seq_len, model.config.max_seq_len)
    if len(prompt_tokens) == 0:
        raise ValueError("prompt: is empty; give at least one token")
    if min(prompt_tokens) < 0 or max(prompt_tokens) >= model.config.vocab_size:
        raise ValueError(f"prompt: token ids must be in [0, {model.config.vocab_size})")
    if len(prompt_tokens) >= ctx:
        raise ValueError(
            f"prompt: {len(prompt_tokens)} tokens do not fit the context of {ctx} tokens (max_seq_len) with room "
            "for a new token; shorten the prompt or raise max_seq_len"
        )
    return ctx


@torch.inference_mode()
def prefill(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Run the prompt (B, T) from position 0 through the model, filling ``cache``.
    Returns the last position's logits (B, V) float32."""
    input_pos = torch.arange(tokens.shape[1], device=tokens.device)
    return model(tokens, input_pos, cache)[:, -1]


@torch.inference_mode()
def decode_step(model, token: torch.Tensor, pos: int, cache) -> torch.Tensor:
    """One decode step: token (B, 1) at position ``pos``; returns logits (B, V) float32."""
    input_pos = torch.tensor([pos], device=token.device)
    return model(token, input_pos, cache)[:, -1]


class _Stopper:
    """Tracks EOS and stop strings for one sequence."""

    def __init__(self, params: SamplingParams, tokenizer, eos_ids: set[int]):
        if params.stop and tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; pass tokenizer=")
        self.params, self.tokenizer, self.eos_ids = params, tokenizer, eos_ids

    def check(self, result: GenerationResult) -> bool:
        tok = result.tokens[-1]
        if not self.params.ignore_eos and tok in self.eos_ids:
            result.finish_reason = "eos"
            return True
        if self.params.stop:
            text = self.tokenizer.decode(result.tokens)
            hits = [text.find(s) for s in self.params.stop if s in text]
            if hits:
                result.finish_reason = "stop"
                result.text = text[: min(hits)]
                return True
        return False


def _finish(result: GenerationResult, tokenizer) -> GenerationResult:
    if tokenizer is not None and result.finish_reason != "stop":
        ids = result.tokens[:-1] if result.finish_reason == "eos" else result.tokens
        result.text = tokenizer.decode(ids)
    return result


def _generate(model, prompt_tokens, params, *, use_cache, max_seq_len, tokenizer, on_token, eos_ids):
    ctx = check_prompt(model, prompt_tokens, max_seq_len)
    device = model.device
    eos = set(eos_ids) if eos_ids is not None else ({tokenizer.eos_id} if tokenizer and tokenizer.eos_id is not None else set())
    stopper = _Stopper(params, tokenizer, eos)
    gen = make_generator(params, device)
    result = GenerationResult(prompt_tokens=list(prompt_tokens))
    seq = torch.tensor([prompt_tokens], device=device)  # (1, P)
    cache = KVCache(model.config, 1, ctx, model.dtype, device) if use_cache else None
    n_new = min(params.max_new_tokens, ctx - len(prompt_tokens))

    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = prefill(model, seq, cache)
        for step in range(n_new):
            token = sample(logits, params, gen)  # (1,)
            result.tokens.append(int(token))
            _sync(device)
            t1 = time.perf_counter()
            result.step_s.append(t1 - t0)
            t0 = t1
            if on_token is not None:
                on_token(result.tokens[-1])
            if stopper.check(result) or step == n_new - 1:
                break
            pos = len(prompt_tokens) + step
            if use_cache:
                logits = decode_step(model, token[:, None], pos, cache)
            else:
                seq = torch.cat([seq, token[:, None]], dim=1)  # (1, pos + 1): recompute it all
                logits = model(seq, torch.arange(seq.shape[1], device=device), None)[:, -1]
    result.prefill_s = result.step_s[0]
    result.decode_s = sum(result.step_s[1:])
    return _finish(result, tokenizer)


def generate_naive(model, prompt_tokens: list[int], params: SamplingParams = SamplingParams(), *,
                   max_seq_len: int | None = None, tokenizer=None,
                   on_token: Callable[[int], None] | None = None,
                   eos_ids: set[int] | None = None) -> GenerationResult:
    """Generate by recomputing the whole sequence every step (the baseline; no KV cache).

    Args:
        model: a ``minillm.model.Decoder``.
        prompt_tokens: the prompt's ids, at least one.
        params: sampling and stopping (``SamplingParams``).
        max_seq_len: context to use (default and maximum: the model's); generation stops when full.
        tokenizer: needed for stop strings and ``text``; its eos_id stops generation.
        on_token: called with each new id as soon as it is chosen (streaming).
        eos_ids: ids that end generation (default: the tokenizer's eos_id).

    Returns:
        ``GenerationResult``.

    Raises:
        ValueError: empty prompt, a prompt that does not fit the context, stop strings without a
            tokenizer (invalid sampling values are rejected by ``SamplingParams``).
    """
    return _generate(model, prompt_tokens, params, use_cache=False, max_seq_len=max_seq_len,
                     tokenizer=tokenizer, on_token=on_token, eos_ids=eos_ids)


def generate_cached(model, prompt_tokens: list[int], params: SamplingParams = SamplingParams(), *,
                    max_seq_len: int | None = None, tokenizer=None,
                    on_token: Callable[[int], None] | None = None,
                    eos_ids: set[int] | None = None) -> GenerationResult:
    """Generate with a contiguous KV cache: prefill once, then one token per decode step.

    Same signature, arguments, result and errors as ``generate_naive``; the cache holds
    ``max_seq_len`` positions (default: the model's context).
    """
    return _generate(model, prompt_tokens, params, use_cache=True, max_seq_len=max_seq_len,
                     tokenizer=tokenizer, on_token=on_token, eos_ids=eos_ids)


GENERATORS = {"none": generate_naive, "contiguous": generate_cached}


def generate(model, prompt_tokens, params=SamplingParams(), *, cache: str = "contiguous", **kwargs) -> GenerationResult:
    """``generate_naive`` (cache="none") or ``generate_cached`` (cache="contiguous").

    Raises:
        ValueError: an unknown cache name.
    """
    if cache not in GENERATORS:
        raise ValueError(f"cache: {cache!r} is not one of {list(GENERATORS)}")
    return GENERATORS[cache](model, prompt_tokens, params, **kwargs)
