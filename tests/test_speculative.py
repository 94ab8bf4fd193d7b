"""Speculative decoding: the emitted distribution is exactly the target's; greedy output equals the
target's greedy output for any draft."""

import itertools

import pytest
import torch
from helpers import random_decoder

from minillm import SamplingParams, generate_cached
from minillm.speculative import save_llama_checkpoint, self_draft
from minillm.sampling import logits_to_probs
from minillm.speculative import (
    DraftModelProposer, NgramProposer, acceptance_probability, draw, emitted_distribution, rejection_sample,
    replay_greedy, residual_distribution, speculative_generate,
)


def emitted_first_token_distribution(target_probs, draft_probs):
    """Enumerate Algorithm 1's branches for one drafted token: draft x with probability q(x); accepted
    with probability a(x), else a token from the residual."""
    V = target_probs.shape[0]
    out = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        q = float(draft_probs[x])
        if q == 0:
            continue
        a = acceptance_probability(target_probs, draft_probs, x)
        out[x] += q * a
        out += q * (1 - a) * residual_distribution(target_probs, draft_probs).double()
    return out


CASES = {
    "overlapping": ([0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]),
    "draft mass where the target has none": ([0.0, 0.6, 0.4, 0.0], [0.5, 0.1, 0.1, 0.3]),
    "target mass where the draft has none": ([0.2, 0.2, 0.2, 0.4], [0.0, 0.5, 0.5, 0.0]),
    "one-hot draft": ([0.1, 0.7, 0.1, 0.1], [1.0, 0.0, 0.0, 0.0]),
    "identical": ([0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]),
}


@pytest.mark.parametrize("name", CASES)
def test_one_step_emits_exactly_the_target_distribution(name):
    target, draft = (torch.tensor(v, dtype=torch.float64) for v in CASES[name])
    torch.testing.assert_close(emitted_first_token_distribution(target, draft), target)
    torch.testing.assert_close(emitted_distribution(target, draft), target)


def test_exact_with_top_k_processed_draft():
    logits_t = torch.tensor([[2.0, 1.5, 0.3, -1.0, 0.0]])
    logits_d = torch.tensor([[0.0, 2.5, 2.0, 1.0, -3.0]])
    params = SamplingParams(temperature=0.7, top_k=3)
    target = logits_to_probs(logits_t, params)[0].double()
    draft = logits_to_probs(logits_d, params)[0].double()
    assert (draft == 0).sum() == 2 and (target == 0).sum() == 2  # top-k left different supports
    torch.testing.assert_close(emitted_first_token_distribution(target, draft), target)


def test_sampled_tokens_follow_the_target_distribution():
    """Many seeded draws of rejection_sample with gamma = 2: the first emitted token's frequencies
    match the target; total variation < 0.02 (its standard deviation here is ~0.004)."""
    g = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[0.1, 0.1, 0.2, 0.6], [0.7, 0.1, 0.1, 0.1]])
    counts = torch.zeros(4)
    n = 20000
    for _ in range(n):
        d = [int(torch.multinomial(draft[i], 1, generator=g)) for i in range(2)]
        emitted, _ = rejection_sample(d, draft, target, g)
        counts[emitted[0]] += 1
    tv = 0.5 * (counts / n - target[0]).abs().sum()
    assert tv < 0.02


@pytest.mark.parametrize("proposer_kind", ["ngram", "random draft model"])
def test_greedy_speculative_equals_target_greedy(model, tokenizer, proposer_kind):
    prompt = tokenizer.encode("The cat sat on the mat. The dog sat on the log. The cat sat on the")
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ref = generate_cached(model, prompt, params)
    draft = random_decoder(model.config.vocab_size)

    def proposer():
        return NgramProposer(model.config.vocab_size) if proposer_kind == "ngram" else DraftModelProposer(draft, 256)

    streamed = []
    out, stats = speculative_generate(model, proposer(), prompt, params, num_speculative_tokens=4,
                                      on_token=streamed.append)
    assert out.tokens == ref.tokens == streamed
    assert len(stats.accepted) <= 32 and 0 <= stats.acceptance_rate <= 1
    if proposer_kind == "ngram":
        assert stats.acceptance_rate > 0.2  # the text repeats itself, so lookups hit
    # the same passes, replayed from the greedy answer alone (no target)
    replayed = replay_greedy(proposer(), prompt, ref.tokens, num_speculative_tokens=4)
    assert (replayed.drafted, replayed.accepted, replayed.emitted) == (stats.drafted, stats.accepted, stats.emitted)


