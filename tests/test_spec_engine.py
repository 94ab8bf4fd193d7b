"""Speculative decoding inside the engine (minillm.paged.spec_decode) on tiny random models: at temperature 0
every request's tokens equal generate_cached's alone at every draft length, with preemption, chunked
prefill, prefix hits, n > 1 and stops; rejected drafts leave the KV cache as if never drafted; the config
is refused by field; every block (target and draft) is free at the end."""

import math

import pytest
import torch
from helpers import random_decoder, sweep
from test_engine import recompute_logits, run  # run: add (id, prompt ids, params), step to the end
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.generation import generate_cached
from minillm.paged import BeamSearchParams, LLMEngine

V = 300


@pytest.fixture(scope="module")
def tiny():
    return random_decoder(V, scale=0.3)


@pytest.fixture(scope="module")
def draft():
    torch.manual_seed(1)
    d = random_decoder(V, scale=0.3)
    with torch.no_grad():  # close to the target, not equal: some drafts are accepted, some rejected
        for p, q in zip(d.parameters(), random_decoder(V, scale=0.3).parameters()):
            p.copy_(q + 0.02 * torch.randn_like(q))
    return d


def ids(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


LOOP = ids(6, 50)  # repeated in prompts, so that prompt lookup finds drafts
SHARED = LOOP * 3  # a shared prefix: prefix-cache hits
PROMPTS = [SHARED + ids(2, 1), SHARED + ids(5, 2), LOOP * 2 + ids(9, 3), ids(7, 4), SHARED + ids(2, 1), ids(23, 5)]
OUTS = [6, 17, 30, 25, 9, 12]


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_all_free(engine):
    assert engine.manager.num_free_blocks == engine.num_blocks and engine.manager.seq_ids() == []
    if engine.spec.draft is not None:
        dm = engine.spec.draft.manager
        assert dm.num_free_blocks == dm.num_blocks and dm.seq_ids() == [] and not engine.spec.draft.fed
    assert not engine.spec._alpha and not engine.requests


def spec(method, k, draft=None, **kw):
    config = {"method": method, "num_speculative_tokens": k, **kw}
    if method == "draft_model":
        config["model"] = draft
    return config


REQS = [(str(i), p, greedy(n)) for i, (p, n) in enumerate(zip(PROMPTS, OUTS))]


@pytest.mark.parametrize("num_blocks,budget,attention,k,method", sweep(
    [(None, 256, "bucketed"),  # everything fits
     (20, 16, "bucketed"),  # chunked prefill, preemption, drafts cut by the budget and the pool
     (None, 256, "indexed")],  # (B, T) rows
    [1, 2, 3, 4, 5, "auto"], ["ngram", "draft_model"],
    fast=lambda num_blocks, budget, attention, k, method: k == 3 or (k == "auto" and num_blocks == 20)))
def test_greedy_equals_each_request_alone(tiny, draft, method, k, num_blocks, budget, attention):
    solo = {rid: [generate_cached(tiny, p, sp).tokens] for rid, p, sp in REQS}
    cost = {"step_cost": lambda n: 1.0 + 0.01 * n} if k == "auto" else {}
    engine = LLMEngine(tiny, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget, attention=attention,
                       speculative_config=spec(method, k, draft, **cost))
    assert run(engine, REQS) == solo
    stats = engine.spec.stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert engine.manager.stats.hits > 0  # the shared prefix was served from the prefix cache
    if num_blocks:
        assert engine.stats.preemptions > 0
    assert_all_free(engine)


def test_fewer_steps_and_vllm_counters(tiny):
    plain = LLMEngine(tiny, block_size=4)
    run(plain, REQS)
    engine = LLMEngine(tiny, block_size=4, speculative_config=spec("ngram", 4))
    for rid, p, sp in REQS:
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    metrics = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            metrics[out.request_id] = out.metrics.spec_decoding
    assert engine.stats.steps < plain.stats.steps
    s = engine.stats.spec_decoding
    assert s.num_draft_tokens == sum(m.num_draft_tokens for m in metrics.values() if m)
    assert s.num_accepted_tokens == sum(s.num_accepted_tokens_per_pos)
    assert s.num_accepted_tokens_per_pos == sorted(s.num_accepted_tokens_per_pos, reverse=True)
    assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_stops_land_where_they_would_without_speculation(tiny, draft, method):
    """EOS, stop token ids and max_tokens inside an accepted run: the request ends on the same token."""
    plain = LLMEngine(tiny, block_size=4)
    out = run(plain, [("x", PROMPTS[2], greedy(30))])["x"][0]
    reqs = [("eos", PROMPTS[2], SamplingParams(max_tokens=30)),
            ("stop_id", PROMPTS[2], greedy(30, stop_token_ids=[out[11]])),
            ("len", PROMPTS[2], greedy(13))]
    for k in (2, 5):
        want = run(LLMEngine(tiny, block_size=4, eos_ids={out[7]}), [(r, p, sp) for r, p, sp in reqs])
        engine = LLMEngine(tiny, block_size=4, eos_ids={out[7]}, speculative_config=spec(method, k, draft))
        assert run(engine, reqs) == want
        assert len(want["eos"][0]) == out.index(out[7]) + 1 and len(want["len"][0]) == 13
        assert_all_free(engine)


def test_n_greater_than_one_speculates_per_sample(tiny):
    reqs = [("a", PROMPTS[0], greedy(12, n=2)), ("b", PROMPTS[2], greedy(15, n=3))]
    want = run(LLMEngine(tiny, block_size=4), reqs)
    engine = LLMEngine(tiny, block_size=4, speculative_config=spec("ngram", 3))
    assert run(engine, reqs) == want
    assert engine.spec.stats.num_drafts > 0
    assert_all_free(engine)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_n_samples_fork_before_any_draft_when_the_prompt_ends_in_a_one_token_chunk(tiny, draft, method):
    """A prompt whose last chunk is one token has one token left to compute, like a decoding sequence; a draft
    there would be drawn before the request forks into its n samples, and the samples would share it."""
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    prompt = LOOP * 3 + [LOOP[0]]  # 19 tokens: a budget of 6 leaves a last chunk of one
    outs = {budget: run(LLMEngine(tiny, block_size=4, max_num_batched_tokens=budget,
                                  speculative_config=spec(method, 3, draft)), [("a", prompt, params)])["a"]
            for budget in (6, 256)}
    assert len(outs[6]) == 3 and len({tuple(s) for s in outs[6]}) == 3
    assert [s[0] for s in outs[6]] == [s[0] for s in outs[256]]  # each sample drew its own first token
    if method == "ngram":  # prompt lookup's tokens depend on the seed and the logits only (keyed_run)
        assert outs[6] == outs[256]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_recorded_logits_give_one_row_per_token_with_speculation(tiny, draft, method):
    engine = LLMEngine(tiny, block_size=4, record_logits=True, speculative_config=spec(method, 3, draft))
    done = run(engine, REQS[:3])
    assert engine.spec.stats.num_accepted_tokens > 0
    for rid, prompt, params in REQS[:3]:
        rows = engine.logits[(rid, 0)]
        assert [int(r.argmax()) for r in rows] == done[rid][0]  # greedy: each token is its row's argmax
        ref = recompute_logits(tiny, prompt + done[rid][0])[len(prompt) - 1:-1]  # what each token was drawn from
        torch.testing.assert_close(torch.stack(rows), ref, atol=1e-4, rtol=0)


def test_rollback_leaves_the_sequence_as_if_it_never_speculated(tiny):
    """After a step with k drafts and a accepted: a + 1 more tokens, computed count, block table and slot
    mapping equal to a sequence that never speculated (the same block ids, since the pool hands out the
    same free blocks in the same order)."""
    prompt = LOOP * 3
    spec_e = LLMEngine(tiny, block_size=4, num_blocks=40, speculative_config=spec("ngram", 5))
    plain = LLMEngine(tiny, block_size=4, num_blocks=40)
    for e in (spec_e, plain):
        e.add_request("r", {"prompt_token_ids": prompt}, greedy(40))
        e.step()  # prefill
    seq = spec_e.requests["r"].seqs[0]
    checked = 0
    while "r" in spec_e.requests:
        before = seq.num_tokens
        spec_e.step()
        if seq.is_finished:
            break
        run_ = spec_e.spec.stats
        grew = seq.num_tokens - before
        while plain.requests["r"].seqs[0].num_tokens < seq.num_tokens:
            plain.step()
        other = plain.requests["r"].seqs[0]
        assert seq.token_ids == other.token_ids
        assert seq.num_computed_tokens == other.num_computed_tokens == seq.num_tokens - 1
        assert spec_e.manager.num_tokens(seq.seq_id) == seq.num_computed_tokens
        table = spec_e.manager.block_table(seq.seq_id)
        assert len(table) == len(plain.manager.block_table(other.seq_id)) == -(-seq.num_computed_tokens // 4)
        positions = range(seq.num_computed_tokens)
        assert spec_e.manager.slot_mapping(seq.seq_id, positions) == [
            table[p // 4] * 4 + p % 4 for p in positions]
        checked += grew > 1
    assert checked > 0 and run_.num_accepted_tokens > 0


def test_drafts_shrink_before_anyone_is_preempted(tiny):
    """A pool that holds every sequence's own tokens but not their drafts: no preemption; drafts shrink."""
    reqs = [(str(i), LOOP * 2 + ids(2, i), greedy(8)) for i in range(4)]
    want = run(LLMEngine(tiny, block_size=4, num_blocks=16), reqs)
    plain = LLMEngine(tiny, block_size=4, num_blocks=16)
    run(plain, reqs)
    engine = LLMEngine(tiny, block_size=4, num_blocks=16, speculative_config=spec("ngram", 5))
    assert run(engine, reqs) == want
    assert engine.stats.preemptions == plain.stats.preemptions


@pytest.mark.parametrize("config,field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "four"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": 5}, "model must be a path"),
    ({"method": "ngram", "num_speculative_tokens": 10 ** 6}, "num_speculative_tokens is 1000000, at most 64"),
    ({"method": "ngram", "num_speculative_tokens": "auto", "max_num_speculative_tokens": 65},
     "max_num_speculative_tokens is 65"),
    ("ngram", "must be a dict"),
])
def test_config_is_refused_by_field(tiny, config, field):
    with pytest.raises(ValueError, match=field):
        LLMEngine(tiny, speculative_config=config)


def test_a_draft_with_another_vocabulary_is_refused(tiny):
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(tiny, speculative_config={"method": "draft_model", "model": random_decoder(V + 1),
                                            "num_speculative_tokens": 2})


def test_beam_search_is_refused_and_llm_takes_the_config(tiny):
    llm = LLM(tiny, speculative_config=spec("ngram", 3))
    with pytest.raises(ValueError, match="beam search"):
        llm.llm_engine.add_request("b", {"prompt_token_ids": PROMPTS[0]}, BeamSearchParams(beam_width=2, max_tokens=4))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], [greedy(n) for n in OUTS[:3]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [generate_cached(tiny, p, greedy(n)).tokens
                                                      for p, n in zip(PROMPTS[:3], OUTS[:3])]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(0, 5)), max_size=30),
       st.sampled_from(["ngram", "draft_model"]), st.integers(1, 4))
