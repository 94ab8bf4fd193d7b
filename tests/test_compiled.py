"""Compiled decode (minillm.fast.compiled) against the same model run eager: its baseline."""

import copy

import pytest
import torch
from helpers import TINY, rel_err, tiny_llama_weights, write_tiny_gguf

import minillm.fast.kernels
import minillm.fast.layers
from minillm import KVCache, SamplingParams, generate_cached, load_model
from minillm.fast import accelerate
from minillm.fast.compiled import compile_decode, is_compiled
from minillm.generation import decode_step, generate_batch, prefill
from minillm.quant import QuantLinear, Recipe
from minillm.quant.head import quantize_output
from minillm.quant.pipeline import quantize_model
from minillm.speculative.draft import self_draft


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path)
    return load_model(path)[0]


def step_logits(model, prompt, n, cache_cls=KVCache):
    """Greedy decode of n tokens; returns the tokens and each decode step's logits (n - 1, V)."""
    cache = cache_cls(model.config, 1, len(prompt) + n)
    logits = prefill(model, torch.tensor([prompt]), cache)
    tokens, steps = [int(logits.argmax())], []
    for i in range(n - 1):
        logits = decode_step(model, torch.tensor([[tokens[-1]]]), len(prompt) + i, cache)
        steps.append(logits[0])
        tokens.append(int(logits.argmax()))
    return tokens, torch.stack(steps)


def test_compiled_decode_matches_eager_on_the_embedded_model(model, tokenizer):
    # the embedded model's first 4 blocks (its real shapes, weights and output layer): inductor's compile
    # time grows with the traced blocks, and every block traces to the same code
    model = self_draft(model, 4)
    compiled = compile_decode(copy.deepcopy(model))
    assert is_compiled(compiled) and not is_compiled(model)
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. Then the fox")
    eager_tokens, eager_logits = step_logits(model, prompt, 12)
    tokens, logits = step_logits(compiled, prompt, 12)
    assert tokens == eager_tokens
    # float32 GEMMs summed in another order: logits of magnitude ~10-30 agree to ~1e-4
    assert (logits - eager_logits).abs().max() < 2e-3
    # a second generation with another cache size reuses the compiled code and still agrees
    params = SamplingParams(max_new_tokens=20)
    assert generate_cached(compiled, prompt[:5], params).tokens == generate_cached(model, prompt[:5], params).tokens


@pytest.mark.slow  # about a dozen inductor compiles (each cache, int8, padded and unpadded batches): minutes on 2 cores
def test_compiled_decode_batches_padding_and_int8_cache(tiny):
    compiled = compile_decode(copy.deepcopy(tiny))
    calls, inner = [], compiled.forward_layers.step
    compiled.forward_layers.step = lambda *args: calls.append(1) or inner(*args)
    prompts = [[5, 9, 200, 31, 7], [17, 4]]
    params = SamplingParams(max_new_tokens=8)
    for cache, kv_dtype in (("contiguous", None), ("contiguous", "int8"), ("dynamic", None)):
        eager = [r.tokens for r in generate_batch(tiny, prompts, params, cache=cache, kv_dtype=kv_dtype)]
        assert [r.tokens for r in generate_batch(compiled, prompts, params, cache=cache, kv_dtype=kv_dtype)] == eager
    # prompts of one length: no padding mask, so the steps take attention_decode (counted below)
    decode_calls = []
    spy = minillm.fast.layers.attention_decode
    minillm.fast.layers.attention_decode = lambda *a: decode_calls.append(1) or spy(*a)
    try:
        for kv_dtype in (None, "int8"):
            same = [[5, 9, 200], [17, 4, 8]]
            eager = [r.tokens for r in generate_batch(tiny, same, params, kv_dtype=kv_dtype)]
            assert [r.tokens for r in generate_batch(compiled, same, params, kv_dtype=kv_dtype)] == eager
    finally:
        minillm.fast.layers.attention_decode = spy
    assert decode_calls  # traced (once per layer and compilation), not called eagerly
    # sampling: same seed, same tokens
    sampled = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3)
    assert generate_cached(compiled, prompts[0], sampled).tokens == generate_cached(tiny, prompts[0], sampled).tokens
    assert len(calls) == 5 * 7 + 7  # every decode step took the compiled path (the first token is prefill's)


@pytest.mark.slow  # torch.compile traces for seconds (test_kernels.py keeps a compiled kernel in make test-fast)
def test_prefill_and_gradients_stay_eager(tiny):
    compiled = compile_decode(copy.deepcopy(tiny))
    calls, inner = [], compiled.forward_layers.step
    compiled.forward_layers.step = lambda *args: calls.append(1) or inner(*args)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    pos = torch.arange(6)
    with torch.inference_mode():
        assert torch.equal(compiled(tokens, pos), tiny(tokens, pos))  # T > 1: the eager path, bit for bit
    # with gradients enabled a one-token forward is eager too (frozen weights cannot take gradients)
    cache_a, cache_b = KVCache(tiny.config, 1, 8), KVCache(tiny.config, 1, 8)
    with torch.no_grad():
        compiled(tokens, pos, cache_a), tiny(tokens, pos, cache_b)
    one = torch.tensor([[2]])
    assert torch.equal(compiled(one, torch.tensor([6]), cache_a), tiny(one, torch.tensor([6]), cache_b))
    assert calls == []
    with torch.inference_mode():  # the same one-token forward without gradients is compiled
        compiled(one, torch.tensor([7]), cache_a)
    assert calls == [1]


