"""The engine around a step: a step that raises anywhere leaves the engine as before or aborts
the requests it touched and says so; the prefix cache never serves keys and values that were not written;
``LLM.generate`` owns its requests; one driver thread; bounds, leaks and vLLM's names. Tiny random models."""

import functools
import os
import signal
import threading

import pytest
import torch
from helpers import random_decoder, sweep
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minillm.paged.engine as engine_module
import minillm.paged.sampler as sampler_module
from minillm import LLM, SamplingParams
from minillm.generation import generate_cached
from minillm.paged import BeamSearchParams, LLMEngine

V = 300


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt (a BaseException, as Ctrl-C and a Jupyter kernel interrupt raise)."""


class InjectedError(RuntimeError):
    """Stands in for an ordinary error (a CUDA out-of-memory error, a bug in a tokenizer)."""


@pytest.fixture(scope="module")
def tiny():
    return random_decoder(V, scale=0.3)


def ids(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = ids(9, 99)
# (prompt, params): greedy and seeded requests, a shared prefix, two identical prompts, n = 2
REQUESTS = [
    (SHARED + ids(6, 1), SamplingParams(max_tokens=9, ignore_eos=True)),
    (SHARED + ids(6, 1), SamplingParams(max_tokens=7, ignore_eos=True)),
    (SHARED + ids(3, 2), SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, seed=5)),
    (ids(17, 3), SamplingParams(max_tokens=12, ignore_eos=True)),
    (ids(4, 4), SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=7, n=2)),
    (ids(11, 5), SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.7, seed=11)),
    (ids(3, 9), SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=3, n=2)),  # forks copy on write
]


def solo(model, prompt, params):
    """The request's tokens alone: generate_cached for one sample, a fresh engine for n > 1."""
    if params.n == 1:
        return [generate_cached(model, prompt, params).tokens]
    engine = LLMEngine(model, block_size=4, num_blocks=64)
    return drive(engine, [("x", prompt, params)])[0]["x"]


def drive(engine, reqs, fail=None):
    """Add the requests, step to the end (an exception from a step is caught once, as a caller retrying
    would); returns ({id: tokens per sample} of finished requests, {id} of aborted ones, errors caught)."""
    for rid, prompt, params in reqs:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    done, aborted, errors = {}, set(), []
    for _ in range(500):
        if not engine.has_unfinished_requests():  # outputs a failed step left count too
            break
        try:
            outs = engine.step()
        except (Interrupt, InjectedError) as e:
            errors.append(e)
            continue
        for out in outs:
            if out.finished:
                if any(c.finish_reason == "abort" for c in out.outputs):
                    aborted.add(out.request_id)
                else:
                    done[out.request_id] = [c.token_ids for c in out.outputs]
    return done, aborted, errors


def assert_empty(engine):
    """Nothing left behind: every block free, no request (its stopper and generators live on it), no beam entry."""
    assert engine.manager.num_free_blocks == engine.num_blocks
    assert engine.manager.seq_ids() == []
    assert not engine.requests and not engine.beams.logprobs
    assert not engine.scheduler.running and not engine.scheduler.waiting


def _once(fn, at, exc=Interrupt):
    """``fn`` that raises ``exc`` on its ``at``-th call (1-based), and works otherwise."""
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise exc("injected")
        return fn(*args, **kwargs)
    wrapper.calls = calls
    return wrapper


