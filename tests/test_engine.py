"""The continuous-batching engine (minillm.paged: LLMEngine, LLM, Scheduler) against generate_cached, on
tiny random models (fast): every greedy request gives the tokens it gives alone, whatever the pool,
budget, chunking, prefix hits, forks or interleaving; the logits agree with a recompute within 1e-4."""

import pytest
import torch
from helpers import random_decoder, write_tiny_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams, load_model
from minillm.generation import generate, generate_cached
from minillm.paged import LLMEngine, pack_rows, pack_rows_naive
from minillm.lab.engine_costs import measure_row_costs
from minillm.paged.batching import choose_row_width

V = 300
PROMPT_LENS, OUT_LENS = [5, 14, 23, 3, 31, 9], [6, 17, 3, 25, 8, 12]


@pytest.fixture(scope="module")
def tiny():
    return random_decoder(V, scale=0.3)  # flat enough that greedy tokens vary, peaked enough to avoid near-ties


def prompts(lens=PROMPT_LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def run(engine, reqs):
    """Add (id, prompt ids, params) requests, step until done; {id: [token ids per sample]}."""
    for rid, ids, p in reqs:
        engine.add_request(rid, {"prompt_token_ids": ids}, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    return done


def solo(model, ids, p):
    return generate_cached(model, ids, p).tokens


def recompute_logits(model, ids):
    """(len(ids), V) logits of every position, one forward without a cache (the naive path)."""
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids)))[0]


@pytest.mark.parametrize("num_blocks,budget,width,attention", [
    (None, 256, None, "bucketed"),  # everything fits: one prefill step, then decodes (one flat row per step)
    (None, 256, None, "indexed"),  # the same in (B, T) rows (pack_rows)
    (40, 16, None, "bucketed"),  # chunked prefill beside decodes, some preemption
    (14, 8, None, "bucketed"),  # a pool of about two requests: preemption and recompute
    (14, 7, 1, "indexed"),  # one token per row: a chunk cut into many rows of one sequence
    (40, 300, 4, "indexed"),
    (40, 16, None, "gather"),  # the reference read
    (40, 16, None, "blockwise"),  # the paper's online softmax, block by block
    (14, 8, None, "blockwise"),
])
def test_greedy_requests_equal_generate_cached_alone(tiny, num_blocks, budget, width, attention):
    ps = prompts()
    engine = LLMEngine(tiny, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget, row_width=width,
                       attention=attention, record_logits=True)
    done = run(engine, [(str(i), p, greedy(o)) for i, (p, o) in enumerate(zip(ps, OUT_LENS))])
    for i, (p, o) in enumerate(zip(ps, OUT_LENS)):
        assert done[str(i)] == [solo(tiny, p, greedy(o))]
        ref = recompute_logits(tiny, p + done[str(i)][0])[len(p) - 1:-1]  # the logits each token was drawn from
        got = torch.stack(engine.logits[(str(i), 0)])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert engine.manager.num_free_blocks == engine.num_blocks
    if num_blocks == 14:
        assert engine.stats.preemptions > 0


def test_pool_that_fits_one_request(tiny):
    """The smallest pool a request fits: every other request waits or is preempted, none is dropped."""
    ps = prompts([9, 9, 9, 9])
    engine = LLMEngine(tiny, block_size=4, num_blocks=5, max_num_batched_tokens=64)  # 9 + 11 = 20 tokens
    done = run(engine, [(str(i), p, greedy(11)) for i, p in enumerate(ps)])
    assert all(done[str(i)] == [solo(tiny, p, greedy(11))] for i, p in enumerate(ps))
    assert engine.manager.num_free_blocks == 5


def test_chunked_prefill_runs_beside_decodes_in_one_forward(tiny):
    short, long = prompts([4, 40])
    engine = LLMEngine(tiny, block_size=4, num_blocks=64, max_num_batched_tokens=10)
    engine.add_request("short", {"prompt_token_ids": short}, greedy(12))
    engine.step()  # the short prompt's prefill
    engine.add_request("long", {"prompt_token_ids": long}, greedy(4))
    engine.step()
    runs = engine.stats.records[-1].runs
    assert ("short", 0, 1, "decode") in runs and ("long", 0, 9, "prefill") in runs
    done = run(engine, [])
    assert done["long"] == [solo(tiny, long, greedy(4))]