@pytest.mark.slow  # two inductor compiles (the second with the cached length symbolic)
def test_compiled_decode_in_the_paged_engine_calls_the_fused_attention_op(tiny):
    """A lone sequence's one-token steps in the engine run the compiled forward, whose attention over the pool is
    minillm's fused kernel (a torch.library op inside the graph) where it is built; same tokens as eager."""
    from minillm.paged import LLMEngine

    outs = []
    for model in (tiny, compile_decode(copy.deepcopy(tiny))):
        engine = LLMEngine(model, block_size=4, num_blocks=32)
        engine.add_request("a", {"prompt_token_ids": [3, 1, 4, 1, 5]}, SamplingParams(max_tokens=6, ignore_eos=True))
        while engine.has_unfinished_requests():
            done = [o for o in engine.step() if o.finished]
        outs.append(done[0].outputs[0].token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 6


def test_copies_are_not_compiled_and_quantizing_drops_it(tiny):
    compiled = compile_decode(copy.deepcopy(tiny))
    twin = copy.deepcopy(compiled)
    assert is_compiled(compiled) and not is_compiled(twin)
    quantize_model(compiled, Recipe.of("rtn", bits=4, group_size=32), progress=False)
    assert not is_compiled(compiled)  # its frozen float weights would be stale


def test_compile_decode_rejects_what_it_cannot_compile(tiny):
    with pytest.raises(TypeError, match="Decoder"):
        compile_decode(torch.nn.Linear(4, 4))
    q = copy.deepcopy(tiny)
    q.layers[0].attn.wo = torch.nn.Linear(64, 64)  # a layer that does not declare `compilable`
    with pytest.raises(ValueError, match="Linear"):
        compile_decode(q)


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    """The tiny model with a vocabulary of 320 (the int4 kernel packs output rows by 16), every linear layer
    4-bit (RTN, group 32) and the tied output layer / embedding too: the 4-bit decode path."""
    cfg = {**TINY, "vocab": 320}
    path = tmp_path_factory.mktemp("tiny4") / "tiny.gguf"
    write_tiny_gguf(path, tiny_llama_weights(cfg=cfg), cfg=cfg)
    model = load_model(path)[0]
    quantize_model(model, Recipe.of("rtn", bits=4, group_size=32), progress=False)
    quantize_output(model, "int4")
    return accelerate(model)  # the quantized layers take minillm's kernels


@pytest.mark.slow  # torch.compile traces for seconds
def test_compiled_4bit_decode_matches_eager(tiny_int4):
    assert all(m.fast for m in tiny_int4.modules() if isinstance(m, QuantLinear))
    compiled = compile_decode(copy.deepcopy(tiny_int4))
    calls, inner = [], compiled.forward_layers.step
    compiled.forward_layers.step = lambda *args: calls.append(1) or inner(*args)
    prompt = [5, 9, 200, 31, 7]
    eager_tokens, eager_logits = step_logits(tiny_int4, prompt, 10)
    tokens, logits = step_logits(compiled, prompt, 10)
    assert len(calls) == 9  # every decode step took the compiled path
    assert tokens == eager_tokens
    # both run the int4 kernel's bfloat16 products; inductor's template sums in another order
    assert rel_err(logits, eager_logits) < 2e-2
    params = SamplingParams(max_new_tokens=12)
    assert generate_cached(compiled, [17, 4], params).tokens == generate_cached(tiny_int4, [17, 4], params).tokens


@pytest.mark.skipif(not minillm.fast.kernels.available(), reason="minillm's kernels are not built here")
def test_compile_decode_takes_torchs_kernels_where_inductor_has_a_template(tiny_int4, monkeypatch):
    for capability, expected in (("AVX512", "torch-int4"), ("AVX2", "minillm-int4")):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        model = compile_decode(copy.deepcopy(tiny_int4))  # compiles at the first step: only the choice is made here
        layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert {m.compiled_kernel for m in layers} == {expected}
        assert {m.kernel for m in layers} == {"minillm-int4"}  # eager forwards (prefill) keep minillm's float32 ones
        tokens, pos = torch.tensor([[5, 9, 200, 31]]), torch.arange(4)
        assert torch.equal(model(tokens, pos), tiny_int4(tokens, pos))  # a prefill: the eager path, bit for bit
        assert {m.compiled_kernel for m in copy.deepcopy(model).modules() if isinstance(m, QuantLinear)} == {expected}
    assert {m.compiled_kernel for m in tiny_int4.modules() if isinstance(m, QuantLinear)} == {"minillm-int4"}