def test_stats_alpha_positions_and_predicted_speedup():
    from minillm.speculative import SpeculativeStats, expected_tokens_per_pass, leviathan_speedup, predicted_speedup

    # passes: 4 drafted, 2 accepted (3 examined); 0 drafted; 4 drafted, all accepted; 2 drafted, 0 accepted
    st = SpeculativeStats(drafted=[4, 0, 4, 2], accepted=[2, 0, 4, 0])
    assert st.acceptance_rate == 6 / 10 and st.alpha == 6 / (3 + 0 + 4 + 1)
    assert st.tokens_per_target_pass == (3 + 1 + 5 + 1) / 4
    assert st.acceptance_by_position() == [2 / 3, 2 / 2, 1 / 2, 1 / 1]
    verify = {1: 1.0, 3: 1.5, 5: 2.0}  # seconds; only k + 1 in {1, 3, 5} occur
    pred = predicted_speedup(st, verify, draft_cost=0.1)
    cost = ((2.0 + 0.4) + 1.0 + (2.0 + 0.4) + (1.5 + 0.2)) / 4
    assert pred["cost_per_pass"] == pytest.approx(cost) and pred["predicted_speedup"] == pytest.approx(2.5 / cost)
    assert pred["tokens_per_pass_alpha"] == pytest.approx(
        sum(expected_tokens_per_pass(0.75, k) for k in (4, 0, 4, 2)) / 4)
    # decode_tokens_per_s's accounting: 10 - 1 tokens; the first pass (3 tokens) keeps 2/3 of its cost
    assert pred["predicted_speedup_after_first_token"] == pytest.approx(9 / (4 * cost - 2.4 / 3))
    # a first pass that keeps one token drops out whole; with no drafts at all, plain decoding's 1.0
    one = SpeculativeStats(drafted=[4, 4], accepted=[0, 4], emitted=[1, 5])
    assert predicted_speedup(one, verify)["predicted_speedup_after_first_token"] == pytest.approx(5 / 2.0)
    none = SpeculativeStats(drafted=[0, 0, 0], accepted=[0, 0, 0])
    assert predicted_speedup(none, verify)["predicted_speedup_after_first_token"] == pytest.approx(1.0)
    assert expected_tokens_per_pass(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens_per_pass(1.0, 3) == 4 and leviathan_speedup(0.0, 5, 0.0) == 1
    assert leviathan_speedup(0.5, 3, 0.1) == pytest.approx(1.875 / 1.3)
    with pytest.raises(ValueError, match="verify_cost: needs the forward time for k = 1 and \\[3\\]"):
        predicted_speedup(st, {1: 1.0, 5: 2.0})


def test_draw_never_picks_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(2000)]), minlength=5)
    assert counts[[0, 2, 4]].sum() == 0 and abs(int(counts[1]) - 1000) < 4 * 23  # 4 standard deviations