def test_pack_rows_logits_equal_one_row_per_sequence(tiny):
    """The packer's rows (a chunk cut into rows) give the logits of the naive one-row-per-sequence layout."""
    ps = prompts([3, 17, 1, 8])
    outs = []
    for pack in (pack_rows_naive, lambda spans, S: pack_rows(spans, S, width=4)):
        engine = LLMEngine(tiny, block_size=4, num_blocks=32)
        for i, p in enumerate(ps):
            engine.manager.allocate(i, p)
        rows = pack([(i, 0, p) for i, p in enumerate(ps)], 17)
        engine.cache.set_rows(rows.seq_ids)
        with torch.inference_mode():
            logits = tiny(rows.tokens, rows.input_pos, engine.cache)
        outs.append(torch.stack([logits[rows.last[i]] for i in range(len(ps))]))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)
    assert choose_row_width([1] * 8, 100) == 1 and choose_row_width([64], 64) == 64
    assert set(measure_row_costs(tiny, num_rows=2, short=8, long=24, chunk=8)) == {"c_token_s", "c_key_s", "key_cost"}


def test_prefix_cache_hits_give_the_same_tokens(tiny):
    system = prompts([16])[0]
    a, b = prompts([5, 7], seed=1)
    engine = LLMEngine(tiny, block_size=4, num_blocks=64)
    first = run(engine, [("a", system + a, greedy(6))])
    engine.add_request("b", {"prompt_token_ids": system + b}, greedy(6))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert first["a"] == [solo(tiny, system + a, greedy(6))]
    assert outs[0].outputs[0].token_ids == solo(tiny, system + b, greedy(6))
    assert outs[0].num_cached_tokens == 16  # the shared system prompt's four full blocks
    assert engine.stats.summary(4)["prefix_hit_rate"] > 0


def test_n_greedy_samples_equal_greedy_and_share_blocks(tiny):
    p = prompts([13])[0]
    engine = LLMEngine(tiny, block_size=4, num_blocks=64)
    done = run(engine, [("r", p, SamplingParams(n=4, max_tokens=10, ignore_eos=True))])
    assert done["r"] == [solo(tiny, p, greedy(10))] * 4
    assert engine.stats.summary(4)["sharing_saved"] > 0.2  # the prompt's blocks held once, not four times
    assert engine.manager.num_free_blocks == 64


def test_seeded_request_same_alone_as_in_a_batch(tiny):
    ps = prompts()
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    params_n = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=9, ignore_eos=True)
    alone = run(LLMEngine(tiny, block_size=4), [("s", ps[1], params)])["s"]
    alone_n = run(LLMEngine(tiny, block_size=4), [("n", ps[2], params_n)])["n"]
    assert alone == [solo(tiny, ps[1], params)]  # sample 0's generator is generate_cached's
    crowd = [(str(i), p, greedy(o)) for i, (p, o) in enumerate(zip(ps, OUT_LENS))]
    mixed = run(LLMEngine(tiny, block_size=4, num_blocks=20, max_num_batched_tokens=9),
                crowd[:3] + [("s", ps[1], params), ("n", ps[2], params_n)] + crowd[3:])
    assert mixed["s"] == alone and mixed["n"] == alone_n
    assert len({tuple(t) for t in alone_n}) > 1  # the samples differ from each other


def test_abort_returns_every_block(tiny):
    ps = prompts()
    engine = LLMEngine(tiny, block_size=4, num_blocks=40, max_num_batched_tokens=16)
    for i, p in enumerate(ps):
        engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(n=2, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.manager.num_free_blocks < 40
    engine.abort_request([str(i) for i in range(len(ps))])
    assert not engine.has_unfinished_requests() and engine.manager.num_free_blocks == 40
    assert not engine.scheduler.has_unfinished()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(0, 5),
                              st.integers(1, 12), st.integers(1, 3)), min_size=1, max_size=30),
       num_blocks=st.integers(10, 30), budget=st.integers(1, 20),
       attention=st.sampled_from(["bucketed", "indexed", "blockwise"]))