def test_random_add_step_abort_leaves_every_block_free(tiny, draft, actions, method, k):
    """Any interleaving: every request not aborted ends with its solo tokens; every block (target and
    draft) is free at the end."""
    engine = LLMEngine(tiny, block_size=4, num_blocks=28, max_num_batched_tokens=12,
                       speculative_config=spec(method, k, draft))
    added, aborted, done = {}, set(), {}

    def collect(outs):
        for out in outs:
            if out.finished and out.request_id not in aborted:
                done[out.request_id] = out.outputs[0].token_ids
    for action, i in actions:
        rid = f"r{i}"
        if action == "add" and rid not in added:
            added[rid] = (PROMPTS[i], greedy(OUTS[i]))
            engine.add_request(rid, {"prompt_token_ids": PROMPTS[i]}, added[rid][1])
        elif action == "abort" and rid in added and rid not in done:
            engine.abort_request(rid)
            aborted.add(rid)
        elif action == "step":
            collect(engine.step())
    while engine.has_unfinished_requests():
        collect(engine.step())
    for rid, (p, sp) in added.items():
        if rid not in aborted:
            assert done[rid] == generate_cached(tiny, p, sp).tokens, rid
    assert_all_free(engine)


SPEC_POINTS = ["schedule", "grow", "hash", "pack", "layer", "after_forward", "sample", "record", "commit", "append"]