def test_distill_draft_lowers_the_loss_and_leaves_the_target_alone(model, tokenizer, play_text, tmp_path):
    from minillm import load_model
    from minillm.speculative import distill_draft

    before = model.layers[0].attn.wqkv.weight_shards.clone()
    draft, log = distill_draft(model, tokenizer.encode(play_text[:4000]), n_layers=2, seq_len=32, n_windows=4,
                               steps=8, lr=1e-3, progress=False)
    assert draft.config.n_layers == 2 and draft.output is model.output
    assert draft.layers[0] is not model.layers[0] and torch.equal(model.layers[0].attn.wqkv.weight_shards, before)
    assert sum(log["losses"][-4:]) < sum(log["losses"][:4])  # the same 4 windows, seen twice
    assert not any(p.requires_grad for p in draft.parameters())
    save_llama_checkpoint(draft, tmp_path)
    loaded, _ = load_model(tmp_path)
    x = torch.tensor([[5, 17, 300, 4000]])
    torch.testing.assert_close(loaded(x, torch.arange(4)), draft(x, torch.arange(4)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="tokens: need at least seq_len \\+ 1 = 33 tokens"):
        distill_draft(model, [1, 2, 3], seq_len=32)


def test_prefill_s_includes_the_prompt_forward(model, tokenizer, monkeypatch):
    """prefill_s is the time to the first new token, prompt forward included (as generate_cached's)."""
    import time

    forward, calls = model.forward, []

    def slow_first_call(*args, **kwargs):  # the prompt's forward takes at least 0.3 s
        calls.append(args[0].shape[1])
        if len(calls) == 1:
            time.sleep(0.3)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", slow_first_call)
    prompt = tokenizer.encode("The cat sat on the mat. The cat sat on the")
    out, _ = speculative_generate(model, NgramProposer(model.config.vocab_size), prompt,
                                  SamplingParams(max_new_tokens=8, ignore_eos=True), num_speculative_tokens=4)
    assert calls[0] == len(prompt) - 1  # the first forward was the prompt (all but its last token)
    assert out.prefill_s >= 0.3 and out.prefill_s == out.step_s[0]


@pytest.mark.parametrize("proposer_kind", ["ngram", "self-draft"])
def test_stop_strings_and_eos_end_speculation_as_they_end_plain_decoding(model, tokenizer, proposer_kind):
    """A stop string or EOS inside an accepted run of drafts ends generation there; the pass counts
    only the tokens it kept."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])

    def proposer():
        return (NgramProposer(model.config.vocab_size) if proposer_kind == "ngram"
                else DraftModelProposer(self_draft(model, 29), 512))  # all but one layer: long accepted runs

    for params in (SamplingParams(max_new_tokens=40, stop=(" Paris", "Berlin")), SamplingParams(max_new_tokens=40)):
        ref = generate_cached(model, ids, params, tokenizer=tokenizer)
        out, stats = speculative_generate(model, proposer(), ids, params, tokenizer=tokenizer, num_speculative_tokens=8)
        assert (out.tokens, out.text, out.finish_reason) == (ref.tokens, ref.text, ref.finish_reason)
        assert ref.finish_reason in ("stop", "eos")
        assert sum(stats.emitted) == len(out.tokens) == len(out.step_s)
        assert stats.tokens_per_target_pass == len(out.tokens) / len(stats.accepted)
    with pytest.raises(ValueError, match="stop: stop strings need a tokenizer"):
        speculative_generate(model, proposer(), ids, SamplingParams(stop=("x",)))


def test_eos_inside_an_accepted_run_keeps_only_the_tokens_emitted(model, tokenizer):
    ids = tokenizer.encode("The cat sat on the mat. The cat sat on the mat. The cat sat on the")
    ref = generate_cached(model, ids, SamplingParams(max_new_tokens=16, ignore_eos=True))
    eos = {ref.tokens[1]}  # the second greedy token ends generation, inside the first pass's drafts
    out, stats = speculative_generate(model, NgramProposer(model.config.vocab_size), ids,
                                      SamplingParams(max_new_tokens=16), num_speculative_tokens=6, eos_ids=eos)
    assert out.tokens == ref.tokens[:2] and out.finish_reason == "eos"
    assert stats.accepted[0] >= 2 and stats.emitted == [2] and stats.tokens_per_target_pass == 2


def test_a_draft_with_a_shorter_context_stops_drafting_at_its_end(model, tokenizer):
    from dataclasses import replace

    short = self_draft(model, 2)
    short.config = replace(short.config, max_seq_len=24)
    proposer = DraftModelProposer(short, 512)  # the target's context is longer
    ids = tokenizer.encode("The cat sat on the mat. The dog sat on the")
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    out, stats = speculative_generate(model, proposer, ids, params, num_speculative_tokens=4)
    assert out.tokens == generate_cached(model, ids, params).tokens
    # drafting stops once the text passes the draft's 24 positions (the last draft is not fed back)
    passes_after = [k for k, n in zip(stats.drafted, itertools.accumulate([len(ids)] + stats.emitted)) if n > 25]
    assert passes_after and set(passes_after) == {0} and max(stats.drafted) > 0


def test_a_proposer_over_another_vocabulary_is_refused(model):
    with pytest.raises(ValueError, match="proposer: drafts over a vocabulary of 10 ids, the target has 49152"):
        speculative_generate(model, NgramProposer(10), [1, 2, 3])


def test_gamma_must_be_positive(model):
    with pytest.raises(ValueError, match="num_speculative_tokens: must be >= 1"):
        speculative_generate(model, NgramProposer(10), [1, 2], num_speculative_tokens=0)
    with pytest.raises(ValueError, match="num_speculative_tokens: must be >= 1"):
        replay_greedy(NgramProposer(10), [1, 2], [3], num_speculative_tokens=0)


def test_replay_counts_passes_by_hand_and_refuses_bad_input():
    # prompt "a b c a": the lookup of "a" drafts "b c a"; the answer "b c x y z" accepts "b c" and emits x;
    # "x" occurs nowhere before, so nothing is drafted and y comes alone; z is the last token: no room to draft
    a, b, c, x, y, z = 1, 2, 3, 4, 5, 6
    stats = replay_greedy(NgramProposer(10), [a, b, c, a], [b, c, x, y, z], num_speculative_tokens=3)
    assert (stats.drafted, stats.accepted, stats.emitted) == ([3, 0, 0], [2, 0, 0], [3, 1, 1])
    assert stats.tokens_per_target_pass == pytest.approx(5 / 3)
    for args, kwargs, message in [
        (([1, 2], [3], SamplingParams(temperature=0.5)), {}, "params: replay holds at greedy only"),
        (([1, 2], [3], None), {}, "params: replay holds at greedy only"),
        (([], [3]), {}, "prompt_tokens: is empty"),
        (([1, 2], [5, 99]), {}, "answer: token ids must be in \\[0, 10\\)"),
        (([1, -1], [3]), {}, "prompt_tokens: token ids must be in"),
    ]:
        with pytest.raises(ValueError, match=message):
            replay_greedy(NgramProposer(10), *args, **kwargs)


@pytest.mark.parametrize("gamma", [2, 8])
def test_replay_of_an_answer_ended_by_eos_keeps_the_live_passes(model, tokenizer, gamma):
    """Past EOS the replay cannot know the target's argmax, so drafted/accepted may differ in the passes
    whose window reaches the end; the passes and the tokens each emits do not."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat exactly: the cat sat on the mat."}])
    params = SamplingParams(max_new_tokens=48)
    out, live = speculative_generate(model, NgramProposer(model.config.vocab_size), prompt, params,
                                     num_speculative_tokens=gamma, tokenizer=tokenizer)
    assert out.finish_reason == "eos"
    replayed = replay_greedy(NgramProposer(model.config.vocab_size), prompt, out.tokens, num_speculative_tokens=gamma)
    assert replayed.emitted == live.emitted and sum(replayed.drafted) <= sum(live.drafted)
    assert replayed.tokens_per_target_pass == live.tokens_per_target_pass