def test_random_interleavings_finish_every_request_with_its_solo_tokens(tiny, ops, num_blocks, budget, attention):
    ps = prompts()
    engine = LLMEngine(tiny, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget, attention=attention)
    added, aborted, done, k = {}, set(), {}, 0
    for op, i, out_len, n in ops:
        if op == "add":
            rid = f"r{k}"
            k += 1
            p = SamplingParams(n=n, max_tokens=out_len, ignore_eos=True)
            try:
                engine.add_request(rid, {"prompt_token_ids": ps[i]}, p)
            except ValueError as e:
                assert "blocks" in str(e)  # refused only when it could never fit the pool
                continue
            added[rid] = (ps[i], out_len, n)
        elif op == "abort" and added:
            rid = sorted(added)[i % len(added)]
            if rid not in done:
                engine.abort_request(rid)
                aborted.add(rid)
        else:
            done.update({o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished})
    done.update(run(engine, []))
    for rid, (p, out_len, n) in added.items():
        if rid not in aborted:
            assert done[rid] == [solo(tiny, p, greedy(out_len))] * n
    assert engine.manager.num_free_blocks == num_blocks


def test_refusals_name_the_problem(tiny):
    engine = LLMEngine(tiny, block_size=4, num_blocks=6)
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\) and max_tokens \(8\) need 7 blocks.*pool has 6"):
        engine.add_request("big", {"prompt_token_ids": prompts([20])[0]}, greedy(8))
    engine.add_request("ok", {"prompt_token_ids": [1, 2]}, greedy(2))
    with pytest.raises(ValueError, match="request_id: 'ok' is already running"):
        engine.add_request("ok", {"prompt_token_ids": [1, 2]}, greedy(2))
    with pytest.raises(ValueError, match="text prompt needs a tokenizer"):
        engine.add_request("t", "hello", greedy(2))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("s", [1, 2], SamplingParams(stop="x"))
    with pytest.raises(ValueError, match="prompt: is empty"):
        engine.add_request("e", [], greedy(2))
    with pytest.raises(ValueError, match="n: completions per prompt"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="max_tokens: vLLM's name for max_new_tokens"):
        SamplingParams(max_tokens=3, max_new_tokens=4)
    assert run(engine, [])["ok"] == [solo(tiny, [1, 2], greedy(2))]  # the refused ones changed nothing


def test_sampling_params_take_vllm_names():
    p = SamplingParams(n=2, temperature=0.5, top_p=0.9, top_k=5, max_tokens=7, seed=1, stop=["x"], ignore_eos=True)
    assert p.max_new_tokens == p.max_tokens == 7 and p.n == 2 and p.stop == ("x",)
    assert SamplingParams(max_tokens=7) == SamplingParams(max_new_tokens=7)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "tiny.gguf"
    write_tiny_gguf(path)
    return load_model(path)


def test_stop_strings_eos_and_max_tokens_end_each_request_on_its_own(tiny_with_tokenizer):
    """As generate does: EOS (finish "stop", vLLM's name), a stop string (text cut before it), max_tokens."""
    model, tok = tiny_with_tokenizer
    llm = LLM(model, tokenizer=tok, block_size=4, num_blocks=64)
    text = "abc"
    free_run = generate_cached(model, tok.encode(text), SamplingParams(max_tokens=20, ignore_eos=True), tokenizer=tok)
    stop = tok.decode(free_run.tokens[3:5])
    params = [SamplingParams(max_tokens=20, stop=[stop]), SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=4), SamplingParams(max_tokens=20)]
    outs = llm.generate([text] * 4, params, use_tqdm=False)
    for out, p in zip(outs, params):
        ref = generate(model, tok.encode(text), p, tokenizer=tok)
        c = out.outputs[0]
        assert c.token_ids == ref.tokens and c.text == ref.text
        assert c.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[ref.finish_reason]
    assert outs[0].outputs[0].stop_reason == stop and outs[0].outputs[0].finish_reason == "stop"
    assert outs[2].outputs[0].finish_reason == "length" and len(outs[2].outputs[0].token_ids) == 4
    assert outs[0].metrics.first_token_time >= outs[0].metrics.arrival_time