@pytest.mark.parametrize("point,at,exc,method", sweep(
    SPEC_POINTS, [(1, "Interrupt"), (2, "InjectedError")], ["ngram", "draft_model"],
    # each point once, the methods taking turns, and prompt lookup's own sampling point
    fast=lambda point, at, exc, method: at == 2 and (
        method == ["draft_model", "ngram"][SPEC_POINTS.index(point) % 2] or point == "sample")))
def test_a_failed_step_with_speculation_changes_nothing_or_aborts(tiny, draft, point, at, exc, method, monkeypatch):
    """The robustness tests' injections (tests/test_engine_robust.py) with speculation on: a request either
    finishes with the tokens of a run without the failure (greedy ones: generate_cached's) or is reported
    aborted; every block, the draft's too, is free at the end."""
    import test_engine_robust as robust
    config = spec(method, 3, draft)
    reqs = [(str(i), p, params) for i, (p, params) in enumerate(robust.REQUESTS) if params.n == 1 or i == 4]
    clean, _, _ = robust.drive(LLMEngine(tiny, block_size=4, num_blocks=24, max_num_batched_tokens=16,
                                         speculative_config=config), reqs)
    engine = LLMEngine(tiny, block_size=4, num_blocks=24, max_num_batched_tokens=16, speculative_config=config)
    if point == "sample" and method == "ngram":  # prompt lookup's sampled rows draw in keyed_run
        import minillm.paged.spec_decode as spec_decode
        monkeypatch.setattr(spec_decode, "keyed_run", robust._once(spec_decode.keyed_run, at, getattr(robust, exc)))
    else:
        robust.inject(engine, point, at, monkeypatch, getattr(robust, exc))
    done, aborted, errors = robust.drive(engine, reqs)
    assert len(errors) == 1 and set(done) | aborted == {r for r, _, _ in reqs}
    if point not in ("append", "commit"):
        assert not aborted and done == clean
    for rid, prompt, params in reqs:
        if rid in done and params.greedy:
            assert done[rid] == [generate_cached(tiny, prompt, params).tokens]
    robust.assert_empty(engine)
    assert_all_free(engine)


class _Boom(RuntimeError):
    pass


