"""Generation: naive vs cached vs transformers, the KV cache's positions, sampling and stopping."""

import pytest
import torch

from minillm import KVCache, SamplingParams, generate, generate_cached, generate_naive, logits_to_probs, sample
from minillm.generation import decode_step, prefill
from minillm.kv_cache import kv_cache_bytes

GREEDY_64 = SamplingParams(max_new_tokens=64, ignore_eos=True)


def hf_greedy(hf_model, ids, n):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("prompt", ["Once upon a time", "def fibonacci(n):", "The capital of Japan is"])
def test_greedy_naive_cached_and_transformers_agree(model, tokenizer, hf_model, prompt):
    ids = tokenizer.encode(prompt)
    cached = generate_cached(model, ids, GREEDY_64)
    naive = generate_naive(model, ids, GREEDY_64)
    assert len(cached.tokens) == 64
    assert cached.tokens == naive.tokens == hf_greedy(hf_model, ids, 64)


def test_prompt_filling_most_of_the_context(model, tokenizer, hf_model, play_text):
    max_seq_len = 160
    longer = tokenizer.encode(play_text[20000:])[:98]
    ids = longer[:94]  # 94 + 64 = 158 of 160 positions
    cached = generate_cached(model, ids, GREEDY_64, max_seq_len=max_seq_len)
    naive = generate_naive(model, ids, GREEDY_64, max_seq_len=max_seq_len)
    assert cached.tokens == naive.tokens == hf_greedy(hf_model, ids, 64)
    # two more than fit: generation stops at the context's end
    full = generate_cached(model, longer, GREEDY_64, max_seq_len=max_seq_len)
    assert len(full.tokens) == 62 and full.finish_reason == "length"


def test_prompt_longer_than_context_raises(model):
    with pytest.raises(ValueError, match="prompt: 300 tokens do not fit the context of 256"):
        generate_cached(model, [5] * 300, GREEDY_64, max_seq_len=256)
    with pytest.raises(ValueError, match="prompt: is empty"):
        generate_naive(model, [], GREEDY_64)


def test_cache_logits_equal_recomputation_and_rollback(model, tokenizer):
    ids = tokenizer.encode("To be, or not to be, that is the question")
    seq = torch.tensor([ids])
    full = model(seq, torch.arange(len(ids)))  # (1, T, V) without a cache
    cache = KVCache(model.config, 1, 64)
    p = 6
    logits = [prefill(model, seq[:, :p], cache)]
    for i in range(p, len(ids)):
        logits.append(decode_step(model, seq[:, i:i + 1], i, cache))
    torch.testing.assert_close(torch.stack(logits[:-1], 1), full[:, p - 1:-1], rtol=1e-4, atol=1e-4)
    assert cache.seq_len == len(ids)
    # roll back three positions (as for rejected speculative tokens) and decode them again
    cache.truncate(len(ids) - 3)
    again = decode_step(model, seq[:, -3:-2], len(ids) - 3, cache)
    torch.testing.assert_close(again, full[:, -3], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="input_pos: starts at 20 but the cache holds only"):
        decode_step(model, seq[:, :1], 20, cache)
    with pytest.raises(ValueError, match="n: cannot truncate"):
        cache.truncate(cache.seq_len + 1)


def test_cache_bytes_formula_matches_tensors(model):
    cache = KVCache(model.config, batch_size=2, max_seq_len=100)
    assert cache.nbytes == kv_cache_bytes(model.config, 2, 100, 4) == 2 * 2 * 100 * 30 * 3 * 64 * 4
    with pytest.raises(ValueError, match="max_seq_len"):
        KVCache(model.config, 1, 10_000)


@pytest.mark.parametrize("field,value", [("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
                                         ("max_new_tokens", 0), ("temperature", float("nan")),
                                         ("temperature", float("inf")), ("top_k", 2.5), ("seed", 2**70),
                                         ("stop", [1]), ("stop", None), ("seed", True), ("temperature", "hot"),
                                         ("top_p", 10**400), ("temperature", 10**400)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


def test_sampling_params_take_numpy_scalars():
    import numpy as np

    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int64(7))
    assert (p.temperature, p.top_k, p.seed) == (0.5, 3, 7) and type(p.top_k) is int and type(p.seed) is int


def test_logits_to_probs():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0)), torch.softmax(logits, -1))
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=0.5)), torch.softmax(logits * 2, -1))
    assert logits_to_probs(logits, SamplingParams()).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    top2 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    e = torch.exp(torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(top2, torch.tensor([[*(e / e.sum()).tolist(), 0.0, 0.0]]))
    # softmax = [0.644, 0.237, 0.087, 0.032]: top_p 0.7 keeps the first two (0.644 < 0.7 <= 0.881)
    p = torch.softmax(logits, -1)[0]
    top_p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(top_p, torch.tensor([[p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1]), 0.0, 0.0]]))
    assert logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5)).tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.tensor([[1.0, 0.5, 0.0, -3.0]]).expand(20000, 4)
    params = SamplingParams(temperature=0.8, top_k=3, seed=0)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample(logits, params, g), minlength=4).float() / 20000
    expected = logits_to_probs(logits[:1], params)[0]
    assert counts[3] == 0  # outside top-k
    assert (counts - expected).abs().max() < 0.015  # ~4.5 standard deviations at n = 20000


def test_seeded_sampling_is_reproducible(model, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=1234, ignore_eos=True)
    a = generate_cached(model, ids, params)
    b = generate_cached(model, ids, params)
    c = generate_cached(model, ids, SamplingParams(**{**params.__dict__, "seed": 99}))
    assert a.tokens == b.tokens and a.tokens != c.tokens
    # the naive path draws the same tokens from the same seed
    assert generate_naive(model, ids, params).tokens == a.tokens


def test_chat_stops_at_eos(model, tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    r = generate_cached(model, ids, SamplingParams(max_new_tokens=40), tokenizer=tokenizer)
    assert r.finish_reason == "eos" and r.tokens[-1] == tokenizer.eos_id
    assert r.text == "The capital of France is Paris."


def test_stop_strings(model, tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    r = generate(model, ids, SamplingParams(max_new_tokens=40, stop=(" Paris", "Berlin")), tokenizer=tokenizer,
                 cache="none")
    assert r.finish_reason == "stop" and r.text == "The capital of France is"
    with pytest.raises(ValueError, match="stop: stop strings need a tokenizer"):
        generate_cached(model, ids, SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match="cache: 'paged'"):
        generate(model, ids, cache="paged")


def test_streaming_callback_sees_every_token(model, tokenizer):
    seen = []
    r = generate_cached(model, tokenizer.encode("Hello"), SamplingParams(max_new_tokens=8, ignore_eos=True),
                        on_token=seen.append)
    assert seen == r.tokens and len(r.step_s) == 8 and r.decode_tokens_per_s > 0


def test_tiny_temperature_is_greedy_not_nan():
    logits = torch.tensor([[3.0, 1.0, -2.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1e-40))
    assert probs.tolist() == [[1.0, 0.0, 0.0]]
