"""A gallery of typical wrong answers to the classroom exercises: each must fail its check with the
hint that names its mistake (and the package's own implementation must pass every check)."""

import io
from contextlib import redirect_stdout

import pytest
import torch

from minillm.exercises import EXERCISES, check
from minillm.exercises.ex_blocks import reference_append
from minillm.quant import rtn_quantize


def run(name, fn):
    """check(name, fn) with its printed lines captured: (report, text). The package's code stays on: the
    wrong answers below are written with it for brevity (tests/test_grading_rules.py switches it off)."""
    out = io.StringIO()
    with redirect_stdout(out):
        report = check(name, fn, forbid=False)
    return report, out.getvalue()


@pytest.mark.parametrize("name", list(EXERCISES))
def test_package_implementation_passes_every_check(name):
    report, text = run(name, EXERCISES[name].reference)
    assert report.passed, text
    assert len(report.results) >= 5  # hand-made cases and random ones


# ---- the wrong answers, as students write them ----------------------------------------------------

def cost_weights_per_token(config, batch_size, new_tokens, context, bytes_per_element):
    c, B, T, L = config, batch_size, new_tokens, context
    per_layer = c.dim * c.head_dim * (c.n_heads + 2 * c.n_kv_heads) + c.n_heads * c.head_dim * c.dim
    per_layer += 3 * c.dim * c.ffn_dim
    head = c.vocab_size * c.dim
    attention = 4 * B * (L * T + T * (T + 1) / 2) * c.n_heads * c.head_dim
    flops = c.n_layers * (2 * B * T * per_layer + attention) + 2 * B * T * head
    weights = (c.n_layers * per_layer + head + (2 * c.n_layers + 1) * c.dim) * B * T  # re-read for every token
    kv = 2 * B * (L + T) * c.n_layers * c.n_kv_heads * c.head_dim
    return flops, (weights + kv) * bytes_per_element


def cost_no_attention(config, batch_size, new_tokens, context, bytes_per_element):
    reference = EXERCISES["forward_flops_bytes"].reference
    flops, nbytes = reference(config, batch_size, new_tokens, context, bytes_per_element)
    c, T, L = config, new_tokens, context
    return flops - c.n_layers * 4 * batch_size * (L * T + T * (T + 1) / 2) * c.n_heads * c.head_dim, nbytes


