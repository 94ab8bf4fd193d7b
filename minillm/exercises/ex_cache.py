"""Exercises 3 and 4: writing into a KV cache and rotating the new tokens by their real positions.
They follow ``minillm.kv_cache.KVCache.update`` and ``minillm.model.rope_tables`` / ``apply_rope``
(Su et al. 2021, RoFormer Eq. 34, in Hugging Face Llama's rotate-half form)."""

from __future__ import annotations

import math

import torch

from ..kv_cache import KVCache
from ..config import ModelConfig
from ..model import apply_rope, rope_tables
from .checker import Case, Exercise, Failure, describe, first_match, same_tensor, tensor_problem

# ---------------------------------------------------------------------------------------------
# 3. cache_update


def reference_update(k_cache, v_cache, k_new, v_new, start):
    B, Hkv, S, D = k_cache.shape
    cache = KVCache(ModelConfig(n_layers=1, dim=Hkv * D, n_heads=Hkv, n_kv_heads=Hkv, head_dim=D, max_seq_len=S), B, S)
    cache.k[0], cache.v[0] = k_cache, v_cache
    cache.seq_len = S  # whatever the buffer held may be overwritten from ``start`` on (a rollback)
    cache.prepare(torch.arange(start, start + k_new.shape[2]))
    return cache.update(0, k_new, v_new)


def _update_case(name, B, Hkv, S, D, start, T, g=None, stale=0):
    """A cache whose first ``start`` positions hold earlier tokens (and ``stale`` more positions the
    rejected drafts of a speculative pass), the rest zeros; T new tokens to write at ``start``."""
    def randn(*shape):
        return torch.randn(*shape, generator=g) if g is not None else torch.arange(
            math.prod(shape), dtype=torch.float32).reshape(shape) / 10 + 1
    k_cache, v_cache = torch.zeros(B, Hkv, S, D), torch.zeros(B, Hkv, S, D)
    held = start + stale
    k_cache[:, :, :held], v_cache[:, :, :held] = randn(B, Hkv, held, D), -randn(B, Hkv, held, D)
    k_new, v_new = randn(B, Hkv, T, D) + 100, -randn(B, Hkv, T, D) - 100
    # the known answer: what the cache held before start, then the new tokens
    expected = None if g is not None else (torch.cat([k_cache[:, :, :start], k_new], 2),
                                           torch.cat([v_cache[:, :, :start], v_new], 2))
    return Case(name, (k_cache, v_cache, k_new, v_new, start), expected)


def update_cases() -> list[Case]:
    return [
        _update_case("prefill: 3 tokens into an empty cache", 1, 3, 8, 4, 0, 3),
        _update_case("decode: 1 token after 5 cached (GQA shapes: 3 KV heads)", 1, 3, 8, 4, 5, 1),
        _update_case("speculative verify: 3 tokens after 4 cached, batch 2", 2, 3, 8, 4, 4, 3),
        _update_case("after a rollback: 1 token at position 4 over 3 rejected drafts", 1, 3, 8, 4, 4, 1, stale=3),
        _update_case("the last slot: 1 token at position 7 of a cache of 8", 1, 3, 8, 4, 7, 1),
    ]


def update_random(g: torch.Generator) -> list[Case]:
    cases = []
    for i in range(3):
        B, Hkv, D = (int(x) for x in torch.randint(1, 4, (3,), generator=g))
        S = 16
        start = int(torch.randint(0, 12, (), generator=g))
        T = int(torch.randint(1, S - start + 1, (), generator=g))
        cases.append(_update_case(f"random {i + 1} (B={B}, Hkv={Hkv}, start={start}, T={T})", B, Hkv, S, 4 * D,
                                  start, T, g))
    return cases


def judge_update(case: Case, expected, got, args) -> Failure | None:
    k_cache, _, k_new, _, start = case.args
    B, Hkv, S, D = k_cache.shape
    T, n = k_new.shape[2], start + k_new.shape[2]
    want = f"(k_all, v_all), each {B}x{Hkv}x{n}x{D}"
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return Failure(want, describe(got), "return the pair (k_all, v_all)")
    for what, x in zip(("k_all", "v_all"), got):
        length = x.shape[2] if isinstance(x, torch.Tensor) and x.dim() == 4 else None
        if length == T != n:
            return Failure(want, describe(x), "return every position so far, 0..start+T-1, not only the new "
                                              "ones: attention needs the whole history")
        if length == S != n:
            return Failure(want, describe(x), "return only the positions written so far (start + T), not the "
                           "whole buffer: the rest holds zeros or rejected drafts, and attention would attend to them")
        problem = tensor_problem(x, (B, Hkv, n, D), k_cache.dtype, what)
        if problem:
            return Failure(want, describe(x), problem)
    if same_tensor(got[0], expected[1]) and same_tensor(got[1], expected[0]):
        return Failure(describe(expected[0]), describe(got[0]), "keys and values are swapped")
    for what, x, e in zip(("k_all", "v_all"), got, expected):
        if not same_tensor(x, e, atol=0, rtol=0):
            new = case.args[2 if what == "k_all" else 3]
            wrote_at_zero = start > 0 and same_tensor(x[:, :, :T], new, atol=0, rtol=0)
            return Failure(describe(e[:, :, start:]), describe(x[:, :, start:]), (
                "write the new tokens at positions start..start+T-1, not 0..T-1" if wrote_at_zero else
                f"{what} differs from the cache's first {start} positions followed by the new tokens"))
    for what, buffer, e in (("k_cache", args[0], expected[0]), ("v_cache", args[1], expected[1])):
        if not same_tensor(buffer[:, :, :n], e, atol=0, rtol=0):
            return Failure(f"{what}[:, :, :{n}] holding the new tokens", f"{what} unchanged at positions {start}.."
                           f"{n - 1}", f"write into {what} itself ({what}[:, :, start:start + T] = ...): the next "
                           "step reads the cache, not your return value")
    return None