def _raising_once(model, at):
    """The model, but its call number ``at`` raises (the step fails in the target's forward)."""
    calls = [0]

    class Raising(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] == at:
                raise _Boom(f"call {at}")
            return self.inner(*args, **kwargs)

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)
    return Raising()


DRAFT_FAILURES = {  # (engine settings, requests): a seeded sampled request beside others, a draft model
    "tight draft pool": (dict(block_size=1, num_blocks=40, max_num_seqs=4, eos_ids={23}),
                         [("r0", [245, 17, 245, 17, 245, 17, 166, 169, 168, 2, 298],
                           SamplingParams(max_tokens=26, temperature=0.8, seed=78, ignore_eos=True)),
                          ("r1", [73, 179, 8], SamplingParams(max_tokens=27, n=3))]),
    "a step that drafts nothing": (dict(block_size=4, num_blocks=6, max_num_batched_tokens=64),
                                   [("B", [214, 23, 84, 228, 32, 132, 80, 228, 270, 249, 287, 0], greedy(3)),
                                    ("A", [7, 8, 9, 7, 8, 9],
                                     SamplingParams(max_tokens=11, temperature=0.8, seed=11, ignore_eos=True))]),
}


@pytest.mark.parametrize("case", sweep(sorted(DRAFT_FAILURES), fast=lambda case: case != "tight draft pool"))
def test_a_failed_step_leaves_the_draft_model_as_it_found_it(tiny, draft, case):
    """A target forward that raises: the draft's KV goes back to what the step did not write and its drafts are
    keyed by position, so the retry drafts as the failed step did and a seeded request's tokens are those of the
    run without the failure. A preemption the failed step made stands (the victim's blocks may be written over):
    the retry may then leave a sampled request drafts of another length, and other tokens from the same law."""
    settings_, reqs = DRAFT_FAILURES[case]
    config = spec("draft_model", 4 if case == "tight draft pool" else 3, draft)

    def drive(at=None):
        engine = LLMEngine(tiny, speculative_config=config, **settings_)
        if at is not None:
            engine.model = _raising_once(engine.model, at)
        for rid, prompt, params in reqs:
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        done, preempted = {}, None
        while engine.has_unfinished_requests():
            running = {s.seq_id for s in engine.scheduler.running}
            try:
                outs = engine.step()
            except _Boom:
                preempted = running - {s.seq_id for s in engine.scheduler.running}
                continue
            done.update({o.request_id: [c.token_ids for c in o.outputs] for o in outs if o.finished})
        return done, preempted, engine

    clean, _, engine = drive()
    exact = 0
    # a failure at each of the clean run's first target forwards (up to 8: how many there are depends on the float
    # rounding of the attention path, which decides some greedy drafts)
    for at in range(1, min(8, engine.stats.summary(engine.block_size)["steps"]) + 1):
        done, preempted, engine = drive(at)
        assert preempted is not None, f"the forward raised at call {at} but no step failed"
        for rid, _, params in reqs:
            if params.greedy or not preempted:
                assert done[rid] == clean[rid], f"{rid}: the forward raised at call {at}"
        exact += not preempted
        assert_all_free(engine)
    assert exact >= 4  # most failures preempt nothing: there every token is checked


def test_a_seeded_draft_is_the_same_in_every_process():
    """The draft's generator is seeded from ints only (Python salts a string's hash per process)."""
    import subprocess
    import sys
    code = ("import torch; from minillm.paged.spec_draft import DraftRunner; from types import SimpleNamespace as N; "
            "r = DraftRunner.__new__(DraftRunner); r._seeds = {}; "
            "g = r._generator(N(request_id='x', params=N(seed=7)), 0, 12); print(torch.rand(3, generator=g).tolist())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": seed}).stdout for seed in ("0", "1")}
    assert len(outs) == 1, outs


SMALL_V = 5


@pytest.fixture(scope="module")
def small():
    target, other = random_decoder(SMALL_V, scale=0.3), random_decoder(SMALL_V, scale=0.3)
    torch.manual_seed(4)
    with torch.no_grad():  # random_decoder is seeded: the draft is the target, well shaken
        for p in other.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return target, other


