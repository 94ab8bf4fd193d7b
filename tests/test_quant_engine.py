"""A quantized model served by the engine: ``LLM(path)`` on a file written by ``python -m minillm quantize``
(int4 RTN / GPTQ / AWQ with the int8 output layer) and on a GGUF our writer made, greedy-equal to
``generate_cached`` on the same quantized model alone, through preemption and prefix-cache hits.

The oracle is the quantized model's own decode path, not float: the int4 kernels round differently. The
int8 head returns bfloat16 logits, so two candidates can tie exactly; at a tie the engine (whose
attention sums in another order) may pick the other one. ``assert_greedy_equal`` accepts a divergence
only there, and checks it against a recompute of the quantized model.
"""

import pytest
import torch
from helpers import write_tiny_gguf

from minillm import LLM, SamplingParams, generate_cached, load_model
from minillm.data import play_text
from minillm.formats.gguf_quant import write_gguf
from minillm.quant.checkpoint import save_quantized
from minillm.quant.pipeline import quantize_model
from minillm.quant.qlinear import QuantLinear
from minillm.quant.recipe import Recipe

V = 300
SYSTEM_LEN, BLOCK = 16, 4


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def requests(seed=0):
    """A shared 16-token system prompt (four full blocks of 4) and six user parts; output lengths vary."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(1, V, (SYSTEM_LEN,), generator=g).tolist()
    users = [torch.randint(1, V, (n,), generator=g).tolist() for n in (5, 11, 3, 17, 8, 2)]
    return [system + u for u in users], [greedy(n) for n in (9, 4, 14, 6, 11, 7)]


def tie_tolerance(logits: torch.Tensor) -> float:
    """Two bfloat16 steps at the largest logit: the output precision of the int8 head's kernel."""
    top = logits.abs().max().item()
    return 2 * 2.0 ** (torch.tensor(top).log2().floor().item() - 7)


def assert_greedy_equal(model, prompt, engine_tokens, alone_tokens):
    """The engine's tokens equal the ones alone, or they part where the quantized model's two picks tie."""
    if engine_tokens == alone_tokens:
        return True
    k = next(i for i, (a, b) in enumerate(zip(engine_tokens, alone_tokens)) if a != b)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + alone_tokens[:k]]), torch.arange(len(prompt) + k))[0, -1]
    gap = abs(logits[engine_tokens[k]] - logits[alone_tokens[k]]).item()
    assert gap <= tie_tolerance(logits), f"the engine parts from generate_cached at token {k} without a tie ({gap})"
    return False


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant_engine") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def quantized_file(src, folder, method, quant_head="int8"):
    """``src`` quantized with ``method`` (int4, groups of 32) and its head, saved as the command saves it."""
    model, _ = load_model(src)
    torch.manual_seed(0)
    calib = None if method == "rtn" else torch.randint(1, V, (4, 32))
    recipe = Recipe.of(method, bits=4, group_size=32, quant_head=quant_head)
    report = quantize_model(model, recipe, calib, progress=False)
    return save_quantized(model, folder / f"{method}.safetensors", report, tokenizer_source=str(src))


def serve_and_compare(path, attention="bucketed"):
    """Six requests through a pool of 14 blocks (preemption) sharing a system prompt (prefix hits)."""
    prompts, params = requests()
    llm = LLM(path, block_size=BLOCK, num_blocks=14, max_num_batched_tokens=12, attention=attention,
              disable_log_stats=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.stats.summary(BLOCK)
    exact = [assert_greedy_equal(llm.model, p, list(o.outputs[0].token_ids), generate_cached(llm.model, p, sp).tokens)
             for p, sp, o in zip(prompts, params, outs)]
    assert [len(o.outputs[0].token_ids) for o in outs] == [sp.max_tokens for sp in params]
    assert llm.llm_engine.manager.num_free_blocks == 14
    return llm, stats, exact


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_llm_serves_an_int4_file_greedy_equal_to_its_own_decode(tiny_gguf, tmp_path, method):
    path = quantized_file(tiny_gguf, tmp_path, method)
    llm, stats, exact = serve_and_compare(path)
    assert isinstance(llm.model.output, QuantLinear) and llm.model.output.config.bits == 8
    assert all(isinstance(b.attn.wqkv, QuantLinear) and b.attn.wqkv.fast for b in llm.model.layers)
    assert stats["preemptions"] > 0 and stats["prefix_hit_rate"] > 0
    assert sum(exact) >= 4  # ties are rare: most requests are equal token for token


@pytest.mark.parametrize("attention", ["indexed", "blockwise", "fused"])
def test_other_attention_paths_serve_the_int4_file(tiny_gguf, tmp_path, attention):
    _, _, exact = serve_and_compare(quantized_file(tiny_gguf, tmp_path, "rtn"), attention)
    assert sum(exact) >= 4  # as on the default path: ties are rare, most requests equal their own decode


def test_int4_file_with_a_float_head_is_equal_token_for_token(tiny_gguf, tmp_path):
    _, _, exact = serve_and_compare(quantized_file(tiny_gguf, tmp_path, "rtn", quant_head="none"))
    assert all(exact)


def test_llm_serves_a_gguf_our_writer_made(tiny_gguf, tmp_path):
    out = write_gguf(tiny_gguf, tmp_path / "tiny-q4_0.gguf", "q4_0")
    llm, stats, exact = serve_and_compare(out)
    assert all(exact) and stats["preemptions"] > 0 and stats["prefix_hit_rate"] > 0
    float_model, _ = load_model(tiny_gguf)
    assert not torch.equal(llm.model.layers[0].attn.wqkv.weight, float_model.layers[0].attn.wqkv.weight)


@pytest.mark.slow
def test_embedded_model_int4_rtn_in_the_engine(tmp_path, model_path, tokenizer):
    path = quantized_file(model_path, tmp_path, "rtn")
    system = tokenizer.encode(play_text("hamlet"))[:40]  # two full blocks of 16 shared by every prompt
    prompts = [system + tokenizer.encode(q) for q in ("The history of", "Once upon a time", "To be, or not to be")]
    params = [greedy(n) for n in (12, 8, 10)]
    llm = LLM(path, num_blocks=6, max_num_batched_tokens=16, disable_log_stats=False)  # chunks: later prompts find the first one's blocks
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.stats.summary(16)
    assert stats["preemptions"] > 0 and stats["prefix_hit_rate"] > 0
    for p, sp, o in zip(prompts, params, outs):
        assert_greedy_equal(llm.model, p, list(o.outputs[0].token_ids), generate_cached(llm.model, p, sp).tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_int4_file_on_cuda(tiny_gguf, tmp_path):
    path = quantized_file(tiny_gguf, tmp_path, "rtn")
    prompts, params = requests()
    llm = LLM(path, device="cuda", block_size=BLOCK, num_blocks=14, max_num_batched_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.model.layers[0].attn.wqkv.qweight.is_cuda
    for p, sp, o in zip(prompts, params, outs):
        assert_greedy_equal(llm.model, p, list(o.outputs[0].token_ids), generate_cached(llm.model, p, sp).tokens)