UPDATE = Exercise(
    name="cache_update",
    signature="cache_update(k_cache, v_cache, k_new, v_new, start) -> (k_all, v_all), each (B, Hkv, start + T, D)",
    notebook="03_kv_cache_update.ipynb",
    follows="minillm.kv_cache.KVCache.prepare / update",
    reference=reference_update,
    forbidden=("minillm.kv_cache.KVCache.update",),
    hand_cases=update_cases,
    random_cases=update_random,
    judge=judge_update,
)


# ---------------------------------------------------------------------------------------------
# 4. rope_at_offset


def reference_rope(x, start, base):
    T, D = x.shape[2], x.shape[3]
    cos, sin = rope_tables(D, start + T, base)
    return apply_rope(x, cos[start:], sin[start:])


def _rope(x, positions, base, *, interleaved=False, exponent=2, sign=1):
    """RoPE written out, with the switches of the typical mistakes."""
    D = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) * exponent / 2 / D)  # (D/2,)
    ang = positions.double()[:, None] * inv[None, :]  # (T, D/2)
    cos, sin = ang.cos(), sign * ang.sin()
    xd = x.double()
    if interleaved:  # pairs (2i, 2i+1), RoFormer's original layout
        a, b = xd[..., 0::2], xd[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).to(x.dtype)
    a, b = xd[..., : D // 2], xd[..., D // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(x.dtype)


def rope_cases() -> list[Case]:
    c5, s5, c05, s05 = math.cos(5), math.sin(5), math.cos(0.5), math.sin(0.5)
    c6, s6, c06, s06 = math.cos(6), math.sin(6), math.cos(0.6), math.sin(0.6)
    x = torch.tensor([[[[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]]])  # (1, 1, 2, 4)
    return [
        Case("a token at position 0 is not rotated", (torch.tensor([[[[0.3, -1.0, 2.0, 0.5]]]]), 0, 10000.0),
             torch.tensor([[[[0.3, -1.0, 2.0, 0.5]]]])),
        Case("D = 2, position 1: a rotation by 1 radian", (torch.tensor([[[[1.0, 0.0]]]]), 1, 10000.0),
             torch.tensor([[[[math.cos(1), math.sin(1)]]]])),
        # D = 4, base 100: pair (0, 2) turns by p radians, pair (1, 3) by p / 10
        Case("D = 4, base 100: two tokens after a cache of 5 sit at positions 5 and 6", (x, 5, 100.0),
             torch.tensor([[[[c5, c05, s5, s05], [c6, c06, s6, s06]]]])),
        Case("SmolLM2 shapes (9 heads, D = 64, base 100,000): one decode token at position 100",
             (torch.linspace(-1, 1, 9 * 64).reshape(1, 9, 1, 64), 100, 100000.0), None),
    ]


def rope_random(g: torch.Generator) -> list[Case]:
    cases = []
    for i in range(3):
        B, H = (int(v) for v in torch.randint(1, 4, (2,), generator=g))
        T = int(torch.randint(1, 6, (), generator=g))
        start = int(torch.randint(1, 500, (), generator=g))
        D = 8 * int(torch.randint(1, 5, (), generator=g))
        cases.append(Case(f"random {i + 1} (B={B}, H={H}, T={T} after {start} cached, D={D})",
                          (torch.randn(B, H, T, D, generator=g), start, 10000.0)))
    return cases


def judge_rope(case: Case, expected, got, args) -> Failure | None:
    x, start, base = case.args
    problem = tensor_problem(got, x.shape, x.dtype)
    if problem:
        return Failure(describe(expected), describe(got), problem)
    if same_tensor(got, expected):
        return None
    T = x.shape[2]
    pos = torch.arange(start, start + T)
    mutants = [
        (lambda: x, "nothing was rotated: multiply by cos and add the rotated half times sin"),
        (lambda: _rope(x, pos - start, base), "positions restart at 0 after the cache: the new tokens sit at "
                                              "positions start..start+T-1"),
        (lambda: _rope(x, pos + 1, base), "positions are off by one: the first new token is at position start"),
        (lambda: _rope(x, pos, base, interleaved=True), "minillm (like Hugging Face Llama) rotates halves: "
                                                        "the pairs are (i, i + D/2), not neighbours (2i, 2i + 1)"),
        (lambda: _rope(x, pos, base, sign=-1), "the rotation goes the wrong way: rotated half = cat(-x2, x1)"),
        (lambda: _rope(x, pos, base, exponent=1), "frequency i is base^(-2i / D) for i < D/2"),
    ]
    hint = first_match(got, mutants, same_tensor)
    wrong = (got.double() - expected.double()).abs() > 1e-4 + 1e-4 * expected.double().abs()  # (B, H, T, D)
    t, d = (int(i) for i in wrong.nonzero()[0, 2:]) if wrong.any() else (0, 0)
    return Failure(describe(expected), describe(got), hint or (
        f"the first wrong value is token {t} (position {start + t}), dimension {d}: work that token out by hand "
        f"(its position, the dimension it is paired with, the pair's frequency and the sign of each term)"))


ROPE = Exercise(
    name="rope_at_offset",
    signature="rope_at_offset(x, start, base) -> (B, H, T, D), x rotated as positions start..start+T-1",
    notebook="04_rope_offset.ipynb",
    follows="minillm.model.rope_tables / apply_rope",
    reference=reference_rope,
    forbidden=("minillm.model.rope_tables", "minillm.model.apply_rope"),
    hand_cases=rope_cases,
    random_cases=rope_random,
    judge=judge_rope,
)
