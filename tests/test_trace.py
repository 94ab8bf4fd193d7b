"""The engine's trace (LLMEngine(trace=PATH)) and its replay (minillm.lab.replay): replaying the file rebuilds the
engine's own block tables, reference counts, free count, prefix-cached blocks and each block's tokens after
every step, through prefix hits, forks with copy-on-write, preemption and speculation; tracing changes nothing
the engine computes or caches; bad files and paths are refused by name."""

import json
import re

import pytest
import torch
from helpers import random_decoder

from minillm import LLM, SamplingParams
from minillm.cli import main
from minillm.lab.replay import TraceError, read_trace, replay, write_html, write_png
from minillm.paged import LLMEngine

V = 300


@pytest.fixture(scope="module")
def tiny():
    return random_decoder(V, scale=0.3)


def ids(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


LOOP = ids(6, 50)  # repeated, so that prompt lookup finds drafts
SHARED = LOOP * 3  # a shared prefix: prefix-cache hits


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


# (engine settings, requests added at which step): each workload makes the engine share, fork, copy and preempt
WORKLOADS = {
    "fork_prefix_preempt": (dict(num_blocks=14, block_size=4, max_num_batched_tokens=24), [
        (0, "A", SHARED[:9] + [1, 2], greedy(10)),
        (0, "B", SHARED[:9] + [3], SamplingParams(max_tokens=6, ignore_eos=True, n=2, temperature=1.0, seed=1)),
        (0, "C", ids(14, 7), greedy(12)),
        (2, "D", SHARED[:9] + [7, 8, 9], greedy(4)),
    ]),
    "speculation": (dict(num_blocks=20, block_size=4, max_num_batched_tokens=16,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 4}), [
        (0, "0", SHARED + ids(2, 1), greedy(6)),
        (0, "1", SHARED + ids(5, 2), greedy(17)),
        (0, "2", LOOP * 2 + ids(9, 3), greedy(30)),
        (0, "3", ids(7, 4), greedy(25)),
        (1, "4", SHARED + ids(2, 1), greedy(9)),
        (1, "5", ids(23, 5), SamplingParams(max_tokens=12, ignore_eos=True, n=2, temperature=0.8, seed=3)),
    ]),
}


def snapshot(engine) -> dict:
    """The engine's own view of its pool, read from the block manager and the sequences."""
    manager = engine.manager
    seqs = {s.seq_id: s for s in engine.scheduler.running}
    return {"tables": {sid: manager.block_table(sid) for sid in manager.seq_ids()},
            "owners": {sid: (seqs[sid].request_id, seqs[sid].index) for sid in manager.seq_ids()},
            "ref_counts": list(manager.ref_counts), "free": manager.num_free_blocks,
            "cached": {b for b in range(engine.num_blocks) if manager.is_cached(b)},
            "tokens": {sid: list(seqs[sid].token_ids[:manager.num_tokens(sid)]) for sid in manager.seq_ids()}}


def drive(engine, workload) -> tuple[list[dict], dict]:
    """Run the workload; the engine's snapshot after every step that ran, and each request's outputs."""
    _, requests = workload
    snaps, done, step = [], {}, 0
    while True:
        for at, rid, prompt, params in requests:
            if at == step:
                engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        if not engine.has_unfinished_requests() and step > max(at for at, *_ in requests):
            break
        before = engine.stats.steps
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.finish_reason) for c in out.outputs]
        if engine.stats.steps > before:
            snaps.append(snapshot(engine))
        step += 1
    return snaps, done