def kv_without_2(config, batch_size, seq_len, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    return batch_size * seq_len * config.n_layers * config.n_kv_heads * config.head_dim * size


def kv_with_n_heads(config, batch_size, seq_len, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * batch_size * seq_len * config.n_layers * config.n_heads * config.head_dim * size


def update_only_new(k_cache, v_cache, k_new, v_new, start):
    T = k_new.shape[2]
    k_cache[:, :, start:start + T], v_cache[:, :, start:start + T] = k_new, v_new
    return k_new, v_new


def update_at_zero(k_cache, v_cache, k_new, v_new, start):
    T = k_new.shape[2]
    k_cache[:, :, :T], v_cache[:, :, :T] = k_new, v_new
    return k_cache[:, :, :start + T], v_cache[:, :, :start + T]


def update_not_in_place(k_cache, v_cache, k_new, v_new, start):
    return torch.cat([k_cache[:, :, :start], k_new], 2), torch.cat([v_cache[:, :, :start], v_new], 2)


def rope_restarting_at_zero(x, start, base):
    return EXERCISES["rope_at_offset"].reference(x, 0, base)  # the cache's offset forgotten


def rope_interleaved(x, start, base):
    T, D = x.shape[2], x.shape[3]
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = torch.arange(start, start + T, dtype=torch.float32)[:, None] * inv
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1).flatten(-2)


def blocks_with_extra(num_tokens, block_size):
    return num_tokens // block_size + 1


def slots_without_table(block_table, positions, block_size):
    return positions.clone()


def new_block_off_by_one(num_tokens, block_size):
    return (num_tokens + 1) % block_size == 0


def cow_no_copy(block_table, num_tokens, ref_counts, free_blocks, block_size):
    return reference_append(block_table, num_tokens, ref_counts, free_blocks, block_size, copy_shared=False)


def cow_no_decrement(block_table, num_tokens, ref_counts, free_blocks, block_size):
    return reference_append(block_table, num_tokens, ref_counts, free_blocks, block_size, decrement=False)


def cow_copies_full_block(block_table, num_tokens, ref_counts, free_blocks, block_size):
    return reference_append(block_table, num_tokens, ref_counts, free_blocks, block_size, shared_first=True)


def verify(draft_tokens, draft_probs, target_probs, uniforms, normalise=True, bonus=True, residual=True):
    for i, x in enumerate(draft_tokens):
        if uniforms[i] >= min(1.0, float(target_probs[i, x] / draft_probs[i, x])):
            r = (target_probs[i] - draft_probs[i]).clamp(min=0) if residual else target_probs[i]
            return i, (r / r.sum() if normalise else r)
    k = len(draft_tokens)
    return k, (target_probs[k] if bonus else target_probs[k - 1])


def gptq(W, H, scale, zero, maxq, percdamp=0.01, damp=True, feedback=True):
    W, H = W.clone(), H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    if damp:
        H += percdamp * torch.diag(H).mean() * torch.eye(H.shape[0], dtype=H.dtype)
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True) if damp else torch.linalg.cholesky(
        torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.zeros(W.shape, dtype=torch.int64)
    for i in range(W.shape[1]):
        codes[:, i] = torch.clamp(torch.round(W[:, i].float() / scale) + zero, 0, maxq).long()
        if feedback:
            err = (W[:, i] - scale.double() * (codes[:, i] - zero).double()) / U[i, i]
            W[:, i:] -= err[:, None] * U[i, i:][None, :]
    return codes


def awq(x, W, config, n_grid=20, divide=True, normalise=True):
    ref = x @ W.t()
    s_x = x.abs().mean(0).clamp(min=1e-8)
    best = (float("inf"), None, 0.0)
    for i in range(n_grid):
        s = s_x ** (i / n_grid)
        if normalise:
            s = s / (s.max() * s.min()).sqrt()
        Wq = rtn_quantize(W * s, config).dequantize()
        err = (x @ (Wq / s if divide else Wq).t() - ref).pow(2).mean().item()
        if err < best[0]:
            best = (err, s, i / n_grid)
    return best[1], best[2]


def awq_unclamped(x, W, config, n_grid=20):
    ref = x @ W.t()
    s_x = x.abs().mean(0)  # a dead channel gives 0, then 0 / 0
    best = (float("inf"), None, 0.0)
    for i in range(n_grid):
        s = s_x ** (i / n_grid)
        s = s / (s.max() * s.min()).sqrt()
        err = (x @ (rtn_quantize(W * s, config).dequantize() / s).t() - ref).pow(2).mean().item()
        if err < best[0]:
            best = (err, s, i / n_grid)
    return best[1], best[2]


def top_p(probs, p, strict=False, renormalise=True):
    sp, order = probs.sort(-1, descending=True)
    drop = sp.cumsum(-1) > p if strict else (sp.cumsum(-1) - sp) >= p  # strict: one token too few
    kept = torch.zeros_like(probs).scatter(-1, order, sp.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True) if renormalise else kept


GALLERY = [
    ("forward_flops_bytes", cost_weights_per_token, "read once per forward"),
    ("forward_flops_bytes", cost_no_attention, "attention's FLOPs are missing"),
    ("kv_cache_size", kv_without_2, "the factor 2"),
    ("kv_cache_size", kv_with_n_heads, "n_kv_heads heads, not n_heads"),
    ("cache_update", update_only_new, "not only the new ones"),
    ("cache_update", update_at_zero, "not 0..T-1"),
    ("cache_update", update_not_in_place, "write into k_cache itself"),
    ("rope_at_offset", rope_restarting_at_zero, "positions restart at 0 after the cache"),
    ("rope_at_offset", rope_interleaved, "rotates halves"),
    ("blocks_needed", blocks_with_extra, "an extra, empty block when num_tokens is a multiple of block_size"),
    ("slot_mapping", slots_without_table, "the block table is not used"),
    ("needs_new_block", new_block_off_by_one, "off by one"),
    ("append_token_cow", cow_no_copy, "copy a shared, partly filled block before writing"),
    ("append_token_cow", cow_no_decrement, "decrement its reference count"),
    ("append_token_cow", cow_copies_full_block, "a full block is never written again"),
    ("speculative_verify", lambda *a: verify(*a, normalise=False), "the residual is not normalised"),
    ("speculative_verify", lambda *a: verify(*a, bonus=False), "the bonus"),
    ("speculative_verify", lambda *a: verify(*a, residual=False), "draw from the residual"),
    ("gptq_quantize_columns", lambda *a, **k: gptq(*a, **k, damp=False), "dampen H first"),
    ("gptq_quantize_columns", lambda *a, **k: gptq(*a, **k, feedback=False), "no error feedback"),
    ("awq_search_scale", lambda *a: awq(*a, divide=False), "divide by s"),
    ("awq_search_scale", lambda *a: awq(*a, normalise=False), "normalise s by sqrt(max(s) * min(s))"),
    ("awq_search_scale", awq_unclamped, "clamp it at 1e-8"),
    ("top_p_filter", lambda probs, p: top_p(probs, p, strict=True), "one token too few"),
    ("top_p_filter", lambda probs, p: top_p(probs, p, renormalise=False), "renormalise"),
]


@pytest.mark.parametrize("name, fn, hint", GALLERY, ids=[f"{n}-{h[:24]}" for n, _, h in GALLERY])
def test_typical_wrong_answer_gets_its_hint(name, fn, hint):
    report, text = run(name, fn)
    assert not report.passed
    assert any(hint in f.hint for f in report.failures), text
    assert "Traceback" not in text and "AssertionError" not in text
    assert len(text.strip().splitlines()) >= len(report.results)  # a line (or a block) per case


def test_every_exercise_has_a_wrong_answer_in_the_gallery():
    from test_exercises_gallery_engine import GALLERY as ENGINE_GALLERY  # exercises 11-14

    assert {name for name, _, _ in GALLERY + ENGINE_GALLERY} == set(EXERCISES)


def test_a_function_that_raises_is_reported_in_words():
    def broken(config, batch_size, seq_len, dtype):
        return seq_len / 0

    report, text = run("kv_cache_size", broken)
    assert not report.passed and "Traceback" not in text
    assert "your function raised ZeroDivisionError: division by zero (line" in report.failures[0].got
    assert "return seq_len / 0" in report.failures[0].got  # the student's line, not the checker's


@pytest.mark.parametrize("answer, words", [
    (lambda probs, p: None, "did you forget `return`"),
    (lambda probs, p: probs[:, :-1], "has shape"),
    (lambda probs, p: probs.double(), "has dtype torch.float64"),
    (lambda probs, p: probs * float("nan"), "holds NaN"),
])
def test_wrong_shape_dtype_nan_or_none_get_plain_words(answer, words):
    report, text = run("top_p_filter", answer)
    assert not report.passed
    assert all(words in f.hint for f in report.failures), text


def test_unwritten_function_says_not_written_yet():
    def blank(num_tokens, block_size):
        raise NotImplementedError("write this function: blocks_needed")

    report, _ = run("blocks_needed", blank)
    assert not report.passed and all("not written yet" in f.hint for f in report.failures)


def test_an_answer_that_cannot_be_compared_is_reported():
    report, text = run("speculative_verify", lambda *a: ("zero", "probs"))
    assert not report.passed and "Traceback" not in text


def test_checks_are_deterministic():
    assert run("awq_search_scale", awq)[1] == run("awq_search_scale", awq)[1]


def test_unknown_exercise_names_the_exercises():
    with pytest.raises(KeyError, match="top_p_filter"):
        check("top_k", lambda: None)


# ---- every other mistake the README lists, written with the checkers' own variants -----------------
# (these confirm that each variant's hint is the one reported, not an earlier variant's or the generic one)

def _variants():
    from minillm.exercises import ex_cache, ex_cost, ex_quant, ex_sampling

    cost = ex_cost._cost
    return [
        ("forward_flops_bytes", lambda *a: cost(*a, causal=False), "count the causal triangle"),
        ("forward_flops_bytes", lambda *a: cost(*a, all_logits=False), "logits for every new token"),
        ("forward_flops_bytes", lambda *a: cost(*a, mac_flops=1), "a multiply-add is 2 FLOPs"),
        ("forward_flops_bytes", lambda *a: cost(*a, kv_heads=a[0].n_heads), "n_kv_heads heads, not n_heads"),
        ("forward_flops_bytes", lambda *a: cost(*a, new_kv=False), "new tokens' keys and values"),
        ("forward_flops_bytes", lambda *a: cost(*a, norms=False), "norm weights"),
        ("forward_flops_bytes", lambda *a: cost(*a, head=False), "output projection (vocab x dim) is read"),
        ("kv_cache_size", lambda c, B, L, d: 8 * EXERCISES["kv_cache_size"].reference(c, B, L, d), "bytes, not bits"),
        ("kv_cache_size", lambda c, B, L, d: EXERCISES["kv_cache_size"].reference(c, B, L, d) // c.n_layers,
         "multiply by n_layers"),
        ("cache_update", lambda k, v, kn, vn, s: (update_at_zero(k, v, kn, vn, s), (k, v))[1], "not the whole buffer"),
        ("cache_update", lambda *a: EXERCISES["cache_update"].reference(*a)[::-1], "keys and values are swapped"),
        ("rope_at_offset", lambda x, s, b: ex_cache._rope(x, torch.arange(s + 1, s + 1 + x.shape[2]), b), "off by one"),
        ("rope_at_offset", lambda x, s, b: ex_cache._rope(x, torch.arange(s, s + x.shape[2]), b, sign=-1), "wrong way"),
        ("rope_at_offset", lambda x, s, b: ex_cache._rope(x, torch.arange(s, s + x.shape[2]), b, exponent=1),
         "base^(-2i / D)"),
        ("rope_at_offset", lambda x, s, b: x.clone(), "nothing was rotated"),
        ("blocks_needed", lambda n, bs: n // bs, "round up, not down"),
        ("slot_mapping", lambda t, p, bs: torch.tensor(t)[p // bs] + p % bs, "multiply the physical block"),
        ("slot_mapping", lambda t, p, bs: torch.tensor(t)[p % bs] * bs + p // bs, "swapped"),
        ("needs_new_block", lambda n, bs: n > 0 and n % bs == 0, "the first token of an empty sequence"),
        ("append_token_cow", lambda *a: reference_append(*a, copy_sole=True), "only shared blocks are copied"),
        ("append_token_cow", lambda *a: reference_append(*a, new_ref=0), "set its reference count to 1"),
        ("speculative_verify", lambda *a: ex_sampling._wrong_verify(*a, ratio="draft/target"),
         "the target's probability on top"),
        ("speculative_verify", lambda *a: ex_sampling._wrong_verify(*a, count_rejected=True), "not the rejected one"),
        ("gptq_quantize_columns", lambda *a, **k: ex_quant._gptq(*a, **k, divide=False), "divide the column's error"),
        ("gptq_quantize_columns", lambda *a, **k: ex_quant._gptq(*a, **k, dead=False), "always zero has H[j, j] = 0"),
        ("gptq_quantize_columns", lambda *a, **k: ex_quant._gptq(*a, **k, inverse="plain"), "Cholesky factor"),
        ("awq_search_scale", lambda *a: ex_quant._awq(*a, magnitude="max"), "not the max"),
        ("awq_search_scale", lambda *a: ex_quant._awq(*a, power=-1.0), "not s_x^-alpha"),
        ("awq_search_scale", lambda *a: ex_quant._awq(*a, grid="closed"), "1 excluded"),
        ("top_p_filter", lambda probs, p: top_p(probs, p + 1e-6) if p < 1 else probs, "one token too many"),
        ("top_p_filter", lambda probs, p: top_p(probs, p).sort(-1, descending=True).values, "scatter the kept"),
    ]


VARIANTS = _variants()


@pytest.mark.parametrize("name, fn, hint", VARIANTS, ids=[f"{n}-{h[:24]}" for n, _, h in VARIANTS])
def test_each_listed_mistake_gets_its_own_hint(name, fn, hint):
    report, text = run(name, fn)
    assert not report.passed
    assert any(hint in f.hint for f in report.failures), text