class RaisingAfter:
    """The model, raising after its ``at``-th forward returned (an error between the forward and sampling)."""

    def __init__(self, model, at):
        self.model, self.at, self.calls = model, at, 0

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.calls += 1
        if self.calls == self.at:
            raise Interrupt("after the forward")
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def inject(engine, point, at, monkeypatch, exc=None):
    """Make the ``at``-th call at ``point`` of the engine's step raise ``exc`` (default ``Interrupt``)."""
    once = functools.partial(_once, exc=exc or Interrupt)
    if point == "schedule":
        engine.scheduler.schedule = once(engine.scheduler.schedule, at)
    elif point == "grow":  # inside the scheduler's reservation, after other sequences reserved
        engine.manager.grow = once(engine.manager.grow, at)
    elif point == "pack":
        monkeypatch.setattr(engine_module, "pack_flat", once(engine_module.pack_flat, at))
    elif point == "layer":  # inside the forward: layer 0 wrote its keys and values, layer 1 did not
        layer = engine.model.layers[1]
        layer.forward = once(layer.forward, at)
    elif point == "after_forward":
        engine.model = RaisingAfter(engine.model, at)
    elif point == "sample":  # a seeded draw, after other generators advanced
        monkeypatch.setattr(sampler_module, "sample", once(sampler_module.sample, at))
    elif point == "append":
        engine._append = once(engine._append, at)
    elif point == "hash":  # naming a block, inside a reservation (after its copy-on-write)
        engine.manager.prefix_cache.hash_fn = once(engine.manager.prefix_cache.hash_fn, at)
    elif point == "record":
        engine.stats.record_step = once(engine.stats.record_step, at)
    elif point == "commit":
        engine.stats.add = once(engine.stats.add, at)
    elif point == "beam":
        engine.beams.step = once(engine.beams.step, at)


POINTS = ["schedule", "grow", "hash", "pack", "layer", "after_forward", "sample", "record", "commit", "append"]


FAILURES = [(1, Interrupt), (2, InjectedError), (5, Interrupt)]


@pytest.mark.parametrize("at,exc,point", sweep(
    FAILURES, POINTS,  # each point once, the three failures taking turns
    fast=lambda at, exc, point: (at, exc) == FAILURES[POINTS.index(point) % 3]))
def test_a_failed_step_changes_nothing_or_aborts_and_says_so(tiny, point, at, exc, monkeypatch):
    """An exception at any point of a step, at the first, second or fifth call there: afterwards every
    request either finishes with its solo tokens or is reported aborted, every block is free, nothing
    is left behind; then the same prompts again (prefix-cache hits on what the failed step touched)
    give their solo tokens."""
    engine = LLMEngine(tiny, block_size=4, num_blocks=24, max_num_batched_tokens=16, record_logits=True)
    inject(engine, point, at, monkeypatch, exc)
    reqs = [(str(i), p, params) for i, (p, params) in enumerate(REQUESTS)]
    done, aborted, errors = drive(engine, reqs)
    assert len(errors) == 1, "the injected error reaches the caller exactly once"
    assert set(done) | aborted == {r for r, _, _ in reqs} and not set(done) & aborted
    if point not in ("append", "commit"):
        assert not aborted, "before appending, a failed step is undone: nothing is aborted"
    for rid, prompt, params in reqs:
        if rid in done:
            assert done[rid] == solo(tiny, prompt, params), rid
            if params.n == 1:  # no logits kept from an undone step
                assert len(engine.logits[(rid, 0)]) == len(done[rid][0]), rid
    assert_empty(engine)
    again, aborted2, errors2 = drive(engine, [(f"again{r}", p, params) for r, p, params in reqs])
    assert not aborted2 and not errors2
    for rid, prompt, params in reqs:
        assert again[f"again{rid}"] == solo(tiny, prompt, params), rid
    assert engine.manager.stats.hits > 0  # the second round did read the prefix cache
    assert_empty(engine)


def test_interrupted_prefill_leaves_no_findable_block(tiny):
    """Finding 1: an interrupt during a long prefill, then the same prompt again: no block of the failed
    forward is served from the prefix cache, and the text is generate_cached's."""
    prompt = ids(40, 8)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm = LLM(tiny, block_size=4, num_blocks=40, max_num_batched_tokens=64)
    layer = tiny.layers[1]
    layer.forward = _once(layer.forward, 1)
    try:
        with pytest.raises(Interrupt):
            llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    finally:
        del layer.forward
    assert llm.llm_engine.manager.stats.hits == 0
    assert all(not llm.llm_engine.manager.is_cached(b) for b in range(llm.llm_engine.num_blocks))
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == generate_cached(tiny, prompt, params).tokens
    again = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 36 and again.outputs[0].token_ids == out.outputs[0].token_ids


