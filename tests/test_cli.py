"""The command line, run as users and scripts run it."""

import json
import os
import subprocess
import sys
import time

import pytest

from minillm import SamplingParams, generate_cached


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_generate_json_matches_the_library(model, tokenizer):
    p = run("generate", "--prompt", "The sea", "--max-new-tokens", "12", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {"prompt_tokens", "tokens", "text", "prefill_s", "decode_s", "decode_tokens_per_s"} <= out.keys()
    assert out["prompt_tokens"] == tokenizer.encode("The sea")
    ref = generate_cached(model, out["prompt_tokens"], SamplingParams(max_new_tokens=12), tokenizer=tokenizer)
    assert out["tokens"] == ref.tokens and out["text"] == ref.text
    assert out["decode_tokens_per_s"] > 0


def test_generate_streams_chat_answer():
    p = run("generate", "--prompt", "What is the capital of France?", "--chat", "--cache", "none")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "The capital of France is Paris."
    assert "finish: eos" in p.stderr


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "error: temperature: must be >= 0"),
    (["--top-p", "2"], "error: top_p: must be in (0, 1]"),
    (["--top-k", "-3"], "error: top_k: must be >= 0"),
    (["--model", "/nonexistent.gguf"], "error: /nonexistent.gguf: no such file"),
])
def test_bad_input_exits_2_with_a_message(args, message):
    p = run("generate", "--prompt", "x", *args)
    assert p.returncode == 2 and message in p.stderr


@pytest.mark.parametrize("args,message", [
    (["roofline", "--batch-sizes", "0"], "argument --batch-sizes: each value must be >= 1, got '0'"),
    (["roofline", "--batch-sizes", "1,x"], "argument --batch-sizes: expected comma-separated integers, got '1,x'"),
    (["roofline", "--batch-sizes", ""], "argument --batch-sizes: give at least one value"),
    (["roofline", "--prompt-lengths", "-5"], "argument --prompt-lengths: each value must be >= 1"),
    (["bench", "spec", "--gammas", "abc"], "argument --gammas: expected comma-separated integers"),
    (["generate", "--prompt", "x", "--draft", "README.md"], "error: draft: 'README.md' is neither 'ngram' nor a model"),
])
def test_bad_options_exit_2_naming_the_option(args, message):
    """Rejected before any measurement runs, with the option's name."""
    p = run(*args)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_prompt_longer_than_context():
    p = run("generate", "--prompt", "word " * 300, "--max-seq-len", "64")
    assert p.returncode == 2 and "error: prompt: " in p.stderr and "do not fit the context of 64 tokens" in p.stderr


def test_bench_decode_and_tour(tmp_path):
    p = run("bench", "decode", "--no-peer", "--new-tokens", "6", "--repeats", "1", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["dtype"] == "float32" and report["batch_size"] == 1 and report["new_tokens"] == 6
    assert report["results"]["ours naive (no cache)"]["same_tokens_as_cached"]
    p = run("tour", "--new-tokens", "6", "--json", env={"MINILLM_FIGURES": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    tour = json.loads(p.stdout)
    assert tour["rows"][0]["check"] == "greedy tokens identical"
    spec = next(r for r in tour["rows"] if r["technique"] == "speculative (n-gram)")
    assert spec["check"].startswith("greedy tokens identical, alpha ")
    kernels = next(r for r in tour["rows"] if r["technique"] == "minillm's CPU kernels (minillm.fast)")
    assert kernels["baseline"] == "plain torch, cached decode" and kernels["check"] == "greedy tokens identical"
    quant = tour["rows"][-1]
    assert quant["technique"] == "int4 weights (RTN g64)" and quant["tokens_per_s"] > 0
    assert quant["check"].endswith("greedy tokens equal float's")
    assert (tmp_path / "tour_decode_step_time.png").stat().st_size > 1000


def test_generate_with_ngram_draft_gives_the_same_greedy_tokens():
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog"
    plain = json.loads(run("generate", "--chat", "--prompt", prompt, "--max-new-tokens", "24", "--json").stdout)
    p = run("generate", "--chat", "--prompt", prompt, "--max-new-tokens", "24", "--json", "--draft", "ngram",
            "--num-speculative-tokens", "4")
    assert p.returncode == 0, p.stderr
    spec = json.loads(p.stdout)
    assert spec["tokens"] == plain["tokens"] and 0 <= spec["acceptance_rate"] <= spec["alpha"] <= 1
    # the answer repeats the prompt: fewer target passes than tokens, and passes x tokens per pass = the tokens
    assert spec["target_passes"] < len(spec["tokens"])
    assert spec["target_passes"] * spec["tokens_per_target_pass"] == pytest.approx(len(spec["tokens"]))


def test_generate_with_ngram_draft_streams_the_same_text():
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog"
    plain = run("generate", "--prompt", prompt, "--max-new-tokens", "24")
    spec = run("generate", "--prompt", prompt, "--max-new-tokens", "24", "--draft", "ngram")
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and len(spec.stdout.strip()) > 20
    assert "[speculative, draft ngram, gamma 4: " in spec.stderr and "tokens per pass, alpha" in spec.stderr
    assert "[speculative" not in plain.stderr


def test_bench_spec_reports_every_workload_and_the_gamma_sweep():
    from minillm.lab.spec import INPUT_GROUNDED, SPEC_WORKLOADS

    p = run("bench", "spec", "--new-tokens", "6", "--gammas", "1,3", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert len(report["rows"]) == len(SPEC_WORKLOADS) == 7 and report["num_speculative_tokens"] == 4
    assert set(report["verify_s"]) == {"1", "2", "3", "4", "5"} and report["draft_cost_ratio"] == 0
    for r in report["rows"]:
        assert r["same_tokens"] and 0 <= r["alpha"] <= 1 and r["tokens_per_target_pass"] >= 1
        # verifying k tokens costs about one decode step with packed weights: timing noise can put it just below
        assert r["cost_per_pass"] > 0.5 and r["predicted_speedup"] == r["tokens_per_pass"] / r["cost_per_pass"]
    sweep = report["sweep"]
    assert [(r["workload"], r["gamma"]) for r in sweep["rows"]] == [(w, g) for w in INPUT_GROUNDED for g in (1, 3)]
    assert all(r["same_tokens"] for r in sweep["rows"]) and set(sweep["best"]) == set(INPUT_GROUNDED)
    assert run("bench", "spec", "--gammas", "0,2").returncode == 2


def test_a_busy_machine_is_reported_before_measuring(tmp_path):
    """busy_cores reads /proc/stat: a process spinning on one core shows as about one busy core, and the
    measuring commands warn about it on stderr."""
    from minillm.timing import busy_cores

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        assert busy_cores(0.5) >= 0.7
        p = run("roofline", "--model", "/nonexistent.gguf")  # warns, then refuses the file
        assert "warning: other processes keep" in p.stderr and "compare ratios measured in one run" in p.stderr
    finally:
        spin.kill()
    fake = tmp_path / "stat"
    fake.write_text("cpu  100 0 100 800 0 0 0 0 0 0\n")  # user nice system idle iowait ...
    assert busy_cores(0.0, str(fake)) == 0.0  # no jiffies passed between the two reads
    assert busy_cores(0.0, str(tmp_path / "missing")) is None