def test_serve_bench_modes_agree_and_the_command_prints_json(tiny_with_tokenizer, tmp_path, capsys):
    """Every mode gives the sequential mode's greedy tokens; the command (--quick --json) prints one object
    with the four keys per mode the issue names (transformers' peer left out: it needs the real model)."""
    import argparse
    import json

    from minillm.lab.serve_bench import format_report, serve_bench
    from minillm.lab.serve_bench_cli import register

    model, tok = tiny_with_tokenizer
    report = serve_bench(model, tok, num_requests=5, scale=1 / 32, max_num_seqs=3, sharing_requests=2,
                         memory_requests=0, progress=False)
    report.pop("_engine")
    assert all(m["same_tokens_as_sequential"] == 5 for m in report["modes"].values())
    assert 0 < report["modes"]["engine"]["kv_utilization"] <= 1 and "goal engine_vs_static" in format_report(report)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve-bench", "--model", str(path), "--quick", "--json", "--threads", "1"])
    assert args.measures_speed and args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    for name in ("sequential", "static", "engine"):
        assert {"output_tokens_per_s", "total_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s"} <= set(out["modes"][name])
    assert {"kv_utilization", "preemptions", "prefix_hit_rate"} <= set(out["modes"]["engine"])
    spec = out["modes"]["engine+spec"]  # the command's default row: speculation changes no greedy token
    assert spec["speculative_config"] == {"method": "ngram", "num_speculative_tokens": "auto"}
    assert spec["same_tokens_as_sequential"] == out["num_requests"] and 0 <= spec["acceptance_rate"] <= 1
    assert abs(out["memory"]["kv_utilization"] - out["memory"]["lab_kv_utilization"]) < 0.01


def test_linear_floor_sums_each_steps_tokens_and_sampled_rows(tiny, monkeypatch):
    """The linear-layer floor of serve-bench: each step's blocks at its token count and the output layer
    at its sampled rows, interpolated between timed row counts (timings replaced by known ones here)."""
    from minillm.lab import engine_costs

    engine = LLMEngine(tiny, max_num_batched_tokens=16)
    run(engine, [(str(i), p, greedy(n)) for i, (p, n) in enumerate(zip(prompts(), OUT_LENS))])
    records = engine.stats.records
    assert sum(r.sampled for r in records) == sum(OUT_LENS)  # one sampled row per output token (greedy, n = 1)
    monkeypatch.setattr(engine_costs, "linear_seconds", lambda model, rows: {m: (2.0 * m, 0.5 * m) for m in rows})
    floor = engine_costs.linear_floor(tiny, records)
    tokens = sum(n for r in records for _, _, n, _ in r.runs)
    assert floor["linear_s"] == pytest.approx(2.0 * tokens + 0.5 * sum(OUT_LENS))  # linear in M: exact
    assert max(floor["grid"]) == max(max(sum(n for _, _, n, _ in r.runs) for r in records), 1)


def test_llm_keeps_no_statistics_unless_asked_and_serves_the_same_tokens(tiny):
    """vLLM's ``LLM`` disables its stat logging by default: the engine then counts its committed steps (what
    "auto" speculation fades by) and nothing else; asked for them, the counters agree and the tokens are the same."""
    requests = [{"prompt_token_ids": p} for p in prompts([9, 5])]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    quiet = LLM(tiny, block_size=4, num_blocks=32)
    counted = LLM(tiny, block_size=4, num_blocks=32, disable_log_stats=False)
    a = quiet.generate(requests, params, use_tqdm=False)
    b = counted.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert quiet.llm_engine.stats is None and quiet.llm_engine.steps == counted.llm_engine.steps > 0
    assert counted.llm_engine.stats.steps == counted.llm_engine.steps == len(counted.llm_engine.stats.records)
