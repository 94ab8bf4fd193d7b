"""Exercises 1 and 2: what a forward pass costs (FLOPs and bytes, so its arithmetic intensity) and
how large the KV cache is. They follow ``minillm.roofline.forward_cost`` and
``minillm.kv_cache.kv_cache_bytes`` (Pope et al. 2023, Sec. 2-3; Ainslie et al. 2023 for GQA)."""

from __future__ import annotations

import torch

from ..kv_cache import kv_cache_bytes
from ..config import ModelConfig
from ..roofline import forward_cost
from .checker import Case, Exercise, Failure, close, describe, first_match, number_problem

SMOLLM2 = ModelConfig()  # the defaults are SmolLM2-135M's: 30 layers, 9 query heads, 3 KV heads of 64
LLAMA2_7B = ModelConfig(n_layers=32, dim=4096, n_heads=32, n_kv_heads=32, head_dim=128, ffn_dim=11008, vocab_size=32000,
                        max_seq_len=4096, rope_base=10000.0, tie_embeddings=False)
LLAMA2_70B = ModelConfig(n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=28672, vocab_size=32000,
                         max_seq_len=4096, rope_base=10000.0, tie_embeddings=False)
TINY = ModelConfig(n_layers=1, dim=4, n_heads=2, n_kv_heads=1, head_dim=2, ffn_dim=8, vocab_size=10, max_seq_len=64)


# ---------------------------------------------------------------------------------------------
# 1. forward_flops_bytes


def _cost(c: ModelConfig, B: int, T: int, L: int, nbytes: float, *, mac_flops=2, attention=True, causal=True,
          all_logits=True, weights_per_token=False, kv_factor=2, kv_heads=None, new_kv=True, norms=True,
          head=True) -> tuple[float, float]:
    """The cost model written out, with one switch per typical mistake (all off: the right answer)."""
    per_layer = c.dim * c.head_dim * (c.n_heads + 2 * c.n_kv_heads) + c.n_heads * c.head_dim * c.dim
    per_layer += 3 * c.dim * c.ffn_dim
    pairs = L * T + T * (T + 1) / 2 if causal else T * (L + T)  # (query, key) pairs per row
    flops = c.n_layers * (mac_flops * B * T * per_layer + (4 * B * pairs * c.n_heads * c.head_dim if attention else 0))
    flops += mac_flops * B * (T if all_logits else 1) * c.vocab_size * c.dim
    weights = c.n_layers * per_layer + (c.vocab_size * c.dim if head else 0)
    weights += (2 * c.n_layers + 1) * c.dim if norms else 0
    weight_bytes = weights * nbytes * (B * T if weights_per_token else 1)
    hkv = c.n_kv_heads if kv_heads is None else kv_heads
    kv = kv_factor * B * (L + (T if new_kv else 0)) * c.n_layers * hkv * c.head_dim * nbytes
    return flops, weight_bytes + kv


def reference_cost(config, batch_size, new_tokens, context, bytes_per_element):
    cost = forward_cost(config, batch_size, new_tokens, context, bytes_per_element, bytes_per_element,
                        causal_prefill=True)
    return cost.flops, cost.bytes


def cost_cases() -> list[Case]:
    return [
        # TINY by hand: linear weights per layer 4*2*(2+2) + 2*2*4 + 3*4*8 = 144, output projection
        # 10*4 = 40, norms 3*4 = 12. Decode after 3 tokens: 4 (query, key) pairs.
        # FLOPs 2*144 + 4*4*2*2 + 2*40 = 432; bytes (144+40+12)*2 + KV 2*(3+1)*1*1*2*2 = 392 + 32 = 424
        Case("tiny model, decode after 3 cached tokens, float16 (worked by hand)", (TINY, 1, 1, 3, 2), (432.0, 424.0)),
        # prefill of 3 tokens: 6 causal pairs; FLOPs 3*2*144 + 4*6*2*2 + 3*2*40 = 864 + 96 + 240
        Case("tiny model, prefill of 3 tokens, float32 (causal: 6 query-key pairs)", (TINY, 1, 3, 0, 4),
             (1200.0, 196 * 4 + 2 * 3 * 2 * 4.0)),
        Case("SmolLM2-135M (GQA: 3 KV heads for 9 query heads), decode at context 0", (SMOLLM2, 1, 1, 0, 4),
             _cost(SMOLLM2, 1, 1, 0, 4)),
        Case("SmolLM2-135M, decode at batch 8 after 1,024 tokens, bfloat16", (SMOLLM2, 8, 1, 1024, 2),
             _cost(SMOLLM2, 8, 1, 1024, 2)),
        Case("SmolLM2-135M, prefill of 512 tokens, float32", (SMOLLM2, 1, 512, 0, 4), _cost(SMOLLM2, 1, 512, 0, 4)),
        Case("Llama-2-70B (8 KV heads for 64), decode after 4,000 tokens, float16", (LLAMA2_70B, 1, 1, 4000, 2),
             _cost(LLAMA2_70B, 1, 1, 4000, 2)),
    ]


