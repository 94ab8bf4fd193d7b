"""``SamplingParams``: how to pick tokens and when to stop, in vLLM's names (``vllm.SamplingParams``).

The parameters are checked once, when a request is made; ``minillm.sampling`` turns them into a token.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import torch

GREEDY_BELOW = torch.finfo(torch.float32).tiny  # temperatures under this cannot divide float32 logits


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    The names are vLLM's (``vllm.SamplingParams``), so ``SamplingParams(n=2, max_tokens=32, seed=0,
    stop_token_ids=[2], top_k=-1)`` means the same on both. vLLM's other fields (penalties, logprobs,
    min_p, ...) are not implemented and raise TypeError, as any unknown argument does.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it. >= 0. A temperature
            below float32's smallest normal number (``GREEDY_BELOW``, ~1.2e-38) also means greedy:
            logits are divided in float32, where it would round to 0 and every probability to NaN.
        top_k: keep the k most likely tokens; 0 keeps all. >= 0, or -1: vLLM's "no top-k", stored as 0 (so
            the two spellings of "keep all" are one value for equality and hashing).
        top_p: keep the smallest set of tokens whose probability reaches top_p. In (0, 1].
        max_new_tokens: tokens to generate at most. >= 1 (default 64). ``max_tokens`` is vLLM's name for
            the same field: pass either (both only if equal); ``params.max_tokens`` reads it back.
        seed: seeds the sampling generator (same seed, same tokens); None draws a fresh seed.
        stop: strings that end generation; the text is cut before the first one.
        stop_token_ids: token ids that end generation, as EOS does (``finish_reason`` "eos", the text
            decoded without that token; ``Stopper.stop_reason`` is the id); a list or tuple of ints >= 0,
            stored as a tuple. Unlike EOS they stop even with ``ignore_eos`` (as vLLM).
        ignore_eos: keep generating past the end-of-sequence token (benchmarks, oracle tests); it does not
            turn off ``stop_token_ids`` or ``stop``.
        n: completions per prompt (vLLM's parallel sampling, ``minillm.paged.LLMEngine``: the samples
            share the prompt's KV blocks); >= 1. The single-sequence paths (``generate*``) produce one.
        best_of: vLLM's "draw best_of samples, return the n most likely". minillm does not rank extra
            samples, so only None (the default) or a value equal to n is accepted, and stored as None.

    Raises:
        ValueError: naming the field, for any value outside its range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    best_of: int | None = None

    def __post_init__(self):
        # numbers.Real / Integral: Python and NumPy scalars alike
        for name, kind in (("temperature", numbers.Real), ("top_p", numbers.Real), ("top_k", numbers.Integral),
                           ("max_new_tokens", numbers.Integral), ("n", numbers.Integral)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"{name}: must be a number{' (an integer)' if kind is numbers.Integral else ''}, "
                                 f"got {value!r}")
            try:
                object.__setattr__(self, name, int(value) if kind is numbers.Integral else float(value))
            except OverflowError:
                raise ValueError(f"{name}: {value!r} is too large") from None
        if not 0 <= self.temperature < float("inf"):  # also rejects NaN
            raise ValueError(f"temperature: must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed: must be an integer in [0, 2^63), got {self.seed!r}")
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        if self.top_k == -1:  # vLLM's "no top-k": one stored value for "keep all"
            object.__setattr__(self, "top_k", 0)
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, or -1 (0 and -1 both mean no top-k), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1 (max_tokens in vLLM's name), got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n: completions per prompt must be >= 1, got {self.n}")
        try:
            stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        except TypeError:
            raise ValueError(f"stop: must be a string or a list of strings (() for none), got {self.stop!r}") from None
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop: stop strings must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = () if self.stop_token_ids is None else self.stop_token_ids  # None: vLLM's default
        try:
            ids = None if isinstance(ids, (str, bytes, dict)) else tuple(ids)
        except TypeError:  # not iterable: a lone int, say
            ids = None
        if ids is None or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 for i in ids):
            one = f"; write [{self.stop_token_ids}] for one id" if isinstance(self.stop_token_ids, numbers.Integral) else ""
            raise ValueError(f"stop_token_ids: must be a list of token ids (ints >= 0; [] for none), got "
                             f"{self.stop_token_ids!r}{one}")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        if self.best_of is not None:
            if isinstance(self.best_of, bool) or not isinstance(self.best_of, numbers.Integral):
                raise ValueError(f"best_of: must be an integer or None, got {self.best_of!r}")
            if self.best_of != self.n:
                rule = ("vLLM refuses best_of below n" if self.best_of < self.n else
                        f"vLLM's best_of={self.best_of} draws {self.best_of} samples and returns the n={self.n} most likely")
                raise ValueError(f"best_of: {self.best_of} with n={self.n}: minillm does not rank extra samples ({rule}); "
                                 "leave best_of unset, or equal to n")
            # equal to n it asks for nothing more than n: stored as None, one value for one meaning (and
            # dataclasses.replace(params, n=...) then stays valid)
            object.__setattr__(self, "best_of", None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _accept_max_tokens(init):
    """Let ``__init__`` take vLLM's ``max_tokens`` for the one stored field ``max_new_tokens``. Not a
    second field: ``dataclasses.replace`` and equality then see one length limit, never two."""
    @functools.wraps(init)
    def __init__(self, *args, max_tokens=None, **kwargs):
        if max_tokens is not None:
            if "max_new_tokens" in kwargs and kwargs["max_new_tokens"] != max_tokens:
                raise ValueError(f"max_tokens: vLLM's name for max_new_tokens, got max_tokens={max_tokens!r} and "
                                 f"max_new_tokens={kwargs['max_new_tokens']!r}; give one of them")
            kwargs["max_new_tokens"] = max_tokens
        init(self, *args, **kwargs)
    return __init__


SamplingParams.__init__ = _accept_max_tokens(SamplingParams.__init__)
SamplingParams.max_tokens = property(lambda self: self.max_new_tokens,
                                     doc="vLLM's name for ``max_new_tokens`` (the same field).")