def test_interrupted_generate_leaves_nothing_and_retry_is_correct(tiny):
    """Finding 2: an interrupt in the middle of LLM.generate aborts that call's requests (no block held,
    nothing run by the next call); the retry gives the right tokens at once."""
    llm = LLM(tiny, block_size=4, num_blocks=40)
    prompts = [{"prompt_token_ids": p} for p, _ in REQUESTS[:4]]
    params = [p for _, p in REQUESTS[:4]]
    llm.llm_engine._append = _once(llm.llm_engine._append, 6)
    with pytest.raises(Interrupt):
        llm.generate(prompts, params, use_tqdm=False)
    del llm.llm_engine._append
    assert_empty(llm.llm_engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, (prompt, p) in zip(outs, REQUESTS[:4]):
        assert [c.token_ids for c in out.outputs] == solo(tiny, prompt, p)


def test_generate_owns_its_requests(tiny):
    """Finding 4: generate neither runs nor drops a request added through llm_engine.add_request, and its
    own request ids never collide with the caller's."""
    llm = LLM(tiny, block_size=4, num_blocks=40)
    llm.llm_engine.add_request("0", {"prompt_token_ids": ids(5, 1)}, SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(RuntimeError, match="holds 1 requests added through llm_engine.add_request"):
        llm.generate({"prompt_token_ids": ids(5, 2)}, use_tqdm=False)
    assert list(llm.llm_engine.requests) == ["0"]  # the caller's request is untouched
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    out = llm.generate([{"prompt_token_ids": ids(5, 2)}, {"prompt_token_ids": ids(6, 3)}], use_tqdm=False)
    assert all(o.request_id not in ("0", "1") for o in out) and len({o.request_id for o in out}) == 2


def test_a_second_thread_gets_a_clear_error(tiny):
    """Finding 3: while one thread is inside generate, another thread's generate, add_request or step is
    refused with a clear error; the first call's text is right and nothing is corrupted."""
    llm = LLM(tiny, block_size=4, num_blocks=40)
    inside, release = threading.Event(), threading.Event()
    layer = tiny.layers[0]
    real = layer.forward

    def slow(*args, **kwargs):
        inside.set()
        release.wait(30)
        return real(*args, **kwargs)
    layer.forward = slow
    prompt, params = REQUESTS[3]
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=llm.generate({"prompt_token_ids": prompt}, params,
                                                                            use_tqdm=False)))
    worker.start()
    try:
        assert inside.wait(30)
        del layer.forward
        with pytest.raises(RuntimeError, match="another thread is driving this engine"):
            llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        with pytest.raises(RuntimeError, match="another thread"):
            llm.llm_engine.add_request("x", {"prompt_token_ids": prompt}, params)
        with pytest.raises(RuntimeError, match="another thread"):
            llm.llm_engine.step()
    finally:
        release.set()
        worker.join(30)
    assert result["out"][0].outputs[0].token_ids == solo(tiny, prompt, params)[0]
    assert_empty(llm.llm_engine)


def test_identical_prompts_in_one_step_share_their_full_blocks(tiny):
    """Finding 12: two identical prompts admitted in the same step share the full blocks the step writes."""
    engine = LLMEngine(tiny, block_size=4, num_blocks=40)
    prompt = ids(13, 6)
    for rid in "ab":
        engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    a, b = engine.block_table("a"), engine.block_table("b")
    assert a[:3] == b[:3] and a[3] != b[3]  # 12 tokens in 3 full blocks shared; the last token is each one's
    assert engine.requests["b"].num_cached_tokens == 12
    done, _, _ = drive(engine, [])
    assert done["a"] == done["b"] == [generate_cached(tiny, prompt, SamplingParams(max_tokens=4, ignore_eos=True)).tokens]


def test_forks_and_beams_count_toward_max_num_seqs(tiny):
    """Finding 12: a request that forks into n samples takes n seats when admitted, so the running
    sequences never exceed max_num_seqs; beams likewise."""
    engine = LLMEngine(tiny, block_size=4, num_blocks=64, max_num_seqs=4)
    engine.add_request("a", {"prompt_token_ids": ids(5, 1)}, SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=1,
                                                                           ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": ids(6, 2)}, SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=2,
                                                                           ignore_eos=True))
    engine.add_request("c", {"prompt_token_ids": ids(7, 3)}, BeamSearchParams(beam_width=2, max_tokens=4))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
        assert sum(s.seats for s in engine.scheduler.running) <= 4
    assert most == 3
    assert_empty(engine)