def test_self_draft_shares_weights_and_round_trips_through_a_checkpoint(model, tmp_path):
    from minillm import load_model

    draft = self_draft(model, 3)
    assert draft.config.n_layers == 3 and len(model.layers) == 30
    assert draft.layers[2] is model.layers[2] and draft.output is model.output
    save_llama_checkpoint(draft, tmp_path)
    loaded, _ = load_model(tmp_path)
    x = torch.tensor([[5, 17, 300, 4000]])
    torch.testing.assert_close(loaded(x, torch.arange(4)), draft(x, torch.arange(4)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="n_layers: must be in 1..30"):
        self_draft(model, 31)


# ---------------------------------------------------------------------------------------------
# Sampling on the real model: emitted-token frequencies against the target's own distribution


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square goodness of fit of ``counts`` (V,) to ``probs`` (V,). The categories are
    fixed from ``probs`` alone: tokens in decreasing probability, grouped in order until each group
    is expected at least ``min_expected`` times (a likely token is a group of its own; the tail is
    pooled). The p-value is the chi-square survival function Q(df / 2, statistic / 2) (regularised
    upper incomplete gamma).

    Raises:
        ValueError: too few draws for two groups."""
    order = probs.double().argsort(descending=True)
    obs, exp, o, e = [], [], 0.0, 0.0
    for oi, ei in zip(counts[order].tolist(), (counts.sum().double() * probs.double()[order]).tolist()):
        o, e = o + oi, e + ei
        if e >= min_expected:
            obs.append(o)
            exp.append(e)
            o, e = 0.0, 0.0
    if len(exp) < 2:
        raise ValueError(f"counts: {int(counts.sum())} draws are too few for two groups of {min_expected} expected")
    obs[-1], exp[-1] = obs[-1] + o, exp[-1] + e  # the remainder joins the last group
    obs, exp = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), stat / 2))


FALSE_ALARM = 1e-3  # each test fails with probability 1e-3 when the algorithm is right (seeded: reproducibly)
SAMPLED = {"T=1": SamplingParams(temperature=1.0), "T=0.7, top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
           "T=1.5, top-k 40": SamplingParams(temperature=1.5, top_k=40)}
# prompt lookup drafts " blue", to which the target gives 0.27-0.74 depending on the sampling
PROMPT = "My favourite colours are red and blue. I painted the door red and"


@pytest.fixture(scope="module")
def target_logits(model, tokenizer):
    """The target's logits (V,) after PROMPT, and the prompt's ids."""
    ids = tokenizer.encode(PROMPT)
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids)))[0, -1], ids


def emitted_counts(propose, target_probs, n, seed=0):
    """First tokens emitted by n seeded speculative steps with gamma = 1, and the drafted tokens.

    ``propose(generator)`` returns (draft ids, draft_probs). The target row after the draft (for the
    bonus token) is only read when the draft is accepted, and the first emitted token is then the
    draft itself: the first emitted token depends on target_probs at the prompt's end only."""
    g = torch.Generator().manual_seed(seed)
    V = target_probs.shape[0]
    emitted, drafted = torch.zeros(V), torch.zeros(V)
    both_rows = torch.stack([target_probs, target_probs])  # (gamma + 1, V)
    for _ in range(n):
        draft, draft_probs = propose(g)
        out, _ = rejection_sample(draft, draft_probs, both_rows, g)
        emitted[out[0]] += 1
        drafted[draft[0]] += 1
    return emitted, drafted


def self_draft_proposal(model, ids, params):
    """One proposal of DraftModelProposer with the target's first 24 layers (it shares ~20-28% of
    the target's probability mass here), and a proposer drawing from that same draft_probs."""
    _, draft_probs = DraftModelProposer(self_draft(model, 24), 64).propose(ids, 1, params, torch.Generator())
    return draft_probs[0], lambda g: ([draw(draft_probs[0], g)], draft_probs)


@pytest.mark.parametrize("name", SAMPLED)
@pytest.mark.parametrize("kind", ["ngram", "self-draft (24 layers)"])
def test_sampled_speculation_follows_the_target_on_the_real_model(model, target_logits, kind, name):
    """Over 3,000 seeded steps the first emitted token never falls outside the target's support and
    its frequencies pass a chi-square test against the target's own distribution (FALSE_ALARM)."""
    logits, ids = target_logits
    params = SAMPLED[name]
    target_probs = logits_to_probs(logits[None], params)[0]
    if kind == "ngram":
        proposer = NgramProposer(model.config.vocab_size)
        propose = lambda g: proposer.propose(ids, 1, params, g)  # noqa: E731
    else:
        draft_probs, propose = self_draft_proposal(model, ids, params)
        assert 0.1 < float(torch.minimum(target_probs, draft_probs).sum()) < 0.9  # partial overlap
    emitted, drafted = emitted_counts(propose, target_probs, 3000)
    if kind == "ngram":
        assert drafted.count_nonzero() == 1 and 0.2 < target_probs[int(drafted.argmax())] < 0.8
    assert emitted[target_probs == 0].sum() == 0
    assert chi_square_p_value(emitted, target_probs) > FALSE_ALARM


@pytest.mark.parametrize("kind", ["ngram", "self-draft (24 layers)"])
def test_the_chi_square_test_detects_a_wrong_residual(model, target_logits, monkeypatch, kind):
    """The check above can fail: replacing the residual max(0, target - draft) by the target itself
    (a plausible bug) makes the drafted tokens too frequent, and the p-value collapses."""
    import minillm.speculative.rejection as spec

    logits, ids = target_logits
    params = SAMPLED["T=1"]
    target_probs = logits_to_probs(logits[None], params)[0]
    proposer = NgramProposer(model.config.vocab_size)
    propose = (lambda g: proposer.propose(ids, 1, params, g)) if kind == "ngram" else \
        self_draft_proposal(model, ids, params)[1]
    monkeypatch.setattr(spec, "residual_distribution", lambda target_probs, draft_probs: target_probs)
    emitted, _ = emitted_counts(propose, target_probs, 3000)
    assert chi_square_p_value(emitted, target_probs) < 1e-6


@pytest.mark.parametrize("name", SAMPLED)
def test_sampled_random_draft_model_follows_the_target(model, target_logits, name):
    """A random-weight draft model drafts through DraftModelProposer.propose (its own KV cache, rolled
    back every step), putting its mass where the target has little or none: the drafted tokens
    follow the draft_probs it reports, and the first emitted tokens follow the target."""
    logits, ids = target_logits
    params = SAMPLED[name]
    target_probs = logits_to_probs(logits[None], params)[0]
    draft_model = random_decoder(model.config.vocab_size, scale=0.2)
    proposer = DraftModelProposer(draft_model, 64)
    with torch.inference_mode():
        draft_probs = logits_to_probs(draft_model(torch.tensor([ids]), torch.arange(len(ids)))[0, -1:], params)[0]
    emitted, drafted = emitted_counts(lambda g: proposer.propose(ids, 1, params, g), target_probs, 1000)
    assert chi_square_p_value(drafted, draft_probs) > FALSE_ALARM
    assert emitted[target_probs == 0].sum() == 0
    assert chi_square_p_value(emitted, target_probs) > FALSE_ALARM


def test_ngram_proposer_prefers_the_longest_latest_match():
    params = SamplingParams()  # greedy
    tokens = [5, 6, 7, 9, 1, 2, 5, 8, 3, 1, 2, 5]
    # the 3-token suffix [1, 2, 5] occurred at index 4: propose what followed it
    draft, probs = NgramProposer(10).propose(tokens, 3, params)
    assert draft == [8, 3, 1] and torch.equal(probs, torch.eye(10)[[8, 3, 1]])
    # only a one-token match ([4] -> 6): drafted with min_n = 1 (default), not with min_n = 2
    assert NgramProposer(10).propose([4, 6, 0, 4], 2, params)[0] == [6, 0]
    assert NgramProposer(10, min_n=2).propose([4, 6, 0, 4], 2, params)[0] == []
