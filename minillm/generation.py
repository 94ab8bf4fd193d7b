"""Autoregressive generation: three decode paths with one signature, and batched generation.

* ``generate_naive``: every step runs the model over the whole sequence so far (no cache). Step t
  processes t tokens, so N new tokens after a P-token prompt cost sum(P..P+N-1) token-forwards:
  quadratic in length.
* ``generate_dynamic``: a cache grown by concatenation (copies the cache every step).
* ``generate_cached``: **prefill** runs the prompt once and fills a preallocated KV cache; each
  **decode** step then runs one token and reads the cached keys/values: linear in length.
  ``kv_dtype="int8"`` stores that cache in int8.
* ``generate_batch``: several prompts of different lengths at once (left padding).

At temperature 0 all paths produce the same tokens (tested against each other and transformers).
"""

from __future__ import annotations

import numbers
import time
from typing import Callable

import torch

from .kv_cache import make_cache
from .stops import GenerationResult, Stopper, check_prompt, check_token_ids, finish, stop_ids
from .sampling import make_generator, sample
from .sampling_params import SamplingParams
from .timing import synchronize


def prefill(model, tokens: torch.Tensor, cache, pad_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Run the prompt (B, T) from position 0 through the model, filling ``cache`` (None: no cache).
    ``pad_lengths`` (B,): left padding per row (see ``Decoder.forward``).
    Returns the last position's logits (B, V) float32."""
    input_pos = torch.arange(tokens.shape[1], device=tokens.device)
    return model(tokens, input_pos, cache, pad_lengths)[:, -1]


@torch.inference_mode()
def decode_step(model, token: torch.Tensor, pos: int, cache, pad_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step: token (B, 1) at slot ``pos``; returns logits (B, V) float32."""
    input_pos = torch.tensor([pos], device=token.device)
    return model(token, input_pos, cache, pad_lengths)[:, -1]


def run_batch(model, prompts, params, *, cache_kind, kv_dtype=None, max_seq_len, tokenizer, on_token, eos_ids,
         cache_factory=None):
    """Generate for a batch of prompts (left padded when their lengths differ). ``cache_factory(config,
    batch_size, max_seq_len, dtype, device)``, when given, builds the cache instead of ``make_cache``
    (``minillm.paged.generate_paged`` passes a ``PagedKVCache``)."""
    if not isinstance(prompts, (list, tuple)) or any(isinstance(p, numbers.Integral) for p in prompts):
        got = type(prompts).__name__ if not isinstance(prompts, (list, tuple)) else "a list of ints"
        raise ValueError(f"prompts: must be a list of prompts, each a list of int token ids; got {got} "
                         "(pass a tensor as tensor.tolist(), one prompt as [ids])")
    if not prompts:
        raise ValueError("prompts: give at least one prompt")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params: must be a SamplingParams, got {type(params).__name__}")
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)):
        raise ValueError(f"max_seq_len: must be an int or None, got {max_seq_len!r}")
    ctx = max(check_prompt(model, p, max_seq_len) for p in prompts)
    check_token_ids("stop_token_ids", list(params.stop_token_ids), model.config.vocab_size)  # else it never fires
    device = model.device
    stopper = Stopper(params, tokenizer, stop_ids(tokenizer, eos_ids))
    gen = make_generator(params, device)
    results = [GenerationResult(prompt_tokens=list(p)) for p in prompts]
    P = max(len(p) for p in prompts)
    offsets = [P - len(p) for p in prompts]
    # (B, P): row b is offsets[b] padding tokens (id 0, never attended to) then its prompt
    seq = torch.tensor([[0] * o + list(p) for o, p in zip(offsets, prompts)], device=device)
    pad_lengths = torch.tensor(offsets, device=device) if any(offsets) else None
    if cache_factory is not None:
        cache = cache_factory(model.config, len(prompts), ctx, model.dtype, device)
    else:
        cache = make_cache(cache_kind, model.config, len(prompts), ctx, model.dtype, device, kv_dtype)  # None: "none"
    n_new = min(params.max_new_tokens, ctx - P)
    done = [False] * len(prompts)

    synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = prefill(model, seq, cache, pad_lengths)
        for step in range(n_new):
            tokens = sample(logits, params, gen)  # (B,)
            synchronize(device)
            t1 = time.perf_counter()
            for b, r in enumerate(results):
                if not done[b]:
                    done[b] = stopper.emit(r, int(tokens[b]), t1 - t0, on_token)
            t0 = t1
            if all(done) or step == n_new - 1:
                break
            slot = P + step
            if cache is not None:
                logits = decode_step(model, tokens[:, None], slot, cache, pad_lengths)
            else:
                seq = torch.cat([seq, tokens[:, None]], dim=1)  # (B, slot + 1): recompute it all
                logits = prefill(model, seq, None, pad_lengths)
    return [finish(r, tokenizer) for r in results]


def _generate(model, prompt_tokens, params, *, max_seq_len=None, tokenizer=None, on_token=None, eos_ids=None,
              **kwargs):
    return run_batch(model, [prompt_tokens], params, max_seq_len=max_seq_len, tokenizer=tokenizer, on_token=on_token,
                eos_ids=eos_ids, **kwargs)[0]


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
        eos_ids: ids that end generation (default: the tokenizer's eos_id); ``params.stop_token_ids``
            end it too, even with ``ignore_eos`` (``Stopper``).

    Returns:
        ``GenerationResult``.

    Raises:
        ValueError: empty prompt, a prompt that does not fit the context, stop strings without a
            tokenizer, stop_token_ids outside the vocabulary (invalid sampling values are rejected by
            ``SamplingParams``).
    """
    return _generate(model, prompt_tokens, params, cache_kind="none", max_seq_len=max_seq_len,
                     tokenizer=tokenizer, on_token=on_token, eos_ids=eos_ids)


def generate_cached(model, prompt_tokens: list[int], params: SamplingParams = SamplingParams(), *,
                    max_seq_len: int | None = None, tokenizer=None,
                    on_token: Callable[[int], None] | None = None,
                    eos_ids: set[int] | None = None, kv_dtype: str | None = None) -> GenerationResult:
    """Generate with a contiguous, preallocated KV cache (``KVCache``): prefill once, then one token
    per decode step.

    Same signature, arguments, result and errors as ``generate_naive``; the cache holds
    ``max_seq_len`` positions (default: the model's context). ``kv_dtype="int8"`` stores it in int8.
    """
    return _generate(model, prompt_tokens, params, cache_kind="contiguous", kv_dtype=kv_dtype,
                     max_seq_len=max_seq_len, tokenizer=tokenizer, on_token=on_token, eos_ids=eos_ids)


def generate_dynamic(model, prompt_tokens: list[int], params: SamplingParams = SamplingParams(), *,
                     max_seq_len: int | None = None, tokenizer=None,
                     on_token: Callable[[int], None] | None = None,
                     eos_ids: set[int] | None = None) -> GenerationResult:
    """Generate with a cache that grows by concatenation (``DynamicKVCache``, like Hugging Face's
    ``DynamicCache``). Same signature, arguments, result and errors as ``generate_naive``."""
    return _generate(model, prompt_tokens, params, cache_kind="dynamic", max_seq_len=max_seq_len,
                     tokenizer=tokenizer, on_token=on_token, eos_ids=eos_ids)


def generate(model, prompt_tokens, params=SamplingParams(), *, cache: str = "contiguous", kv_dtype: str | None = None,
             **kwargs) -> GenerationResult:
    """``generate_naive`` (cache="none"), ``generate_dynamic`` ("dynamic") or ``generate_cached``
    ("contiguous", optionally with ``kv_dtype="int8"``); other arguments as theirs.

    Raises:
        ValueError: as ``generate_naive``, and (from ``kv_cache.make_cache``) an unknown cache name or
            int8 with another cache than "contiguous".
    """
    return _generate(model, prompt_tokens, params, cache_kind=cache, kv_dtype=kv_dtype, **kwargs)


def generate_batch(model, prompts: list[list[int]], params: SamplingParams = SamplingParams(), *,
                   cache: str = "contiguous", kv_dtype: str | None = None, max_seq_len: int | None = None,
                   tokenizer=None, eos_ids: set[int] | None = None) -> list[GenerationResult]:
    """Generate for several prompts at once, one forward per step for the whole batch.

    Prompts of different lengths are left padded: row b's padding slots are never attended to and
    its tokens get positions ``slot - padding`` (``Decoder.forward``'s ``pad_lengths``), so at
    temperature 0 each row gives the tokens its prompt gives alone. Each row stops on its own.

    Args:
        prompts: B lists of token ids. Other arguments as ``generate``.

    Returns:
        B ``GenerationResult``s, in the order of ``prompts`` (prefill_s / decode_s are the batch's).

    Raises:
        ValueError: as ``generate``, for any prompt.
    """
    return run_batch(model, prompts, params, cache_kind=cache, kv_dtype=kv_dtype, max_seq_len=max_seq_len,
                tokenizer=tokenizer, on_token=None, eos_ids=eos_ids)
