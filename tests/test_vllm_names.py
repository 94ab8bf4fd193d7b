"""SamplingParams takes vLLM's names with vLLM's meaning: stop_token_ids (and generation stopping on
them), best_of (refused unless it asks for nothing more than n), top_k=-1, max_tokens; the Stopper's
contract with the engine (finish_reason and vLLM's stop_reason)."""

import dataclasses

import numpy as np
import pytest
import torch
from helpers import tiny_llama_weights, write_tiny_gguf

from minillm import SamplingParams, load_model, logits_to_probs
from minillm.generation import (GenerationResult, Stopper, generate, generate_batch, generate_cached,
                                generate_dynamic, generate_naive)
from minillm.speculative import NgramProposer, speculative_generate


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama (vocab 300, EOS id 0) and its tokenizer, with an output layer of its own: tied to
    the embedding, the random model repeats its last token, and a stop would fire on the first one."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    weights = tiny_llama_weights()
    weights["output.weight"] = np.random.default_rng(1).standard_normal((300, 64)).astype(np.float32)
    write_tiny_gguf(path, weights)
    return load_model(path)


PROMPT = [5, 17, 42, 99]


# ---- stop_token_ids

def test_stop_token_ids_are_stored_as_a_tuple_and_compare_and_hash_as_one_value():
    a = SamplingParams(stop_token_ids=[7, 3], max_tokens=5)
    b = SamplingParams(stop_token_ids=(7, 3), max_new_tokens=5)
    assert a.stop_token_ids == (7, 3) and a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()  # vLLM's default is None
    assert SamplingParams(stop_token_ids=[7]) != SamplingParams(stop_token_ids=[3])
    c = dataclasses.replace(a, stop_token_ids=[9], temperature=0.5)  # replace runs the checks again
    assert c.stop_token_ids == (9,) and c.max_tokens == 5 and c.temperature == 0.5
    assert SamplingParams(stop_token_ids=np.array([4, 2])).stop_token_ids == (4, 2)
    assert all(type(i) is int for i in SamplingParams(stop_token_ids=np.array([4, 2])).stop_token_ids)


@pytest.mark.parametrize("value", [5, [1, -1], [True], [1.0], "12", [None], {"a": 1}])
def test_bad_stop_token_ids_name_the_field(value):
    with pytest.raises(ValueError, match="^stop_token_ids: must be a list of token ids"):
        SamplingParams(stop_token_ids=value)
    with pytest.raises(ValueError, match=r"write \[5\] for one id"):
        SamplingParams(stop_token_ids=5)


def _stop_candidate(tokens, eos):
    """(k, t): t = tokens[k] occurs first at k, after an EOS, and again later, so that stopping anywhere but
    at its first occurrence, or at the EOS despite ignore_eos, shows."""
    after = tokens.index(eos) + 1 if eos in tokens else 1
    return next((k, t) for k, t in enumerate(tokens) if k >= after and t != eos and t not in tokens[:k]
                and t in tokens[k + 1:])


@pytest.mark.parametrize("path", ["naive", "dynamic", "cached", "generate none", "batch", "speculative"])
def test_generation_ends_exactly_at_the_first_stop_token_id(tiny, path):
    model, tok = tiny
    run = {"naive": generate_naive, "dynamic": generate_dynamic, "cached": generate_cached,
           "generate none": lambda m, p, params, **kw: generate(m, p, params, cache="none", **kw),
           "batch": lambda m, p, params, **kw: generate_batch(m, [p, p[:2]], params, **kw)[0],
           "speculative": lambda m, p, params, **kw: speculative_generate(
               m, NgramProposer(m.config.vocab_size), p, params, num_speculative_tokens=3, **kw)[0]}[path]
    # ignore_eos: the reference runs its full length, and stop_token_ids must stop regardless (as vLLM)
    ref = run(model, PROMPT, SamplingParams(max_tokens=24, ignore_eos=True), tokenizer=tok)
    assert len(ref.tokens) == 24 and tok.eos_id in ref.tokens  # an EOS ignored on the way
    k, t = _stop_candidate(ref.tokens, tok.eos_id)
    out = run(model, PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[299, t]), tokenizer=tok)
    assert out.tokens == ref.tokens[:k + 1]  # the stop token is kept in tokens, and nothing after it
    assert out.finish_reason == "eos"
    assert out.text == tok.decode(ref.tokens[:k])  # the text leaves it out, as for EOS


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"stop_token_ids: token ids must be in \[0, 300\)"):
        generate_cached(model, PROMPT, SamplingParams(stop_token_ids=[300]))


