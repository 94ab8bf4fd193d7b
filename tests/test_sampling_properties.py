"""Sampling never draws from a distribution that does not exist: property tests (hypothesis) over
valid SamplingParams on a tiny random model, through every path (plain, batch, speculative)."""

import pytest
import torch
from helpers import write_tiny_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import SamplingParams, load_model, logits_to_probs, sample
from minillm.generation import generate_batch, generate_cached
from minillm.sampling_params import GREEDY_BELOW
from minillm.speculative import DraftModelProposer, NgramProposer, speculative_generate


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path)
    return load_model(path)[0]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    from helpers import tiny_llama_weights

    path = tmp_path_factory.mktemp("draft") / "draft.gguf"
    write_tiny_gguf(path, tiny_llama_weights(seed=1))
    return load_model(path)[0]


# temperatures from underflow (1e-50 rounds to 0 in float32) through the subnormals to ordinary ones
temperatures = st.one_of(st.just(0.0), st.sampled_from([1e-300, 1e-50, 1e-45, 1e-40, 1e-38, 1e-30, 1e-6]),
                         st.floats(min_value=0.05, max_value=5.0))
params_strategy = st.builds(
    SamplingParams, temperature=temperatures, top_k=st.integers(0, 400),
    top_p=st.one_of(st.just(1.0), st.sampled_from([1e-300, 1e-50, 1e-45]),  # below float32's resolution too
                    st.floats(min_value=1e-6, max_value=1.0, exclude_min=True)),
    max_new_tokens=st.integers(1, 6), seed=st.integers(0, 2**31), ignore_eos=st.booleans())
prompts = st.lists(st.integers(1, 299), min_size=1, max_size=12)


def assert_possible(model, prompt, tokens, params):
    """Each emitted id had positive probability under the processed distribution of its position."""
    seq = prompt + tokens
    with torch.inference_mode():
        logits = model(torch.tensor([seq[:-1]]), torch.arange(len(seq) - 1))[0, len(prompt) - 1:]
    probs = logits_to_probs(logits, params)  # (len(tokens), V)
    assert torch.isfinite(probs).all()
    for i, t in enumerate(tokens):
        assert 0 <= t < model.config.vocab_size
        if params.greedy:
            # the argmax, up to float rounding between the recomputed and the cached forward
            assert logits[i, t] >= logits[i].max() - 1e-4, (i, t)
        else:
            assert probs[i, t] > 0, (i, t, float(probs[i, t]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=params_strategy, prompt=prompts)
def test_every_path_emits_only_possible_tokens(tiny, tiny_draft, params, prompt):
    plain = generate_cached(tiny, prompt, params)
    assert_possible(tiny, prompt, plain.tokens, params)
    for row, p in zip(generate_batch(tiny, [prompt, prompt[:1]], params), [prompt, prompt[:1]]):
        assert_possible(tiny, p, row.tokens, params)
    for proposer in (NgramProposer(tiny.config.vocab_size), DraftModelProposer(tiny_draft, 128)):
        spec, _ = speculative_generate(tiny, proposer, prompt, params, num_speculative_tokens=3)
        assert_possible(tiny, prompt, spec.tokens, params)


def test_a_temperature_below_float32_range_is_greedy(tiny):
    prompt = [5, 17, 42]
    greedy = generate_cached(tiny, prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    for t in (1e-50, 1e-300, GREEDY_BELOW / 2):
        params = SamplingParams(temperature=t, max_new_tokens=8, ignore_eos=True, seed=0)
        assert params.greedy
        assert generate_cached(tiny, prompt, params).tokens == greedy.tokens
        spec, stats = speculative_generate(tiny, NgramProposer(tiny.config.vocab_size), prompt, params)
        assert spec.tokens == greedy.tokens
    assert not SamplingParams(temperature=GREEDY_BELOW * 2).greedy


def test_a_top_p_below_float32_resolution_keeps_the_most_likely_token():
    logits = torch.tensor([[1.0, 3.0, 0.0, 2.0]])
    for top_p in (1e-300, 1e-50, 1e-9):
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
def test_nan_or_empty_logits_are_refused_where_probabilities_are_made(bad):
    logits = torch.randn(2, 50)
    if bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 3] = bad
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9)):
        with pytest.raises(ValueError, match="logits: contain NaN"):
            logits_to_probs(logits, params)
        with pytest.raises(ValueError, match="logits: contain NaN"):
            sample(logits, params, torch.Generator().manual_seed(0))
