"""The three decode paths (no cache, dynamic, static), int8 KV, batched rows, RoPE offsets."""

import pytest
import torch

from minillm import SamplingParams, generate_cached
from minillm.data import HELD_OUT_PLAY, play_text
from minillm.evaluation import perplexity
from minillm.generation import generate, generate_batch
from minillm.kv_cache import DynamicKVCache, Int8KVCache, KVCache, dequantize_int8, kv_cache_bytes, make_cache, quantize_int8

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("kind", ["dynamic", "contiguous"])
def test_cached_logits_equal_recomputation_at_every_step(model, tokenizer, kind):
    ids = tokenizer.encode("Now is the winter of our discontent made glorious summer by this sun of York")
    seq = torch.tensor([ids])
    full = model(seq, torch.arange(len(ids)))  # (1, T, V): the naive path's logits at every position
    cache = make_cache(kind, model.config, 1, 64)
    p = 4
    steps = [model(seq[:, :p], torch.arange(p), cache)[:, -1]]
    for i in range(p, len(ids)):
        steps.append(model(seq[:, i:i + 1], torch.tensor([i]), cache)[:, -1])
    torch.testing.assert_close(torch.stack(steps[:-1], 1), full[:, p - 1:-1], rtol=1e-4, atol=2e-4)


def test_three_paths_same_greedy_tokens(model, tokenizer):
    ids = tokenizer.encode("The old man and the sea")
    outs = {c: generate(model, ids, GREEDY, cache=c).tokens for c in ("none", "dynamic", "contiguous")}
    assert outs["none"] == outs["dynamic"] == outs["contiguous"] and len(outs["none"]) == 24


def test_dynamic_cache_grows_and_rolls_back(model):
    cache = DynamicKVCache(model.config, 1, 32)
    assert cache.nbytes == 0
    model(torch.tensor([[5, 6, 7]]), torch.arange(3), cache)
    assert cache.seq_len == 3 and cache.nbytes == kv_cache_bytes(model.config, 1, 3, 4)
    cache.truncate(1)
    assert cache.nbytes == kv_cache_bytes(model.config, 1, 1, 4)
    with pytest.raises(ValueError, match="can only append at 1"):
        model(torch.tensor([[5]]), torch.tensor([2]), cache)


def test_batched_rows_equal_single_prompts(model, tokenizer):
    prompts = [tokenizer.encode(t) for t in ("Hi", "The three witches met on the heath and spoke of Macbeth",
                                             "1, 2, 3, 4,")]
    alone = [generate_cached(model, p, GREEDY).tokens for p in prompts]
    for cache in ("contiguous", "dynamic", "none"):
        batch = generate_batch(model, prompts, GREEDY, cache=cache)
        assert [r.tokens for r in batch] == alone, cache


def test_left_padding_positions_and_cache_reuse(model, tokenizer):
    """A padded row's logits equal the unpadded prompt's; a reset cache serves a second request."""
    ids = tokenizer.encode("To be, or not to be")
    alone = model(torch.tensor([ids]), torch.arange(len(ids)))[0, -1]
    pad = 5
    cache = KVCache(model.config, 1, 64)
    padded = torch.tensor([[0] * pad + ids])
    out = model(padded, torch.arange(pad + len(ids)), cache, pad_lengths=torch.tensor([pad]))[0, -1]
    torch.testing.assert_close(out, alone, rtol=1e-4, atol=2e-4)
    cache.reset()  # second request in the same memory: positions start again at 0
    again = model(torch.tensor([ids]), torch.arange(len(ids)), cache)[0, -1]
    torch.testing.assert_close(again, alone, rtol=1e-4, atol=2e-4)


def test_int8_round_trip_error_bound():
    x = torch.randn(2, 3, 50, 64, generator=torch.Generator().manual_seed(0)) * 4
    codes, scale = quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.shape == (2, 3, 50, 1)
    err = (dequantize_int8(codes, scale, torch.float32) - x).abs()
    assert (err <= scale / 2 + 1e-6).all()  # round to nearest: at most half a step
    assert torch.equal(codes.abs().amax(-1), torch.full((2, 3, 50), 127, dtype=torch.int8))


def test_int8_cache_memory_and_greedy(model, tokenizer):
    c8 = Int8KVCache(model.config, 1, 1000)
    half = kv_cache_bytes(model.config, 1, 1000, 2)
    assert c8.nbytes == kv_cache_bytes(model.config, 1, 1000, 1) + 2 * 30 * 3 * 1000 * 4
    assert c8.nbytes / half == pytest.approx((64 + 4) / 128)  # ~0.53 of float16
    ids = tokenizer.encode("Once upon a time")
    r8 = generate(model, ids, GREEDY, kv_dtype="int8")
    ref = generate_cached(model, ids, GREEDY)
    assert sum(a == b for a, b in zip(r8.tokens, ref.tokens)) >= 20  # nearly always the same argmax
    with pytest.raises(ValueError, match="kv_dtype: int8 is implemented for the contiguous cache only"):
        generate(model, ids, GREEDY, cache="dynamic", kv_dtype="int8")


def test_int8_cache_perplexity_cost_is_small(model, tokenizer):
    tokens = tokenizer.encode(play_text(HELD_OUT_PLAY))
    ref = perplexity(model, tokens, seqlen=256, max_tokens=512)
    q = perplexity(model, tokens, seqlen=256, max_tokens=512,
                   make_cache=lambda: Int8KVCache(model.config, 1, 256))
    assert ref["tokens"] == q["tokens"] == 2 * 255
    assert 3 < ref["perplexity"] < 100  # a 135M model on Shakespeare
    assert abs(q["perplexity"] / ref["perplexity"] - 1) < 0.01
