"""Beam search in the engine (beams as forks of each other) against the naive beam search that recomputes
every beam, on a tiny random model (fast); against transformers on the embedded model (slow)."""

import pytest
import torch
from helpers import random_decoder

from minillm import LLM, BeamSearchParams, SamplingParams
from minillm.generation import generate_cached
from minillm.paged import beam_search_naive

V = 300


@pytest.fixture(scope="module")
def tiny():
    return random_decoder(V, scale=0.3)


def prompt(n, seed=0):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hyps(out, n_prompt):
    return [(s.tokens[n_prompt:], round(s.cum_logprob, 4)) for s in out.sequences]


def test_width_one_is_greedy(tiny):
    p = prompt(11)
    out = LLM(tiny, block_size=4, num_blocks=32).beam_search({"prompt_token_ids": p},
                                                              BeamSearchParams(1, 9, ignore_eos=True))[0]
    assert out.sequences[0].tokens[len(p):] == generate_cached(tiny, p, SamplingParams(max_tokens=9,
                                                                                        ignore_eos=True)).tokens


@pytest.mark.parametrize("width,eos,num_blocks", [(2, (), 64), (4, (), 64), (4, (7, 183), 64), (3, (), 20)])
def test_width_k_equals_naive_beam_search(tiny, width, eos, num_blocks):
    """With EOS ids the hypotheses close at different lengths; 20 blocks of 4 hold the three beams of one request
    just, beside a second request, so beams are preempted and recomputed."""
    ps = [prompt(10), prompt(6, seed=1)]
    params = BeamSearchParams(width, 12, ignore_eos=not eos, length_penalty=1.0)
    llm = LLM(tiny, block_size=4, num_blocks=num_blocks, eos_ids=set(eos), max_num_batched_tokens=8,
              disable_log_stats=False)
    got = llm.beam_search([{"prompt_token_ids": p} for p in ps], params)
    for out, p in zip(got, ps):
        ref = beam_search_naive(tiny, p, params, eos_ids=set(eos))
        assert hyps(out, len(p)) == hyps(ref, len(p))
    assert llm.llm_engine.manager.num_free_blocks == num_blocks  # dropped beams were freed
    saved = llm.llm_engine.stats.summary(4)["sharing_saved"]
    assert saved > 0.2  # the beams share their prompt's and their common past's blocks


def test_beam_search_against_transformers(model, hf_model):
    """transformers' generate(num_beams=k) with min_new_tokens = max_new_tokens (EOS masked, so the
    search never closes a hypothesis early) against ours with ignore_eos: equal when EOS is never among
    the candidates (checked); transformers masks EOS (-inf) where ours keeps it as a live candidate."""
    ids = [1, 504, 2371, 282, 260, 6375, 1760, 16079]  # "The history of the printing press begins" style ids
    k, n = 4, 12
    ours = LLM(model, num_blocks=64).beam_search({"prompt_token_ids": ids}, BeamSearchParams(k, n, ignore_eos=True))
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), num_beams=k, num_return_sequences=k, max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, early_stopping=False, length_penalty=1.0,
                                pad_token_id=0)
    assert [s.tokens for s in ours[0].sequences][0] == ref[0].tolist()
    assert {tuple(s.tokens) for s in ours[0].sequences} == {tuple(r) for r in ref.tolist()}
