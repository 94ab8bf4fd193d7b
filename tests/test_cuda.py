"""Every technique on a CUDA GPU against the same code on the CPU, its baseline here.

Skipped where torch sees no GPU (CI's machines); run on a GPU machine with
``python -m pytest tests/test_cuda.py``. The tests named ``tiny`` need only the gguf package (a tiny
model written on the fly), the others the embedded model. ``MINILLM_TEST_DEVICE=cpu`` runs the same
checks with the CPU in the GPU's place (a dry run of the tests themselves).
"""

import copy
import os

import pytest
import torch
from helpers import random_decoder, rel_err, write_tiny_gguf

from minillm import LLM, KVCache, SamplingParams, generate_cached, generate_naive, load_model
from minillm.fast.compiled import compile_decode
from minillm.generation import generate_batch
from minillm.quant import Recipe
from minillm.quant.pipeline import calibration_tokens, quantize_model
from minillm.quant.qlinear import QuantLinear
from minillm.speculative import DraftModelProposer, NgramProposer, speculative_generate

DEVICE = os.environ.get("MINILLM_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="torch sees no CUDA GPU")

PROMPT = "The quick brown fox jumps over the lazy dog. Then the fox ran into the woods, and the dog"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def cuda_model(model_path):
    return load_model(model_path, device=DEVICE)[0]


def forward(model, ids):
    device = model.device
    with torch.inference_mode():
        return model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device))


def quant_layers(model):
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


# ---- tiny model (the gguf package only) ------------------------------------------------------------


