"""The cost model, checked by hand on a tiny config, on the article's 70B example, and on real tensors."""

import pytest
import torch
from helpers import random_decoder

from minillm import KVCache, ModelConfig
from minillm.roofline import (
    HARDWARE, LLAMA2_70B, decode_cost, decode_time_lower_bound, forward_cost, linear_params, prefill_cost,
)

TINY = ModelConfig(arch="llama", n_layers=2, dim=8, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=16, vocab_size=10,
                   max_seq_len=32)


def test_tiny_config_by_hand():
    # per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192; gate, up, down 3 x 8 x 16 = 384 -> 576; head 10 x 8
    assert linear_params(TINY) == (576, 80)
    c = decode_cost(TINY, batch_size=1, context=3)
    # linear: 2 layers x 2 x 576; attention: 2 layers x 4 x (1 query x 4 keys) x 2 heads x 4 dims; head 2 x 80
    assert c.flops == 2 * 2 * 576 + 2 * 4 * 4 * 2 * 4 + 2 * 80 == 2720
    # weights (2 x 576 + 80 + 5 norms x 8) x 4 bytes; KV read 3 positions + written 1, K and V, 1 head of 4
    assert c.weight_bytes == (1152 + 80 + 40) * 4 == 5088
    assert c.kv_bytes == 2 * 3 * 2 * 1 * 4 * 4 + 2 * 1 * 2 * 1 * 4 * 4 == 256
    assert c.intensity == pytest.approx(2720 / 5344)


def test_batch_shares_weight_reads():
    one, eight = decode_cost(TINY, 1, 3), decode_cost(TINY, 8, 3)
    assert eight.weight_bytes == one.weight_bytes
    assert eight.kv_bytes == 8 * one.kv_bytes and eight.flops == 8 * one.flops
    assert eight.intensity / one.intensity == pytest.approx(8 * 5344 / (5088 + 8 * 256))  # KV reads are not shared


def test_prefill_counts_the_causal_triangle():
    c = prefill_cost(TINY, prompt_tokens=5)
    full = forward_cost(TINY, 1, 5, 0)
    # causal: 5 * 6 / 2 = 15 query-key pairs instead of 25
    attn = lambda pairs: 2 * 4 * pairs * 2 * 4  # noqa: E731  (layers x 4 x pairs x heads x dim)
    assert full.flops - c.flops == attn(25) - attn(15)
    assert c.flops == 5 * 2 * 2 * 576 + attn(15) + 2 * 5 * 80


def test_time_is_the_larger_of_compute_and_memory():
    c = decode_cost(TINY, 1, 3)
    assert c.time(peak_flops=2720.0, bandwidth=5344.0 / 2) == pytest.approx(2.0)  # memory-bound
    assert c.time(peak_flops=2720.0 / 3, bandwidth=5344.0) == pytest.approx(3.0)  # compute-bound
    assert c.bound(1e12, 1e9) == "memory"


def test_article_example_70b_fp16_at_2_tb_per_s():
    t = decode_time_lower_bound(70e9, 2, 2e12)
    assert t == pytest.approx(0.07) and 1 / t == pytest.approx(14.3, abs=0.05)
    c = decode_cost(LLAMA2_70B, 1, 0, weight_bytes=2, kv_bytes=2)
    assert 68e9 < c.weight_bytes / 2 < 70e9  # Llama-2-70B: ~69B weights
    assert c.time(HARDWARE["H100 SXM"].flops["float16"], 2e12) == pytest.approx(0.069, abs=0.001)


def test_kv_bytes_match_real_cache_tensors(model):
    cache = KVCache(model.config, batch_size=3, max_seq_len=40)
    c = forward_cost(model.config, 3, 0, 40)  # reading a full cache of 40 positions, nothing new
    assert c.kv_bytes == cache.nbytes == sum(t.numel() for t in cache.k + cache.v) * 4
    assert c.flops == 0


def test_ridge_points():
    assert HARDWARE["H100 SXM"].ridge_point("float16") == pytest.approx(295, rel=0.01)
    assert HARDWARE["A100 80GB"].ridge_point("float16") == pytest.approx(153, rel=0.01)


def test_weights_of_embedded_model(model):
    from minillm.lab.decode import weight_bytes_per_token

    assert decode_cost(model.config, 1, 0).weight_bytes == weight_bytes_per_token(model)
    assert torch.float32 == model.dtype


def test_weight_read_covers_every_linear_weight_once(model):
    """The diagnostic read of the model's own weights counts exactly the linear layers' float32 bytes:
    the cost model's weight bytes less the norm weights (which a decode step also reads)."""
    from minillm.roofline import measure_weight_read

    read = measure_weight_read(model, repeats=1)
    c = model.config
    norms = (2 * c.n_layers + 1) * c.dim
    assert read["bytes"] == decode_cost(c, 1, 0).weight_bytes - 4 * norms
    assert read["seconds"] > 0 and read["bandwidth"] == pytest.approx(read["bytes"] / read["seconds"])


def test_compare_runs_any_model_and_refuses_what_it_cannot_measure():
    """A model of 300 ids and 128 positions (measurements draw ids from its own vocabulary)."""
    from minillm.roofline import Ceilings
    from minillm.roofline import compare

    small = random_decoder(300, max_seq_len=128)
    ceilings = Ceilings("cpu", 1e10, 1e10, {"float32": 1e11})
    rows = compare(small, ceilings, batch_sizes=(1, 2), prompt_lengths=(16,))
    assert [(r["kind"], r["batch_size"], r["tokens"]) for r in rows] == [("decode", 1, 1), ("decode", 2, 2),
                                                                          ("prefill", 1, 16)]
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in rows)
    with pytest.raises(ValueError, match="context 120 \\+ 16 decode steps \\+ 1: 137 positions do not fit"):
        compare(small, ceilings, context=120)
    with pytest.raises(ValueError, match="prompt_tokens: 200 positions do not fit the model's context of 128"):
        compare(small, ceilings, batch_sizes=(), prompt_lengths=(200,))
    with pytest.raises(ValueError, match="batch_size: must be >= 1, got 0"):
        compare(small, ceilings, batch_sizes=(0,))
    with pytest.raises(ValueError, match="ceilings: no matmul peak measured for float32"):
        compare(small, Ceilings("cpu", 1e10, 1e10), batch_sizes=(1,))
