"""What every generator shares, the loops of ``minillm.generation`` and the engine (``minillm.paged``) alike: the
checks of a prompt, the result of a generation, and when a sequence stops (EOS, a stop token id, a stop string)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


@dataclass
class GenerationResult:
    """What a generation produced and how long it took.

    Attributes:
        prompt_tokens: the prompt's ids.
        tokens: the new ids (the stop token included; a stop string's tokens included).
        text: decoded new text, without the stop token, cut before a stop string ("" without a tokenizer).
        finish_reason: "eos" (EOS, or an id of ``params.stop_token_ids``), "stop" (a stop string),
            "length" (max_new_tokens or the context).
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


def check_token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    """Raises ValueError (naming ``name``) unless every id is in [0, vocab_size)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"{name}: token ids must be in [0, {vocab_size})")


def check_prompt(model, prompt_tokens: list[int], max_seq_len: int | None) -> int:
    """Validate the prompt against the context; returns the context length to use.

    Raises:
        ValueError: a prompt that is not a list of int ids (a string, a tensor, floats), an empty
            prompt, ids outside the vocabulary, or a prompt that leaves no room for one new token
            (naming the model's own context when that is the limit).
    """
    if isinstance(prompt_tokens, (str, bytes)) or not isinstance(prompt_tokens, (list, tuple)):
        raise ValueError(f"prompt_tokens: must be a list of int token ids, got {type(prompt_tokens).__name__}; "
                         "encode text with tokenizer.encode(text), and pass a tensor as tensor.tolist()")
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in prompt_tokens):
        bad = next(t for t in prompt_tokens if isinstance(t, bool) or not isinstance(t, numbers.Integral))
        raise ValueError(f"prompt_tokens: token ids must be ints, got {bad!r} ({type(bad).__name__})")
    limit = model.config.max_seq_len
    ctx = limit if max_seq_len is None else min(max_seq_len, limit)
    if len(prompt_tokens) == 0:
        raise ValueError("prompt: is empty; give at least one token")
    check_token_ids("prompt", prompt_tokens, model.config.vocab_size)
    if len(prompt_tokens) >= ctx:
        if ctx == limit:
            raise ValueError(f"prompt: {len(prompt_tokens)} tokens do not fit the model's context of {limit} tokens "
                             "with room for a new token; shorten the prompt")
        raise ValueError(f"prompt: {len(prompt_tokens)} tokens do not fit the context of {ctx} tokens (max_seq_len) "
                         f"with room for a new token; shorten the prompt or raise max_seq_len (the model allows "
                         f"{limit})")
    return ctx


def stop_ids(tokenizer, eos_ids: set[int] | None) -> set[int]:
    """The ids that end generation: ``eos_ids`` if given, else the tokenizer's eos_id (if any)."""
    if eos_ids is not None:
        if isinstance(eos_ids, (str, bytes)) or not all(isinstance(i, numbers.Integral) for i in eos_ids):
            raise ValueError(f"eos_ids: must be a set of int token ids, got {eos_ids!r}")
        return set(eos_ids)
    return {tokenizer.eos_id} if tokenizer is not None and tokenizer.eos_id is not None else set()


class Stopper:
    """Decides when a sequence ends: EOS, a stop token id, a stop string (vLLM's stop checker).

    After ``check`` (or ``emit``) returns True, ``result.finish_reason`` is "eos" when a stop token ended
    it (an EOS id, unless ``ignore_eos``, or an id of ``params.stop_token_ids``, which stop even with
    ``ignore_eos``; ``finish`` then decodes the text without that token) or "stop" for a stop string
    (``result.text`` cut before it). ``stop_reason`` is vLLM's: the stop string (str) that fired, the stop
    token id (int) from ``stop_token_ids``, or None for EOS; every ``check`` resets it to None first.
    EOS is checked first, so an id both EOS and in ``stop_token_ids`` reads as EOS (stop_reason None), as
    in vLLM. One Stopper may serve several sequences (a batch): ``stop_reason`` is the only state it keeps,
    and it describes the last check alone, so read it right after the check that returned True.
    """

    def __init__(self, params: SamplingParams, tokenizer, eos_ids: set[int]):
        if params.stop and tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; pass tokenizer=")
        self.params, self.tokenizer, self.eos_ids = params, tokenizer, eos_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.stop_reason: str | int | None = None

    def emit(self, result: GenerationResult, token: int, seconds: float, on_token=None) -> bool:
        """Append one new token that took ``seconds``, stream it to ``on_token``; returns whether the
        sequence is done (EOS or a stop string: ``check``)."""
        result.tokens.append(token)
        result.step_s.append(seconds)
        if on_token is not None:
            on_token(token)
        return self.check(result)

    def check(self, result: GenerationResult) -> bool:
        """Whether ``result``'s last token ends it; sets ``finish_reason`` (and ``text`` for a stop string)
        and ``stop_reason`` as the class docstring says."""
        self.stop_reason = None
        tok = result.tokens[-1]
        if not self.params.ignore_eos and tok in self.eos_ids:
            result.finish_reason = "eos"
            return True
        if tok in self.stop_token_ids:
            result.finish_reason = "eos"  # a stop token: left out of the text, as EOS
            self.stop_reason = tok
            return True
        if self.params.stop:
            text = self.tokenizer.decode(result.tokens)
            hits = [text.find(s) for s in self.params.stop if s in text]
            if hits:
                cut = min(hits)
                result.finish_reason = "stop"
                result.text = text[:cut]
                self.stop_reason = next(s for s in self.params.stop if text.find(s) == cut)  # first listed, on a tie
                return True
        return False


def finish(result: GenerationResult, tokenizer, prompt_s: float = 0.0) -> GenerationResult:
    """Fill ``result.text`` (without the EOS token; a stop string's cut is kept as it is) and the timings
    from ``step_s``: ``prefill_s`` is the first token's time, plus ``prompt_s`` (a prompt forward that ran
    before the first step was timed), ``decode_s`` the rest."""
    if result.step_s:
        result.step_s[0] += prompt_s
    result.prefill_s = result.step_s[0] if result.step_s else prompt_s
    result.decode_s = sum(result.step_s[1:])
    if tokenizer is not None and result.finish_reason != "stop":
        ids = result.tokens[:-1] if result.finish_reason == "eos" else result.tokens
        result.text = tokenizer.decode(ids)
    return result