def exact_law(model, prompt, params, n):
    """P(first n output tokens), enumerated over every sequence of the tiny vocabulary: (V ** n,)."""
    from minillm.sampling import logits_to_probs
    law = torch.ones(1, dtype=torch.float64)
    seqs = [[]]
    for _ in range(n):
        with torch.inference_mode():
            probs = torch.stack([logits_to_probs(model(torch.tensor([prompt + s]), torch.arange(len(prompt) + len(s)))
                                                 [0, -1:], params)[0] for s in seqs]).double()  # (S, V)
        law = (law[:, None] * probs).flatten()
        seqs = [s + [t] for s in seqs for t in range(SMALL_V)]
    return law


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_requests_follow_the_target_inside_a_batch(small, method):
    """1,500 seeded requests (T = 0.8, top-p 0.95) beside greedy ones in one engine: the law of their first
    three tokens (125 cells, the last two through the rejection sampler) equals the target's, enumerated
    exactly (chi-square, false alarm 1e-3)."""
    from test_speculative import FALSE_ALARM, chi_square_p_value
    target, draft_model = small
    prompt, n = [1, 2, 3, 1, 2], 3
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, ignore_eos=True, seed=s) for s in range(1500)]
    engine = LLMEngine(target, block_size=4, max_num_seqs=256, max_num_batched_tokens=1024,
                       speculative_config=spec(method, 2, draft_model))
    reqs = [(f"s{i}", prompt, p) for i, p in enumerate(params)] + [(f"g{i}", prompt + [i], greedy(6)) for i in range(3)]
    done = run(engine, reqs)
    counts = torch.zeros(SMALL_V ** n)
    for i in range(len(params)):
        a, b, c = done[f"s{i}"][0]
        counts[(a * SMALL_V + b) * SMALL_V + c] += 1
    assert engine.spec.stats.num_accepted_tokens < engine.spec.stats.num_draft_tokens  # rejections happened
    assert chi_square_p_value(counts, exact_law(target, prompt, params[0], n).float()) > FALSE_ALARM


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_seeded_request_gives_the_same_tokens_alone_as_in_a_batch(tiny, draft, method):
    """Prompt lookup: in any batch, whatever length of draft the budget, the pool or "auto" leaves it
    (``keyed_run``). A draft model: with room for every draft (a shortened draft uses the request's random
    numbers differently: other tokens from the same law)."""
    p = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=7)
    alone = run(LLMEngine(tiny, block_size=4, speculative_config=spec(method, 3, draft)), [("x", PROMPTS[2], p)])["x"]
    others = [(str(i), q, greedy(n) if i % 2 else SamplingParams(temperature=0.7, max_tokens=n, seed=i))
              for i, (q, n) in enumerate(zip(PROMPTS, OUTS))]
    reqs = others[:3] + [("x", PROMPTS[2], p)] + others[3:]
    assert run(LLMEngine(tiny, block_size=4, speculative_config=spec(method, 3, draft)), reqs)["x"] == alone
    if method == "ngram":
        for config, blocks, budget in [(spec("ngram", 3), 30, 24), (spec("ngram", "auto", step_cost=lambda n: 1 + 0.1 * n), None, 256),
                                       (spec("ngram", 1), None, 256)]:
            engine = LLMEngine(tiny, block_size=4, num_blocks=blocks, max_num_batched_tokens=budget,
                               speculative_config=config)
            assert run(engine, reqs)["x"] == alone


def test_auto_lengths_follow_the_step_cost_and_the_acceptance_rate():
    """Synthetic costs: a flat (memory-bound) step drafts everything worth anything; a step whose cost
    grows with its tokens as fast as they are emitted drafts nothing; a request whose drafts fail stops."""
    from minillm.paged.spec_auto import PiecewiseCost, choose_draft_lengths
    from minillm.speculative.rejection import expected_tokens_per_pass
    flat = lambda n: 1.0 + 1e-4 * n  # noqa: E731
    assert choose_draft_lengths([0.8, 0.9], [5, 5], 2, flat) == [5, 5]
    assert choose_draft_lengths([0.8, 0.05], [5, 5], 2, lambda n: 1.0 + 0.05 * n) == [5, 0]
    assert choose_draft_lengths([0.9] * 4, [5] * 4, 4, lambda n: float(n)) == [0] * 4  # compute-bound: no gain
    assert choose_draft_lengths([0.7], [3], 1, flat) == [3] and choose_draft_lengths([0.7], [0], 1, flat) == [0]
    # one sequence, cost 1 + c k: the choice maximises Leviathan's tokens per pass over the pass's cost
    for a, c in [(0.6, 0.1), (0.8, 0.2), (0.9, 0.05), (0.5, 0.4)]:
        k = choose_draft_lengths([a], [8], 1, lambda n: 1.0 + c * (n - 1))[0]
        best = max(range(9), key=lambda j: expected_tokens_per_pass(a, j) / (1 + c * j))
        assert k == best, (a, c)
    # a draft model's own cost per token counts against its drafts
    assert choose_draft_lengths([0.6], [5], 1, flat, draft_cost=lambda n: 0.7) == [0]
    assert choose_draft_lengths([0.6], [5], 1, flat, draft_cost=lambda n: 0.5) == [1]
    # two drafts for one sequence of two take two draft forwards, not two shares of one: a flat 0.5 s draft
    # forward does not pay here (per token, c(2) / 2 = 0.25 s, it would have seemed to: [2, 0])
    assert choose_draft_lengths([0.9, 0.1], [2, 2], 2, flat, draft_cost=lambda n: 0.5) == [0, 0]
    assert choose_draft_lengths([0.9, 0.9], [2, 2], 2, flat, draft_cost=lambda n: 0.3) == [2, 2]
    cost = PiecewiseCost([(1, 1.0), (4, 1.0), (8, 2.0)])
    assert cost(2) == 1.0 and cost(6) == 1.5 and cost(12) == 3.0