def test_tiny_logits_and_generation_match_cpu(tiny_path):
    cpu, gpu = load_model(tiny_path)[0], load_model(tiny_path, device=DEVICE)[0]
    assert gpu.device.type == DEVICE.split(":")[0]
    ids = [5, 9, 200, 31, 7, 17, 4]
    assert rel_err(forward(gpu, ids), forward(cpu, ids)) < 1e-4
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [ids, [17, 4]]
    for cache, kv_dtype in (("contiguous", None), ("contiguous", "int8"), ("dynamic", None)):
        ref = [r.tokens for r in generate_batch(cpu, prompts, params, cache=cache, kv_dtype=kv_dtype)]
        assert [r.tokens for r in generate_batch(gpu, prompts, params, cache=cache, kv_dtype=kv_dtype)] == ref
    assert generate_naive(gpu, ids, params).tokens == generate_cached(gpu, ids, params).tokens


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_tiny_quantization_on_cuda_matches_cpu(tiny_path, method):
    """The same quantizer on both devices, and the int4 kernel on the GPU for every layer, agreeing
    with dequantize-then-matmul. RTN rounds each weight alone: the same weights on both devices. GPTQ
    carries each rounding's error into later columns and AWQ picks a scale from a grid of near-ties,
    so one rounding that differs between devices changes later choices: there the devices agree on
    the quality (each layer's output error, the logits' distance from the float model), measured on
    an H200 1-6% apart in the weights."""
    cpu, gpu = load_model(tiny_path)[0], load_model(tiny_path, device=DEVICE)[0]
    ids = [5, 9, 200, 31, 7]
    float_cpu, float_gpu = forward(cpu, ids), forward(gpu, ids)
    recipe = Recipe.of(method, bits=4, group_size=32)
    calib = None if method == "rtn" else torch.randint(1, 300, (4, 64), generator=torch.Generator().manual_seed(0))
    rep_cpu = quantize_model(cpu, recipe, calib, progress=False)
    rep_gpu = quantize_model(gpu, recipe, calib, progress=False)
    ql_cpu, ql_gpu = quant_layers(cpu), quant_layers(gpu)
    assert len(ql_gpu) == len(ql_cpu) > 0
    for a, b in zip(ql_cpu, ql_gpu, strict=True):
        assert b.qweight.device.type == DEVICE.split(":")[0] and b.fast, "the int4 kernel was not set up"
        x = torch.randn(3, b.in_features, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
        # bfloat16 activations in the kernel: ~3 significant digits
        assert rel_err(b(x), b.forward_reference(x)) < 1e-2
        if method == "rtn":
            assert rel_err(b.dequantize(), a.dequantize()) < 1e-5
    if method != "rtn":
        errors = [[layer["rel_error"] for layer in rep["layers"] if "rel_error" in layer] for rep in (rep_cpu, rep_gpu)]
        assert len(errors[1]) == len(errors[0]) == len(ql_gpu)
        assert errors[1] == pytest.approx(errors[0], rel=0.1)
    err_cpu, err_gpu = rel_err(forward(cpu, ids), float_cpu), rel_err(forward(gpu, ids), float_gpu)
    assert 0 < err_gpu < 0.5 and err_gpu == pytest.approx(err_cpu, rel=0.25)


def test_tiny_compiled_decode_on_cuda_matches_eager(tiny_path):
    gpu = load_model(tiny_path, device=DEVICE)[0]
    compiled = compile_decode(copy.deepcopy(gpu))
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    padded = [[5, 9, 200, 31, 7], [17, 4]]  # steps with a padding mask
    same = [[5, 9, 200, 31, 7], [8, 1, 44, 9, 3]]  # steps without a mask
    for prompts in (padded, same):
        for kv_dtype in (None, "int8"):
            ref = [r.tokens for r in generate_batch(gpu, prompts, params, kv_dtype=kv_dtype)]
            assert [r.tokens for r in generate_batch(compiled, prompts, params, kv_dtype=kv_dtype)] == ref


def test_tiny_engine_on_cuda_equals_generate_cached_on_cpu(tiny_path):
    """The continuous-batching engine (minillm.paged) on the GPU: mixed prompts through a pool small enough
    to preempt, each request's greedy tokens those generate_cached gives alone on the CPU."""
    cpu, gpu = load_model(tiny_path)[0], load_model(tiny_path, device=DEVICE)[0]
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(4 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    llm = LLM(gpu, block_size=4, num_blocks=16, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [generate_cached(cpu, p, params).tokens for p in prompts]
    assert llm.llm_engine.manager.num_free_blocks == 16


def test_tiny_engine_beam_search_on_cuda_equals_the_naive_search_on_cpu(tiny_path):
    """Beam search in the engine on the GPU (its scores meet the beams' cumulative log-probabilities on
    the model's device) against the naive search that recomputes every beam on the CPU."""
    from minillm.paged import BeamSearchParams, beam_search_naive

    cpu, gpu = load_model(tiny_path)[0], load_model(tiny_path, device=DEVICE)[0]
    prompt, params = [5, 9, 200, 31, 7], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    got = LLM(gpu, block_size=4, num_blocks=32).beam_search([{"prompt_token_ids": prompt}], params)[0]
    ref = beam_search_naive(cpu, prompt, params)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in ref.sequences]
    assert [s.cum_logprob for s in got.sequences] == pytest.approx([s.cum_logprob for s in ref.sequences], abs=1e-3)


def test_tiny_engine_seeded_samples_and_prefix_hits_on_cuda(tiny_path):
    """Seeded n > 1 on the GPU: the same tokens alone as in a batch, and again on a prefix-cache hit."""
    gpu = load_model(tiny_path, device=DEVICE)[0]
    prompt = [(5 * j) % 250 + 1 for j in range(13)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=50.0, seed=3, n=3)
    other = SamplingParams(max_new_tokens=5, ignore_eos=True)
    llm = LLM(gpu, block_size=4, num_blocks=32)
    alone = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    batch = llm.generate([{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": prompt}], [other, params],
                         use_tqdm=False)[1]
    assert batch.num_cached_tokens == 12  # the first call's full blocks, found again
    assert [c.token_ids for c in batch.outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1
    assert llm.llm_engine.manager.num_free_blocks == 32


# ---- the embedded model ------------------------------------------------------------------------------


def test_logits_match_cpu(model, cuda_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    ref, out = forward(model, ids), forward(cuda_model, ids)
    assert out.device.type == DEVICE.split(":")[0]
    assert rel_err(out, ref) < 1e-3
    assert torch.equal(out[0, -1].argmax().cpu(), ref[0, -1].argmax())


def test_greedy_generation_matches_cpu(model, cuda_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ref = generate_cached(model, ids, params).tokens
    assert generate_cached(cuda_model, ids, params).tokens == ref
    assert generate_naive(cuda_model, ids, params).tokens == ref
    cache = KVCache(cuda_model.config, 1, 16, device=DEVICE)
    assert cache.k[0].device.type == DEVICE.split(":")[0]


@pytest.mark.parametrize("proposer_kind", ["ngram", "random draft model"])
def test_speculative_greedy_equals_target_on_cuda(cuda_model, tokenizer, proposer_kind):
    prompt = tokenizer.encode("The cat sat on the mat. The dog sat on the log. The cat sat on the")
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ref = generate_cached(cuda_model, prompt, params)
    proposer = (NgramProposer(cuda_model.config.vocab_size) if proposer_kind == "ngram"
                else DraftModelProposer(random_decoder(cuda_model.config.vocab_size).to(DEVICE), 256))
    out, stats = speculative_generate(cuda_model, proposer, prompt, params, num_speculative_tokens=4)
    assert out.tokens == ref.tokens
    assert 0 <= stats.acceptance_rate <= 1


def test_gptq_on_cuda(cuda_model, tokenizer):
    """GPTQ on the GPU (float64 Cholesky there) on the real model: every layer uses the int4 kernel, the
    per-layer output errors are those of a working 4-bit quantizer, and the logits stay close to the
    float model's. (The tiny-model test compares GPTQ on both devices.)"""
    calib = calibration_tokens(tokenizer, nsamples=2, seqlen=128)
    q = copy.deepcopy(cuda_model)
    report = quantize_model(q, Recipe.of("gptq", bits=4, group_size=64), calib, progress=False)
    errors = [layer["rel_error"] for layer in report["layers"]]
    assert len(errors) == 4 * cuda_model.config.n_layers and max(errors) < 0.3 and min(errors) > 0
    assert all(layer.fast for layer in quant_layers(q))
    ids = tokenizer.encode(PROMPT)
    assert rel_err(forward(q, ids), forward(cuda_model, ids)) < 0.5  # 4-bit: close to the float model