# ---- the Stopper's contract with the engine: finish_reason and stop_reason

def test_stopper_sets_finish_reason_and_vllms_stop_reason_and_resets_it(tiny):
    _, tok = tiny
    eos = tok.eos_id
    text_ids = tok.encode("ab cd")
    stopper = Stopper(SamplingParams(stop=["cd"], stop_token_ids=[eos, 7]), tok, {eos})

    def check(ids):
        r = GenerationResult(prompt_tokens=[1], tokens=list(ids))
        return stopper.check(r), r

    done, r = check([5, eos])  # EOS, listed in stop_token_ids too: EOS first, as vLLM
    assert done and r.finish_reason == "eos" and stopper.stop_reason is None
    done, r = check([5, 7])
    assert done and r.finish_reason == "eos" and stopper.stop_reason == 7 and type(stopper.stop_reason) is int
    done, r = check(text_ids)
    assert done and r.finish_reason == "stop" and r.text == "ab " and stopper.stop_reason == "cd"
    done, r = check([5, 6])
    assert not done and stopper.stop_reason is None and r.finish_reason == "length"  # reset at each check
    # ignore_eos turns off EOS only: the same id in stop_token_ids still stops, as that id
    ignoring = Stopper(SamplingParams(ignore_eos=True, stop_token_ids=[eos]), tok, {eos})
    r = GenerationResult(prompt_tokens=[1], tokens=[5, eos])
    assert ignoring.check(r) and r.finish_reason == "eos" and ignoring.stop_reason == eos
    r = GenerationResult(prompt_tokens=[1], tokens=[5, eos])
    assert not Stopper(SamplingParams(ignore_eos=True), tok, {eos}).check(r)


def test_stop_reason_names_the_stop_string_that_fired_first_in_the_text(tiny):
    _, tok = tiny
    stopper = Stopper(SamplingParams(stop=["zz", "b", "ab"]), tok, set())
    r = GenerationResult(prompt_tokens=[1], tokens=tok.encode("xab"))
    # "ab" starts at 1, before "b" at 2: the text is cut before "ab", and that is the stop string named
    assert stopper.check(r) and r.text == "x" and stopper.stop_reason == "ab"


# ---- best_of, top_k=-1, max_tokens

def test_best_of_is_accepted_only_when_it_asks_for_nothing_more_than_n():
    assert SamplingParams(n=3, best_of=3) == SamplingParams(n=3)  # stored as None: one value, one meaning
    assert SamplingParams(n=3, best_of=3).best_of is None and SamplingParams().best_of is None
    assert dataclasses.replace(SamplingParams(n=2, best_of=2), n=4).n == 4
    with pytest.raises(ValueError, match="^best_of: 4 with n=2: minillm does not rank extra samples"):
        SamplingParams(n=2, best_of=4)
    with pytest.raises(ValueError, match="^best_of: 1 with n=2: .*vLLM refuses best_of below n"):
        SamplingParams(n=2, best_of=1)
    with pytest.raises(ValueError, match="^best_of: must be an integer or None"):
        SamplingParams(best_of=1.5)


def test_top_k_minus_one_means_no_top_k_as_in_vllm():
    params = SamplingParams(temperature=0.8, top_k=-1)
    assert params.top_k == 0 and params == SamplingParams(temperature=0.8)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    torch.testing.assert_close(logits_to_probs(logits, params), torch.softmax(logits / 0.8, -1))
    with pytest.raises(ValueError, match=r"^top_k: must be >= 0, or -1"):
        SamplingParams(top_k=-2)


def test_max_tokens_alias_survives_replace_equality_and_hashing():
    a = SamplingParams(max_tokens=7, stop_token_ids=[1])
    assert a.max_new_tokens == a.max_tokens == 7
    b = dataclasses.replace(a, seed=3)
    assert b.max_tokens == 7 and b.seed == 3 and b != a and hash(dataclasses.replace(b, seed=None)) == hash(a)
    with pytest.raises(ValueError, match="^max_tokens: vLLM's name for max_new_tokens"):
        SamplingParams(max_tokens=7, max_new_tokens=8)