@pytest.fixture(scope="module", params=sorted(WORKLOADS))
def traced(request, tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / f"{request.param}.jsonl"
    settings, _ = WORKLOADS[request.param]
    engine = LLMEngine(tiny, trace=path, **settings)
    snaps, done = drive(engine, WORKLOADS[request.param])
    return request.param, engine, path, snaps, done


def test_replay_rebuilds_the_engines_pool_after_every_step(traced):
    name, engine, path, snaps, _ = traced
    trace = read_trace(path)
    states = list(replay(trace))
    assert len(states) == len(snaps) == engine.stats.steps
    for state, snap in zip(states, snaps):
        k = state.step["step"]
        assert state.tables == snap["tables"], f"step {k}: block tables"
        assert state.owners == snap["owners"], f"step {k}: owners"
        assert state.ref_counts == snap["ref_counts"], f"step {k}: reference counts"
        assert state.free == snap["free"] == state.step["free"], f"step {k}: free blocks"
        assert state.cached == snap["cached"], f"step {k}: prefix-cached blocks"
        assert sorted(state.step["shared"]) == [b for b, r in enumerate(snap["ref_counts"]) if r > 1]
        for sid, table in snap["tables"].items():
            bs = engine.block_size
            for j, block in enumerate(table):
                if state.ref_counts[block] == 1:  # a shared block reads from its first table: the same tokens
                    assert state.block_tokens(block) == snap["tokens"][sid][j * bs:(j + 1) * bs], f"step {k}"
    # the workload did what it is there for: the replay saw each event the lessons ask about
    lines = trace.steps
    assert any(s["prefix_hits"] for s in lines) and any(s["shared"] for s in lines)
    if name == "fork_prefix_preempt":
        assert any(s["copied"] for s in lines) and any(s["preempted"] for s in lines)
        assert any(r["kind"] == "recompute" for s in lines for r in s["batch"])
    else:
        runs = [r for s in lines for r in s["batch"] if r["drafts"]]
        assert any(r["accepted"] for r in runs) and any(r["accepted"] < r["drafts"] for r in runs)
        spec = engine.stats.spec_decoding
        assert sum(r["drafts"] for r in runs) == spec.num_draft_tokens
        assert sum(r["accepted"] for r in runs) == spec.num_accepted_tokens


def test_batch_taken_freed_and_finished_agree_with_the_engine(traced):
    """Each line's batch is the step's record; taken and freed are the changes of the held blocks; every sample
    finishes once, with its output's reason."""
    _, engine, path, _, done = traced
    trace = read_trace(path)
    kept = {r.step: r for r in engine.stats.records}
    held = set()
    for line in trace.steps:
        rec = kept[line["step"]]
        assert [(r["request"], r["index"], r["tokens"], r["kind"]) for r in line["batch"]] == \
            [tuple(run) for run in rec.runs]
        assert [(p["request"], p["index"]) for p in line["preempted"]] == rec.preempted
        now = {b for e in line["seqs"] for b in e["table"]}
        assert line["taken"] == sorted(now - held) and line["freed"] == sorted(held - now)
        held = now
    finished = {(f["request"], f["index"]): f["reason"] for s in trace.steps for f in s["finished"]}
    assert len(finished) == sum(1 for s in trace.steps for _ in s["finished"])  # each once
    assert finished == {(rid, i): reason for rid, outs in done.items() for i, (_, reason) in enumerate(outs)}


def test_tracing_changes_nothing_the_engine_computes_or_caches(traced, tiny):
    name, engine, _, snaps, done = traced
    plain = LLMEngine(tiny, **WORKLOADS[name][0])
    plain_snaps, plain_done = drive(plain, WORKLOADS[name])
    assert plain_done == done and plain_snaps == snaps
    cache, plain_cache = engine.manager.prefix_cache, plain.manager.prefix_cache
    assert (cache.stats.queries, cache.stats.hits) == (plain_cache.stats.queries, plain_cache.stats.hits)
    assert cache.times_taken == plain_cache.times_taken
    assert engine.manager.free_block_ids() == plain.manager.free_block_ids()
    assert engine.stats.summary(4) == plain.stats.summary(4)


def test_no_trace_unless_asked(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = LLMEngine(tiny, num_blocks=16)
    engine.add_request("a", [1, 2, 3], greedy(3))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.trace is None and list(tmp_path.iterdir()) == []


def test_llm_takes_trace_and_its_path_is_checked_first(tiny, tmp_path):
    llm = LLM(tiny, num_blocks=16, trace=tmp_path / "t.jsonl")
    llm.generate([[1, 2, 3], [1, 2, 4]], greedy(4), use_tqdm=False)
    trace = read_trace(tmp_path / "t.jsonl")
    assert trace.header["num_blocks"] == 16 and len(trace.steps) == llm.llm_engine.stats.steps == 4
    with pytest.raises(ValueError, match="trace: the folder .*missing does not exist; create it"):
        LLM("/nonexistent/model.gguf", trace=tmp_path / "missing" / "t.jsonl")  # refused before loading
    with pytest.raises(ValueError, match="is a folder; give a file path"):
        LLMEngine(tiny, num_blocks=16, trace=tmp_path)


def test_a_failed_write_stops_the_trace_and_the_engine_goes_on(tiny, tmp_path, capsys):
    engine = LLMEngine(tiny, num_blocks=16, trace=tmp_path / "t.jsonl")
    engine.stats.trace._file.close()  # as a full disk would: the next write raises
    engine.add_request("a", [1, 2, 3], greedy(3))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    assert capsys.readouterr().err.count("the engine goes on without its trace") == 1


def write_lines(path, lines, end="\n"):
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + end)
    return path


def test_bad_trace_files_are_refused_naming_line_and_field(traced, tmp_path, capsys):
    _, _, path, _, _ = traced
    lines = path.read_text().splitlines()
    header, first = json.loads(lines[0]), json.loads(lines[1])
    with pytest.raises(TraceError, match="is not a file"):
        read_trace(tmp_path / "nothing.jsonl")
    with pytest.raises(TraceError, match="line 1 is not a minillm engine trace's header"):
        read_trace(write_lines(tmp_path / "a.jsonl", [{"step": 0}]))
    with pytest.raises(TraceError, match="has version 99"):
        read_trace(write_lines(tmp_path / "b.jsonl", [{**header, "version": 99}]))
    with pytest.raises(TraceError, match="line 3 is not JSON"):
        read_trace(write_lines(tmp_path / "c.jsonl", [header, first, "{oops", first]))
    with pytest.raises(TraceError, match="line 2: missing 'seqs', 'free'"):
        read_trace(write_lines(tmp_path / "d.jsonl", [header, {k: v for k, v in first.items()
                                                                if k not in ("seqs", "free")}]))
    cut = read_trace(write_lines(tmp_path / "e.jsonl", [header, first, lines[2][:40]], end=""))  # a run killed mid-line
    assert len(cut.steps) == 1 and "line 3 is cut short" in capsys.readouterr().err
    bad = {**first, "seqs": [{**first["seqs"][0], "table": [10_000]}]}
    with pytest.raises(TraceError, match="holds block 10000, outside the pool"):
        list(replay(read_trace(write_lines(tmp_path / "f.jsonl", [header, bad]))))


def test_replay_command_writes_one_self_contained_page_and_a_png(traced, tmp_path, capsys):
    name, _, path, _, _ = traced
    out, png = tmp_path / "r.html", tmp_path / "r.png"
    assert main(["trace", "replay", str(path), "--out", str(out), "--png", str(png), "--steps", "0,2"]) == 0
    page = out.read_text()
    data = json.loads(page.split('id="trace-data">')[1].split("</script>")[0].replace("<\\/", "</"))
    assert data["steps"] == read_trace(path).steps  # every step, as recorded
    for fetch in ("<link", "src=", "@import", "url(", "fetch(", "XMLHttpRequest"):
        assert fetch not in page, f"the page would fetch something: {fetch}"
    assert [u for u in page.split("http")[1:] if not u.startswith("://www.w3.org/2000/svg")] == []
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "steps 0, 2" in capsys.readouterr().out
    assert main(["trace", "replay", str(path), "--out", str(tmp_path / "x.txt")]) == 2
    assert main(["trace", "replay", str(path), "--out", str(out), "--png", str(png), "--steps", "0,9999"]) == 2
    assert main(["trace", "replay", str(path), "--out", str(out), "--png", str(png), "--steps", "a,b"]) == 2
    assert "--steps: 'a,b' is not a comma-separated list" in capsys.readouterr().err


def test_png_refuses_steps_the_trace_does_not_hold(traced, tmp_path):
    _, _, path, _, _ = traced
    trace = read_trace(path)
    with pytest.raises(ValueError, match=r"steps: \[9999\] not in the trace"):
        write_png(trace, [0, 9999], tmp_path / "x.png")
    write_html(trace, tmp_path / "ok.html")
    assert (tmp_path / "ok.html").stat().st_size > 0


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny random llama with a tokenizer, as a file the commands load."""
    from helpers import write_tiny_gguf

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def test_serve_bench_writes_the_engine_runs_trace(tiny_gguf, tmp_path, capsys):
    path = tmp_path / "bench.jsonl"
    assert main(["serve-bench", "--model", str(tiny_gguf), "--quick", "--requests", "3", "--scale", "0.0625",
                 "--no-spec-row", "--json", "--threads", "1", "--trace-out", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    trace = read_trace(path)
    assert len(trace.steps) == report["modes"]["engine"]["steps"]
    assert {r["request"] for s in trace.steps for r in s["batch"]} == {"0", "1", "2"}
    assert trace.steps[-1]["seqs"] == [] and trace.steps[-1]["free"] == trace.header["num_blocks"]


@pytest.mark.parametrize("extra,message", [
    (["--trace-out", "{tmp}/missing/t.jsonl"], "trace: the folder .*missing does not exist"),
    (["--trace-out", "{tmp}"], "is a folder; give a file path"),
    (["--trace-out", "{tmp}/t.jsonl", "--online"], "--trace-out: records the engine's run of the offline benchmark; "
                                                   "--online runs other engines"),
])
def test_serve_bench_refuses_a_bad_trace_out_before_loading(tmp_path, capsys, extra, message):
    argv = ["serve-bench", "--model", str(tmp_path / "no-model.gguf"), *[a.format(tmp=tmp_path) for a in extra]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "no-model" not in err  # refused before the model is looked for


def test_serve_takes_trace_out(tiny, tmp_path, capsys):
    """``serve --trace-out`` builds its engine with the trace, and refuses a bad path before loading the model."""
    from minillm.cli import build_parser
    from minillm.server.cli import build_engine

    args = build_parser().parse_args(["serve", "--num-blocks", "16", "--trace-out", str(tmp_path / "s.jsonl")])
    engine = build_engine(tiny, None, args)
    engine.add_request("a", [1, 2, 3], greedy(2))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(read_trace(tmp_path / "s.jsonl").steps) == 2
    argv = ["serve", "--model", str(tmp_path / "no-model.gguf"), "--trace-out", str(tmp_path / "missing" / "s.jsonl")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "trace: the folder" in err and "no-model" not in err