def test_auto_stops_a_request_whose_drafts_fail(tiny):
    engine = LLMEngine(tiny, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": "auto",
                                                               "step_cost": lambda n: 1.0 + 0.2 * n})
    seq_alpha = engine.spec.alpha
    engine.spec._alpha[0] = (0.0, 30.0, engine.steps)  # sequence 0 rejected 30 drafts, just now
    assert seq_alpha(0) < 0.04 and seq_alpha(1) == 0.5


def test_auto_starts_a_draft_models_sequences_from_its_measured_acceptance(tiny, draft):
    """The prior is the share of the draft's own greedy tokens the target's argmax agrees with: 1 for the target
    itself, less for a shaken copy; an unseen sequence's rate is the prior, and its own drafts move it."""
    from minillm.paged.spec_auto import measure_acceptance

    assert measure_acceptance(tiny, tiny, [1, 2, 3], n=16) == 1.0
    shaken = measure_acceptance(draft, tiny, [1, 2, 3], n=16)
    assert 0.0 < shaken < 1.0 and shaken * 16 == round(shaken * 16)
    engine = LLMEngine(tiny, block_size=4, speculative_config={"method": "draft_model", "model": draft,
                                                               "num_speculative_tokens": "auto"})
    assert engine.spec.prior == 0.5  # no tokenizer: nothing to measure on
    engine.spec.prior = 0.8
    assert engine.spec.alpha(7) == pytest.approx(0.8)
    engine.spec._alpha[7] = (1.0, 4.0, engine.steps)  # 1 of 4 accepted, just now
    assert engine.spec.alpha(7) == pytest.approx((1 + 1.6) / 6)


def test_auto_builds_with_drafts_and_prompts_it_cannot_measure_on(tiny):
    """A draft whose context is shorter than the step's token budget, and calibration prompts that do not fit a
    context, are empty or hold ids outside the vocabulary: the engine builds, with the prior 1 in 2."""
    from minillm.paged.spec_auto import measure_acceptance

    short = random_decoder(V, scale=0.3, max_seq_len=100)
    engine = LLMEngine(tiny, block_size=4, speculative_config={"method": "draft_model", "model": short,
                                                               "num_speculative_tokens": "auto", "step_cost": lambda n: 1.0})
    assert engine.spec.draft.cost.points[-1][0] == 100  # the draft's curve stops at its context
    assert measure_acceptance(short, tiny, list(range(1, 101))) is None  # no room after the prompt
    assert measure_acceptance(short, tiny, []) is None
    assert measure_acceptance(short, tiny, [1, V]) is None  # an id outside the vocabulary
    assert measure_acceptance(short, tiny, list(range(1, 90)), n=32) is not None  # 11 tokens of room: measured
    # the target's own curve stops at its context too (a step's budget of 256 tokens, a context of 100)
    engine = LLMEngine(short, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": "auto"})
    assert engine.spec.step_cost.points[-1][0] == 100
    # past the last point the curve never falls, though two close points timed in the wrong order
    from minillm.paged.spec_auto import PiecewiseCost
    noisy = PiecewiseCost([(1, 1.0), (4, 1.2), (5, 1.1)])
    assert noisy(256) == 1.1 and noisy(6) == 1.1
    assert PiecewiseCost([(4, 1.0), (5, 1.5)])(7) == 2.5  # a rising slope is followed


def test_auto_tries_again_once_old_failures_fade(tiny):
    """A copy begins after a preamble whose drafts fail: the rate forgets, so drafting resumes."""
    from minillm.paged.sequence import Sequence

    engine = LLMEngine(tiny, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": "auto",
                                                               "step_cost": lambda n: 1.0 + 0.1 * n})
    seq = Sequence.__new__(Sequence)
    seq.seq_id, seq.spec_token_ids = 0, [1, 2, 3, 4]
    engine.spec._alpha[0] = (0.0, 12.0, 0)  # the preamble: 12 drafts rejected
    drafted = []
    for _ in range(12):
        engine.steps += 1  # a committed step
        seq.spec_token_ids = [1, 2, 3, 4]
        kept = engine.spec._auto([(seq, None, 4)], [], [4])
        drafted.append(len(seq.spec_token_ids) if kept else 0)
    assert drafted[0] == 0 and drafted[-1] > 0 and drafted == sorted(drafted)  # held back, then drafting again
    assert engine.spec.alpha(0) > 0.3  # from 1/14 (the 12 rejections counted in full)


def test_a_quantized_copy_of_the_target_is_a_draft(tiny):
    """An int4 (RTN, groups of 32) copy of the target drafts: same vocabulary, greedy output unchanged,
    many drafts accepted; its blocks are freed with the target's."""
    import copy

    from minillm.quant import Recipe, quantize_model
    q = copy.deepcopy(tiny)
    quantize_model(q, Recipe.of("rtn", bits=4, group_size=32), progress=False)
    solo = {rid: [generate_cached(tiny, p, sp).tokens] for rid, p, sp in REQS}
    engine = LLMEngine(tiny, block_size=4, num_blocks=40, speculative_config=spec("draft_model", 4, q))
    assert run(engine, REQS) == solo
    assert engine.spec.stats.acceptance_rate > 0.3  # a random draft: about 1 / 300
    assert_all_free(engine)


