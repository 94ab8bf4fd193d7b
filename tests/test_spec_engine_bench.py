"""``serve-bench --spec`` (minillm.lab.serve_spec) on a tiny GGUF model: both engines emit the same greedy
tokens, the report and its JSON carry the columns the command promises, bad options are refused by name
before the model loads."""

import argparse
import json
import re

import pytest
from helpers import CHATML, TINY, write_tiny_gguf

from minillm import load_model
from minillm.lab.serve_bench_cli import register
from minillm.lab.serve_spec import format_spec_report, serve_spec, spec_lengths, spec_requests


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "tiny.gguf"
    write_tiny_gguf(path, chat_template=CHATML, cfg=dict(TINY, ctx=512))  # room for a passage in bytes
    return path


def command(args):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve-bench", *args])


def test_serve_spec_reports_each_concurrency(tiny_path):
    model, tok = load_model(tiny_path)
    report = serve_spec(model, tok, ks=[2, "auto"], trace="mixed", concurrency=[1, 2], max_tokens=6,
                        passage_tokens=16, progress=False)
    assert [r["concurrency"] for r in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert set(row["spec"]) == {"2", "auto"}
        for s in row["spec"].values():
            assert {"tok_s", "tpot_p50_ms", "tpot_p99_ms", "acceptance_length", "speedup"} <= set(s)
    text = format_spec_report(report)
    assert "accept len" in text and "fewer steps" in text and "step cost" in text
    made = {"spec": "ngram", "trace": "copy", "max_tokens": 4, "machine": "m", "rows": [{"concurrency": 1, "plain": {
        "tok_s": 10.0, "tpot_p50_ms": 1, "tpot_p99_ms": 1, "steps": 20}, "spec": {"4": {
            "tok_s": 16.0, "tpot_p50_ms": 1, "tpot_p99_ms": 1, "acceptance_length": 2.5, "steps": 10, "speedup": 1.6}}}]}
    assert "2.50 2.00x 1.25x" in re.sub(r" +", " ", format_spec_report(made))  # half the steps, each 1.25x the cost
    copy = spec_requests(tok, "copy", 2, 8, passage_tokens=16)
    assert len(copy) == 2 and all(n == 8 for _, n in copy)


def test_serve_spec_turns_report_medians(tiny_path, monkeypatch):
    """--spec-repeats 3: plain and every k run in turn three times; a row keeps the run of median tokens/s and the
    median of each turn's ratio (here the machine is faked: turn t's plain runs at 10 + t, k = 2 at 20 - 5t)."""
    from minillm.lab import serve_spec as lab

    model, tok = load_model(tiny_path)
    speeds = iter([10, 20, 11, 15, 12, 10])  # plain, k=2; turn by turn
    real = lab.run_at_concurrency
    monkeypatch.setattr(lab, "run_at_concurrency", lambda *a: {**real(*a), "tok_s": float(next(speeds))})
    report = lab.serve_spec(model, tok, ks=[2], trace="copy", concurrency=[1], max_tokens=4, passage_tokens=16,
                            repeats=3, progress=False)
    row = report["rows"][0]
    assert report["repeats"] == 3 and row["plain"]["tok_s_runs"] == [10, 11, 12] and row["plain"]["tok_s"] == 11
    assert row["spec"]["2"]["tok_s_runs"] == [20, 15, 10] and row["spec"]["2"]["tok_s"] == 15
    assert row["spec"]["2"]["speedup"] == pytest.approx(15 / 11)  # the ratios 2.0, 15/11, 10/12: their median
    assert "medians of 3 turns" in lab.format_spec_report(report)


def test_the_command_prints_json_and_refuses_by_name(tiny_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINILLM_FIGURES", str(tmp_path))
    args = command(["--model", str(tiny_path), "--spec", "ngram", "--trace", "copy", "--concurrency", "1",
                    "--num-speculative-tokens", "3", "--spec-max-tokens", "5", "--json", "--threads", "1"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"][0]["spec"]["3"]["speedup"] > 0 and (tmp_path / "serve_spec_ngram_copy.png").exists()
    with pytest.raises(ValueError, match="--draft-model"):
        args = command(["--model", "/nonexistent", "--spec", "draft"])
        args.func(args)
    with pytest.raises(ValueError, match="no such file or folder \\(--draft-model\\)"):  # before any model loads
        args = command(["--model", "/nonexistent", "--spec", "draft", "--draft-model", "/nope"])
        args.func(args)
    with pytest.raises(ValueError, match="--trace"):
        args = command(["--model", "/nonexistent", "--trace", "chat"])
        args.func(args)
    with pytest.raises(ValueError, match="--num-speculative-tokens"):
        spec_lengths("4,0")
