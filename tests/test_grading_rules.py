"""Grading that cannot be gamed, in process: a function that calls the implementation it replaces (or
the checker's own reference) earns 0 points; the grading cases add cases the student never saw; a hint
for an answer with two mistakes at once never prints the answer's formula."""

import io
import pickle
from contextlib import redirect_stdout

import pytest
import torch

import minillm
from minillm.exercises import EXERCISES, check
from minillm.exercises.checker import SEED
from minillm.exercises.forbid import resolve
from minillm.sampling import logits_to_probs
from minillm.sampling_params import SamplingParams


def quiet_check(name, fn):
    with redirect_stdout(io.StringIO()):
        return check(name, fn)


@pytest.mark.parametrize("name", list(EXERCISES))
def test_calling_the_reference_scores_zero(name):
    reference = EXERCISES[name].reference
    report = quiet_check(name, lambda *args: reference(*args))
    assert report.forbidden and report.points == 0 and not report.passed, report
    assert "switched off while" in report.forbidden
    for path in EXERCISES[name].forbidden:  # every forbidden name exists, and works again after the check
        assert resolve(path).__code__.co_name != "_forbidden"


def test_wrapping_the_package_scores_zero_and_says_what_was_called():
    def kv_cache_size(config, batch_size, seq_len, dtype):  # through the re-export in minillm/__init__.py
        return minillm.kv_cache_bytes(config, batch_size, seq_len, torch.empty((), dtype=dtype).element_size())

    def top_p_filter(probs, top_p):
        return logits_to_probs(probs.log(), SamplingParams(temperature=1.0, top_p=top_p))

    for name, fn, called in (("kv_cache_size", kv_cache_size, "minillm.kv_cache.kv_cache_bytes"),
                             ("top_p_filter", top_p_filter, "minillm.sampling.logits_to_probs")):
        report = quiet_check(name, fn)
        assert report.points == 0 and report.max_points == len(report.results) >= 9
        assert report.summary().endswith("0/%d points (0: it calls the implementation it replaces)" % report.max_points)
        assert report.failures[0].got.startswith(f"your function called {called}")
        assert "compute the answer with your own code" in report.failures[0].hint
    assert minillm.kv_cache_bytes(minillm.ModelConfig(), 1, 10, 2) == 230_400  # restored after the check


@pytest.mark.parametrize("name", list(EXERCISES))
def test_hidden_cases_differ_from_the_practice_cases(name):
    ex = EXERCISES[name]
    practice = ex.cases()
    graded = ex.grading_cases(seed=20261202)
    hidden = graded[len(practice):]
    assert [c.name for c in graded[:len(practice)]] == [c.name for c in practice] and hidden
    assert all(c.name.startswith("hidden ") for c in hidden)
    seen = {pickle.dumps(c.args) for c in practice}
    assert not any(pickle.dumps(c.args) in seen for c in hidden)
    with pytest.raises(ValueError, match="practice cases' seed"):
        ex.grading_cases(seed=SEED)


def kv_two_mistakes(config, batch_size, seq_len, dtype):  # no factor 2 and n_heads for n_kv_heads
    return batch_size * seq_len * config.n_layers * config.n_heads * config.head_dim * 4


def slots_two_mistakes(block_table, positions, block_size):  # offset dropped and the block off by one
    return torch.tensor(block_table)[positions // block_size] * block_size + block_size


def blocks_two_mistakes(num_tokens, block_size):
    return num_tokens // block_size + 2


def rope_two_mistakes(x, start, base):
    return x * 0.5 + 1.0  # neither rotated nor the input


def top_p_two_mistakes(probs, top_p):
    return torch.softmax(probs, -1)


@pytest.mark.parametrize("name, fn, answer_texts", [
    ("kv_cache_size", kv_two_mistakes, ["2 x", "n_kv_heads x head_dim", "batch x seq_len"]),
    ("slot_mapping", slots_two_mistakes, ["* block_size +", "pos // block_size] *"]),
    ("blocks_needed", blocks_two_mistakes, ["ceil(", "block_size - 1) //"]),
    ("rope_at_offset", rope_two_mistakes, ["x * cos", "rotate_half(x) * sin", "base^(-2i"]),
    ("top_p_filter", top_p_two_mistakes, ["smallest prefix", "renormalise, unsort"]),
])
def test_the_fallback_hint_never_prints_the_answer(name, fn, answer_texts):
    report = quiet_check(name, fn)
    assert report.failures
    for failure in report.failures:
        assert failure.hint and not any(t in failure.hint for t in answer_texts), failure.hint