def test_keyed_run_is_rejection_sampling_with_a_one_hot_draft():
    """Over 20,000 seeds: the first emitted token follows the target (chi-square), a draft x is accepted
    with probability p(x) = min(1, p(x) / 1), and the token after a rejection follows the residual p
    without x; the tokens depend on the seed and the position alone."""
    from test_speculative import FALSE_ALARM, chi_square_p_value

    from minillm.paged.spec_decode import keyed_run
    from minillm.speculative.rejection import residual_distribution
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.6, 0.1, 0.1, 0.1]])
    first, after_reject, accepted = torch.zeros(5), torch.zeros(5), 0
    for seed in range(20000):
        emitted, a = keyed_run([0], p, seed, 7)
        first[emitted[0]] += 1
        accepted += a
        if a == 0:
            after_reject[emitted[0]] += 1
        assert keyed_run([0], p, seed, 7) == (emitted, a)
        assert keyed_run([], p, seed, 7)[0] == emitted[:1] or a  # a draft changes nothing but what is kept
    assert chi_square_p_value(first, p[0]) > FALSE_ALARM
    assert abs(accepted / 20000 - 0.5) < 4 * (0.25 / 20000) ** 0.5
    onehot = torch.tensor([1.0, 0, 0, 0, 0])
    assert chi_square_p_value(after_reject, residual_distribution(p[0], onehot)) > FALSE_ALARM


def test_observed_forwards_move_the_measured_cost():
    from minillm.paged.spec_auto import PiecewiseCost
    cost = PiecewiseCost([(1, 1.0), (4, 1.0), (16, 2.0)])
    for _ in range(50):
        cost.observe(16, 8.0)  # the machine got 4x slower at 16 tokens
        cost.observe(15, 7.5)
    assert cost(16) == pytest.approx(8.0, rel=0.05)
    assert cost(1) == pytest.approx(4.0, rel=0.05)  # not run near yet: the level of the only point run (16)
    cost = PiecewiseCost([(1, 1.0), (3, 1.0), (16, 2.0)])
    cost.observe(16, 8.0)  # the first forward near a point sets it
    cost.observe(1, 1.5)
    assert cost(16) == 8.0 and cost(1) == 1.5
    # 3 not run near: its start's cost times the level (as run / at start) between 1's (1.5) and 16's (4), in log n
    assert cost(3) == pytest.approx(1.0 * (1.5 + (4.0 - 1.5) * math.log(3) / math.log(16)))
    # levels differ between points (a decode step is slower than the start's bare forward, a prefill not): the
    # curve never falls with the tokens, or drafts would look cheaper than free
    flat = PiecewiseCost([(1, 1.0), (2, 1.0), (4, 1.0), (8, 1.05), (16, 1.1), (32, 1.3), (64, 1.8), (128, 2.8)])
    flat.observe(1, 2.0)
    flat.observe(128, 2.9)
    costs = [flat(n) for n in range(1, 200)]
    assert costs == sorted(costs) and flat(1) == 2.0 and flat(16) == 2.0