def test_n_and_beam_width_are_bounded(tiny):
    """Finding 8: n and beam_width beyond what max_num_seqs and the pool can run together are refused,
    naming both, before anything is allocated."""
    engine = LLMEngine(tiny, block_size=4, num_blocks=40, max_num_seqs=8)
    with pytest.raises(ValueError, match=r"n: 1000000000 samples .* at most 8 .*max_num_seqs=8, a pool of 40 blocks"):
        engine.add_request("a", {"prompt_token_ids": [1, 2]}, SamplingParams(n=10 ** 9))
    with pytest.raises(ValueError, match=r"beam_width: 9 beams .*max_num_seqs=8"):
        engine.add_request("b", {"prompt_token_ids": [1, 2]}, BeamSearchParams(beam_width=9, max_tokens=2))
    assert_empty(engine)


def test_refusals_leave_nothing_and_abort_takes_any_id(tiny):
    """Findings 9 and 10: a refused add leaves no stopper; abort_request takes an int id as add_request
    does; abort frees everything (generators of samples never forked included)."""
    engine = LLMEngine(tiny, tokenizer=None, block_size=4, num_blocks=6)
    with pytest.raises(ValueError, match="need 7 blocks"):
        engine.add_request("big", {"prompt_token_ids": ids(20, 1)}, SamplingParams(max_tokens=8))
    engine.add_request(5, {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=0))
    engine.step()
    engine.abort_request(5)
    engine.abort_request([5, "never added", ["unhashable"]])
    assert_empty(engine)


@pytest.mark.parametrize("kwargs,name", [
    ({"block_size": 2.5}, "block_size"), ({"num_blocks": 2.5}, "num_blocks"), ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_seq_len": -5}, "max_seq_len"), ({"max_seq_len": 0}, "max_seq_len"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"), ({"kv_cache_bytes": -1}, "kv_cache_bytes"),
])
def test_settings_are_refused_by_name(tiny, kwargs, name):
    """Findings 10-11: a bad engine setting names itself (not kv_bytes), on LLM and on LLMEngine."""
    with pytest.raises(ValueError, match=f"^{name}: "):
        LLM(tiny, **kwargs)
    with pytest.raises(ValueError, match=f"^{name}: "):
        LLMEngine(tiny, **kwargs)


def test_beam_search_leaves_nothing_behind(tiny):
    """Finding 9: a finished beam search leaves no entry in the engine; its output carries the beams."""
    llm = LLM(tiny, block_size=4, num_blocks=40)
    out = llm.beam_search([{"prompt_token_ids": ids(6, 1)}], BeamSearchParams(beam_width=3, max_tokens=4))
    assert len(out[0].sequences) == 3
    assert_empty(llm.llm_engine)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step", "step"]), st.integers(0, 5)),
                min_size=1, max_size=40))
def test_random_add_abort_step_leaves_nothing(tiny, actions):
    """Finding 9: after any interleaving of adds, aborts and steps, and stepping to the end, every request
    not aborted finishes with its solo tokens and nothing is left in the engine."""
    engine = LLMEngine(tiny, block_size=4, num_blocks=16, max_num_batched_tokens=12, max_num_seqs=4)
    added, aborted, done = {}, set(), {}

    def collect(outs):
        for out in outs:
            if out.finished and out.request_id not in aborted:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    for action, k in actions:
        rid = f"r{k}"
        if action == "add" and rid not in added:
            added[rid] = REQUESTS[k]
            engine.add_request(rid, {"prompt_token_ids": REQUESTS[k][0]}, REQUESTS[k][1])
        elif action == "abort" and rid in added and rid not in done:
            engine.abort_request(rid)
            aborted.add(rid)
        elif action == "step":
            collect(engine.step())
    while engine.has_unfinished_requests():
        collect(engine.step())
    for rid, (prompt, params) in added.items():
        if rid not in aborted:
            assert done[rid] == solo(tiny, prompt, params)
    assert_empty(engine)


