"""The library in plain torch against the speed layer swapped into it: the same greedy tokens, the same as
transformers', and a forward (and an engine request) on the plain model that never reaches minillm/fast/."""

import copy

import pytest
import torch
from helpers import random_decoder

from minillm import LLM, SamplingParams, generate_cached, load_model
from minillm.fast import accelerate
from minillm.fast.layers import FastAttention, FastBlock, FastMLP, FastRMSNorm
from minillm.fast.linear import FastLinear
from minillm.linear import Linear
from minillm.model import Attention, Block, RMSNorm
from tools import walk

PROMPTS = ["Once upon a time", "def fibonacci(n):", "The capital of Japan is", "To be, or not to be, that is"]
GREEDY_32 = SamplingParams(max_new_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(model_path):
    return load_model(model_path, fast=False)[0]


@pytest.mark.slow
def test_plain_and_fast_models_give_the_same_greedy_tokens_as_transformers(plain, model, tokenizer, hf_model):
    from test_generate import hf_greedy

    assert not plain.accelerated and model.accelerated
    assert {type(m) for m in plain.modules()} & {FastLinear, FastRMSNorm, FastAttention, FastBlock, FastMLP} == set()
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        fast = generate_cached(model, ids, GREEDY_32).tokens
        assert generate_cached(plain, ids, GREEDY_32).tokens == fast == hf_greedy(hf_model, ids, 32), prompt


@pytest.mark.slow
def test_the_engine_serves_both_models_alike(plain, model, tokenizer):
    """The plain engine path ("blockwise": the online softmax in torch) and the fast one ("bucketed": the fused
    kernels and grouped SDPA) give the same greedy tokens for a batch of requests."""
    outs = {}
    for name, m in (("plain", plain), ("fast", model)):
        llm = LLM(m, tokenizer=tokenizer)
        assert llm.llm_engine.cache.attention == ("blockwise" if name == "plain" else "bucketed")
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=32,
                                                                                          ignore_eos=True),
                                                                   use_tqdm=False)]
    assert outs["plain"] == outs["fast"]


def test_accelerate_swaps_every_layer_and_keeps_the_logits():
    plain = random_decoder(320, head_dim=16)
    fast = accelerate(copy.deepcopy(plain), n_shards=2)
    assert fast.accelerated and fast.paged_backend == "bucketed"
    assert not any(type(m) in (Linear, RMSNorm, Attention, Block) for m in fast.modules())
    assert all(m.n_shards == 2 for m in fast.modules() if isinstance(m, FastLinear))
    tokens = torch.randint(0, 320, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(fast(tokens, torch.arange(7)), plain(tokens, torch.arange(7)), rtol=1e-5,
                                   atol=1e-5)
    assert accelerate(fast) is fast  # again: nothing changes
    assert all(m.n_shards == 2 for m in fast.modules() if isinstance(m, FastLinear))


@pytest.mark.slow
def test_a_plain_forward_reads_two_files_and_nothing_of_the_speed_layer():
    files = walk.walk_forward()
    assert set(files) == {"minillm/model.py", "minillm/linear.py"}, files
    assert sum(files.values()) <= 700


@pytest.mark.slow
def test_a_plain_request_reaches_the_online_softmax_and_nothing_of_the_speed_layer():
    calls = []
    import minillm.paged.attention as attention

    real = attention.paged_attention
    attention.paged_attention = lambda *a: calls.append(1) or real(*a)
    try:
        files = walk.walk_generate_plain()
    finally:
        attention.paged_attention = real
    assert calls, "the plain engine never ran paged/attention.py's online softmax"
    assert not [f for f in files if f.startswith("minillm/fast/")], files
    assert "minillm/paged/attention.py" in files
    assert sum(files.values()) <= 3000, files


def test_plain_copy_gives_back_the_library_layers_and_the_same_logits():
    from minillm.fast import plain_copy

    plain = random_decoder(320, head_dim=16)
    fast = accelerate(copy.deepcopy(plain), n_shards=2)
    back = plain_copy(fast)
    assert not back.accelerated and back.paged_backend == "blockwise" and not back._forward_pre_hooks
    assert {type(m) for m in back.modules()} == {type(m) for m in plain.modules()}
    assert fast.accelerated and isinstance(fast.output, FastLinear)  # the original is untouched
    tokens = torch.randint(0, 320, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(back(tokens, torch.arange(9)), plain(tokens, torch.arange(9)))