def test_a_draft_forward_is_costed_by_the_tokens_it_feeds(tiny, draft, monkeypatch):
    """The first draft forward also feeds the tokens the draft has not seen (here the prompt and the first output):
    it is timed as a forward of that many tokens, and "auto" prices a sequence's first draft by what it would feed,
    so a sequence whose draft sat out for a while resumes only when its catch-up pays."""
    import types

    from minillm.paged import spec_draft
    from minillm.paged.spec_auto import PiecewiseCost, choose_draft_lengths
    config = spec("draft_model", "auto", draft, max_num_speculative_tokens=1, step_cost=lambda n: 1.0)
    engine = LLMEngine(tiny, block_size=4, speculative_config=config)
    runner = engine.spec.draft
    runner.cost = PiecewiseCost([(1, 1e-3), (64, 64e-3)])  # a draft forward of n tokens: n ms
    clock = iter(range(1000))
    monkeypatch.setattr(spec_draft, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    engine.add_request("0", {"prompt_token_ids": ids(20, 9)}, greedy(4))
    engine.step()  # the prefill: nothing to draft
    seq = engine.scheduler.running[0]
    assert runner.feed(seq) == 21  # the draft has seen nothing: the prompt and the first output
    engine.step()  # the first decode step drafts one token, feeding those 21
    assert runner.seconds == {21: 1.0}  # 1 s as timed, at 21 tokens
    assert runner.forward_cost(21) == 1.0 and runner.forward_cost(1) == pytest.approx(1e-3 / 21e-3)
    # two sequences at 0.9, a flat step: a draft forward of 1 token costs 0.1 s, of 40 tokens 4 s
    cost = lambda n: 0.1 * n  # noqa: E731
    assert choose_draft_lengths([0.9, 0.9], [1, 1], 2, lambda n: 1.0, cost, first_feed=[1, 1]) == [1, 1]
    assert choose_draft_lengths([0.9, 0.9], [1, 1], 2, lambda n: 1.0, cost, first_feed=[1, 40]) == [1, 0]


def test_a_catch_up_is_shared_among_the_steps_left(tiny, draft):
    """A draft that has not seen a sequence's prompt feeds all of it once, then 1 or 2 tokens a step: "auto"
    prices a drafting sequence at the steady feed plus its share of the catch-up forward's seconds, shared
    among the steps the request has left, so a catch-up is cheap early in a long request and whole at its end."""
    from minillm.paged.spec_auto import PiecewiseCost, choose_draft_lengths

    config = spec("draft_model", "auto", draft, max_num_speculative_tokens=1, step_cost=lambda n: 1.0)
    engine = LLMEngine(tiny, block_size=4, speculative_config=config)
    engine.spec.draft.cost = PiecewiseCost([(1, 1e-3), (64, 64e-3)])  # a draft forward of n tokens: n ms
    engine.add_request("long", {"prompt_token_ids": ids(20, 9)}, greedy(64))
    engine.add_request("short", {"prompt_token_ids": ids(20, 8)}, greedy(3))
    engine.step()  # both prefills: nothing drafted, the draft has seen neither
    seqs = {s.request_id: s for s in engine.scheduler.running}
    assert engine.spec.draft.feed(seqs["long"]) == engine.spec.draft.feed(seqs["short"]) == 21
    priced = {r: engine.spec._first_feed(s, engine.requests[r], 0.5, 1) for r, s in seqs.items()}
    # steady: 1 + 0.5 tokens; the catch-up: 21 - 1.5 ms shared among (64 - 1) / 1.5 or max(1, 2 / 1.5) steps
    assert priced["long"] == pytest.approx((1.5, 19.5e-3 / 42))
    assert priced["short"] == pytest.approx((1.5, 19.5e-3 / (2 / 1.5)))
    # a flat target step of 0.5 s, drafts at 0.9, a draft forward of n tokens n x 20 ms: the long request drafts,
    # the short one (the same catch-up in its last steps) does not
    (feed_l, up_l), (feed_s, up_s) = priced["long"], priced["short"]
    assert choose_draft_lengths([0.9, 0.9], [1, 1], 2, lambda n: 0.5, lambda n: 0.02 * n,
                                first_feed=[feed_l, feed_s], catch_up=[20 * up_l, 20 * up_s]) == [1, 0]
    engine.step()  # the long request drafts; from then on its draft feeds 1 or 2 tokens a step, no catch-up
    assert engine.spec.draft.feed(seqs["long"]) <= 2
    engine.spec.draft.seconds = {}  # priced on the n-ms curve alone, not on the forward as timed
    assert engine.spec._first_feed(seqs["long"], engine.requests["long"], 0.5, 1)[1] < up_l / 10


def test_drafts_take_what_the_sequences_after_them_leave():
    """The budget left to a sequence's drafts is the step's, less what was planned before it and what the
    sequences after it need for their own tokens: a sequence planned before it is counted once."""
    from minillm.paged import BlockManager, Scheduler, Sequence

    def two_running(older_drafts: bool):
        manager = BlockManager(64, 4, enable_prefix_caching=False)
        sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=16)
        a, b = Sequence(0, "a", 0, (0, 0), list(range(1, 9)), 8), Sequence(1, "b", 0, (1, 0), [1, 2, 3], 3)
        for seq in (a, b):
            sched.add(seq)
        out = sched.schedule()
        manager.commit()
        for seq, n in out.scheduled:  # both prompts ran; each sampled a token
            seq.num_computed_tokens += n
            seq.token_ids.append(7)
        drafting, other = (a, b) if older_drafts else (b, a)
        other.token_ids += list(range(20, 29))  # 10 tokens to compute; the other 1 and 4 drafts, in a budget of 16
        drafting.spec_token_ids = [5, 6, 7, 8]
        return sched, drafting

    sched, b = two_running(older_drafts=False)  # a (10 tokens) is planned first: b's drafts take the 6 left
    assert [n for _, n in sched.schedule().scheduled] == [10, 5] and b.spec_token_ids == [5, 6, 7, 8]
    sched, a = two_running(older_drafts=True)  # a and its drafts first: b's 10 tokens are kept for it
    assert [n for _, n in sched.schedule().scheduled] == [5, 10] and a.spec_token_ids == [5, 6, 7, 8]
    sched, a = two_running(older_drafts=True)
    sched.running[1].token_ids += [30, 31, 32]  # b needs 13: a keeps 2 drafts
    assert [n for _, n in sched.schedule().scheduled] == [3, 13] and a.spec_token_ids == [5, 6]