def cost_random(g: torch.Generator) -> list[Case]:
    cases = []
    for i in range(4):
        r = torch.randint(1, 9, (5,), generator=g).tolist()
        hkv = r[0] % 3 + 1
        c = ModelConfig(n_layers=r[1], dim=16 * r[2], n_heads=hkv * r[3], n_kv_heads=hkv, head_dim=8 * r[4],
                        ffn_dim=32 * r[0], vocab_size=100 * r[1], max_seq_len=4096)
        T, L = (1, 100 * r[2]) if i % 2 == 0 else (16 * r[3], 0)
        cases.append(Case(f"random model {i + 1} ({'decode' if T == 1 else 'prefill'}, B={r[4]}, T={T}, L={L})",
                          (c, r[4], T, L, (4, 2, 1)[i % 3])))
    return cases


COST_HINTS = [
    (dict(mac_flops=1), "a multiply-add is 2 FLOPs: a linear layer does 2 x weights FLOPs per token"),
    (dict(attention=False), "attention's FLOPs are missing: Q K^T and scores x V do 4 x H x D per (query, key) "
                            "pair per layer"),
    (dict(causal=False), "count the causal triangle: new token t (0-based) attends to L + t + 1 keys, "
                         "so T x L + T (T + 1) / 2 pairs per row, not T x (L + T)"),
    (dict(all_logits=False), "minillm's forward computes logits for every new token: the output projection "
                             "runs B x T times"),
    (dict(weights_per_token=True), "every weight is read once per forward, whatever B x T: that is why batching "
                                   "raises the intensity"),
    (dict(kv_factor=1), "the KV bytes count keys and values: the factor 2"),
    (dict(kv_heads="n_heads"), "with GQA the cache holds n_kv_heads heads, not n_heads"),
    (dict(new_kv=False), "the forward also writes the new tokens' keys and values: count B x T positions "
                         "besides the L it reads"),
    (dict(norms=False), "count the norm weights too: 2 per layer and the final one, dim each"),
    (dict(head=False), "the output projection (vocab x dim) is read every forward, even when tied to the embedding"),
]


def judge_cost(case: Case, expected, got, args) -> Failure | None:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return Failure(describe(expected), describe(got), "return a pair (flops, bytes)")
    for what, value in zip(("flops", "bytes"), got):
        problem = number_problem(value, what)
        if problem:
            return Failure(describe(expected), describe(got), problem)
    if close(got[0], expected[0]) and close(got[1], expected[1]):
        return None
    c = case.args[0]  # the hints are worked from the case's own arguments, whatever the function did to its copy
    mutants = [(lambda kw=kw: _cost(*case.args, **{k: (c.n_heads if v == "n_heads" else v) for k, v in kw.items()}), h)
               for kw, h in COST_HINTS]
    index = 1 if close(got[0], expected[0]) else 0  # compare only the part that is wrong
    hint = first_match(got, mutants, lambda a, b: close(a[index], b[index]) and close(a[1 - index], b[1 - index])) \
        or first_match(got, mutants, lambda a, b: close(a[index], b[index]))
    part = "flops" if index == 0 else "bytes"
    return Failure(describe(expected), describe(got),
                   hint or f"{part} differ; redo this case by hand from the docstring")


COST = Exercise(
    name="forward_flops_bytes",
    signature="forward_flops_bytes(config, batch_size, new_tokens, context, bytes_per_element) -> (flops, bytes)",
    notebook="01_arithmetic_intensity.ipynb",
    follows="minillm.roofline.forward_cost (causal_prefill=True)",
    reference=reference_cost,
    forbidden=("minillm.roofline.forward_cost",),
    hand_cases=cost_cases,
    random_cases=cost_random,
    judge=judge_cost,
)