def test_stop_token_ids_end_a_request_with_vllms_stop_reason(tiny):
    """Finding 12: SamplingParams(stop_token_ids=...) ends an engine request at the first such token,
    finish_reason "stop" and stop_reason the id, as generate_cached ends it."""
    prompt = ids(7, 12)
    free = generate_cached(tiny, prompt, SamplingParams(max_tokens=12, ignore_eos=True)).tokens
    stop = free[4]
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    out = LLM(tiny, block_size=4, num_blocks=40).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    first = free.index(stop)
    assert out.outputs[0].token_ids == free[:first + 1] == generate_cached(tiny, prompt, params).tokens
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_a_failed_append_keeps_the_other_requests_outputs(tiny):
    """A request whose append fails is aborted; another request that finished in the same step is still
    reported (by the next step), and has_unfinished_requests says so until then."""
    engine = LLMEngine(tiny, block_size=4, num_blocks=24)
    real = engine._append

    def append(req, seq, token, logprob):
        if req.request_id == "a":
            raise InjectedError("in a's append")
        return real(req, seq, token, logprob)
    engine._append = append
    engine.add_request("a", {"prompt_token_ids": ids(5, 1)}, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": ids(6, 2)}, SamplingParams(max_tokens=1, ignore_eos=True))
    with pytest.raises(InjectedError):
        engine.step()
    assert engine.has_unfinished_requests() and not engine.requests
    with pytest.raises(ValueError, match="request_id: 'b' is already running"):
        engine.add_request("b", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=1))
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].outputs[0].finish_reason == "abort"
    assert outs["b"].finished and outs["b"].outputs[0].token_ids == solo(tiny, ids(6, 2), SamplingParams(
        max_tokens=1, ignore_eos=True))[0]
    assert not engine.has_unfinished_requests()
    assert_empty(engine)


def test_outputs_of_a_failed_step_survive_another_failure_and_an_abort_lets_them_go(tiny):
    engine = LLMEngine(tiny, block_size=4, num_blocks=24)
    engine._append = _once(engine._append, 1, InjectedError)
    engine.add_request("a", {"prompt_token_ids": ids(5, 1)}, SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(InjectedError):
        engine.step()
    engine.scheduler.schedule = _once(engine.scheduler.schedule, 1, InjectedError)
    engine.add_request("c", {"prompt_token_ids": ids(4, 3)}, SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(InjectedError):
        engine.step()
    assert [o.request_id for o in engine.step()] == ["a", "c"]  # a's abort, then c's first token
    engine.abort_request("c")
    engine._append = _once(engine._append, 1, InjectedError)
    engine.add_request("d", {"prompt_token_ids": ids(4, 4)}, SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(InjectedError):
        engine.step()
    engine.abort_request("d")  # the caller lets it go: its pending output goes too
    assert not engine.has_unfinished_requests()
    assert_empty(engine)


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler for the test: a suite started in the background by a shell inherits SIGINT
    ignored, and a real SIGINT would then raise nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("sigint_raises")
def test_ctrl_c_during_bookkeeping_waits_for_a_whole_state(tiny):
    """A real SIGINT delivered while the scheduler moves a sequence between its lists, or while a step
    appends, is raised once the state is whole: the step is undone (or completed, its outputs returned
    by the next step), and the requests then give their solo tokens."""
    for where in ("add_running", "_append"):
        engine = LLMEngine(tiny, block_size=4, num_blocks=24, max_num_batched_tokens=16)
        owner = engine.scheduler if where == "add_running" else engine
        real = getattr(owner, where)
        sent = []

        def hook(*args, real=real, sent=sent):
            if not sent:
                sent.append(True)
                os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of the bookkeeping
            return real(*args)
        setattr(owner, where, hook)
        reqs = [(str(i), p, params) for i, (p, params) in enumerate(REQUESTS[:4])]
        for rid, prompt, params in reqs:
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        done, aborted, errors = drive(engine, [])
        assert not aborted and not errors
        for rid, prompt, params in reqs:
            assert done[rid] == solo(tiny, prompt, params), (where, rid)
        assert_empty(engine)