# ---------------------------------------------------------------------------------------------
# 2. kv_cache_size


def reference_kv_size(config, batch_size, seq_len, dtype):
    return int(kv_cache_bytes(config, batch_size, seq_len, torch.empty((), dtype=dtype).element_size()))


def kv_cases() -> list[Case]:
    return [
        # 2 x 8,192 x 30 x 3 x 64 x 4 bytes = 360 MiB
        Case("SmolLM2-135M (GQA: 3 KV heads for 9 query heads), 8,192 tokens, float32",
             (SMOLLM2, 1, 8192, torch.float32), 377_487_360),
        # 2 x 4,096 x 32 x 32 x 128 x 2 bytes = 2 GiB: the often-quoted 0.5 MB per token
        Case("Llama-2-7B (no GQA), 4,096 tokens, float16", (LLAMA2_7B, 1, 4096, torch.float16), 2_147_483_648),
        # 2 x 8 x 4,096 x 80 x 8 x 128 x 2 bytes = 10 GiB
        Case("Llama-2-70B (GQA: 8 KV heads for 64), batch 8, 4,096 tokens, bfloat16",
             (LLAMA2_70B, 8, 4096, torch.bfloat16), 10_737_418_240),
        Case("SmolLM2-135M, batch 4, 1,000 tokens, int8", (SMOLLM2, 4, 1000, torch.int8), 2 * 4 * 1000 * 30 * 3 * 64),
        Case("an empty cache (0 tokens)", (SMOLLM2, 1, 0, torch.float16), 0),
    ]


def kv_random(g: torch.Generator) -> list[Case]:
    cases = []
    for i, dtype in enumerate((torch.float32, torch.float16, torch.int8, torch.bfloat16)):
        r = torch.randint(1, 9, (4,), generator=g).tolist()
        c = ModelConfig(n_layers=4 * r[0], dim=64, n_heads=r[1] * r[2], n_kv_heads=r[1], head_dim=16 * r[3])
        L = int(torch.randint(1, 5000, (), generator=g))
        cases.append(Case(f"random model {i + 1} (Hkv={r[1]} of H={r[1] * r[2]}, B={r[3]}, L={L}, "
                          f"{str(dtype).replace('torch.', '')})", (c, r[3], L, dtype)))
    return cases


def judge_kv(case: Case, expected, got, args) -> Failure | None:
    problem = number_problem(got, "the size")
    if problem:
        return Failure(describe(expected), describe(got), problem)
    if close(got, expected):
        return None
    c, B, _, dtype = case.args
    size = torch.empty((), dtype=dtype).element_size()
    ratios = [(1 / 2, "keys and values: the factor 2 is missing"),
              (c.n_heads / c.n_kv_heads, "with GQA the cache holds n_kv_heads heads, not n_heads"),
              (1 / c.n_layers, "every layer has its own keys and values: multiply by n_layers"),
              (1 / B, "every row of the batch has its own cache: multiply by batch_size"),
              (8, "bytes, not bits: element_size() is in bytes"),
              (4 / size, "bytes per element come from the dtype: torch.empty((), dtype=dtype).element_size() "
                         "(float32 4, float16/bfloat16 2, int8 1)"),
              (1 / size, "multiply by the bytes per element of the dtype")]
    hint = next((h for r, h in ratios if r != 1 and expected and close(got, expected * r)), None)
    # two mistakes at once match no single one: say how far off it is, and what to compare, not the formula
    return Failure(describe(expected), describe(got), hint or (
        f"your size is {float(got) / expected:.4g} x the expected one: write your product factor by factor and "
        "check each against the docstring (what is stored, for how many rows, positions, layers and heads, in "
        "how many bytes)" if expected else "redo this case by hand from the docstring"))


KV_SIZE = Exercise(
    name="kv_cache_size",
    signature="kv_cache_size(config, batch_size, seq_len, dtype) -> bytes (int)",
    notebook="02_kv_cache_size.ipynb",
    follows="minillm.kv_cache.kv_cache_bytes",
    reference=reference_kv_size,
    forbidden=("minillm.kv_cache.kv_cache_bytes",),
    hand_cases=kv_cases,
    random_cases=kv_random,
    judge=judge_kv,
)
