"""The pieces of ``bench stack`` (minillm.lab.stack) on a tiny random model: the workload, the weight
bytes, the roofline bound, the quality and agreement columns, the concurrency column, a whole run of
the stack (rows, gains, sweep; no timing asserted), the figure and the command's refusals."""

import pytest
import torch
from helpers import CHATML, TINY, write_tiny_gguf

from minillm import load_model
from minillm.cli import main
from minillm.generation import generate_cached
from minillm.lab import stack
from minillm.lab.stack_plots import plot_stack
from minillm.quant.pipeline import quantize_model
from minillm.quant.recipe import Recipe
from minillm.roofline.ceilings import Ceilings

CEILINGS = Ceilings("cpu", 1e10, 1e10, {"float32": 1e11})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("stack") / "tiny.gguf"
    write_tiny_gguf(path, cfg={**TINY, "ctx": 512}, chat_template=CHATML)
    model, tokenizer = load_model(path)
    quantized, _ = load_model(path)
    quantize_model(quantized, Recipe.of("rtn", bits=4, group_size=32, quant_head="int8"), progress=False)
    return model, quantized, tokenizer


MAKE_WORKLOAD = stack.make_workload


def workload(tokenizer, n=4, new_tokens=5, seed=0):
    return MAKE_WORKLOAD(tokenizer, n, new_tokens, seed=seed, passage_tokens=8, system="Be brief, and exact.")


def test_workload_alternates_copy_and_chat_behind_one_system_prompt(tiny):
    _, _, tokenizer = tiny
    reqs = workload(tokenizer, 6)
    assert [r.kind for r in reqs] == ["copy", "chat"] * 3 and all(r.max_tokens == 5 for r in reqs)
    system = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief, and exact."}],
                                           add_generation_prompt=False)
    assert all(r.prompt_token_ids[:len(system)] == system for r in reqs)
    assert workload(tokenizer, 6) == reqs and workload(tokenizer, 6, seed=1) != reqs  # seeded
    with pytest.raises(ValueError, match="num_requests"):
        stack.make_workload(tokenizer, 0)


def test_weight_bytes_count_what_a_forward_reads(tiny):
    model, quantized, _ = tiny
    c = model.config
    norms = (2 * c.n_layers + 1) * c.dim
    assert stack.weight_bytes(model) == 4 * (c.n_layers * c.layer_linear_params + c.vocab_size * c.dim + norms)
    assert stack.weight_bytes(quantized) < 0.4 * stack.weight_bytes(model)


def test_roofline_bound_grows_with_rows_and_recompute_is_below_decode(tiny):
    model, _, _ = tiny
    one, many = (stack.roofline_bound(model, b, 64, 1e10, 1e11) for b in (1, 16))
    assert one < many < 16 * one  # the weights are read once for all rows; each row reads its own KV
    assert stack.roofline_bound(model, 1, 64, 1e10, 1e11, recompute=True) < one
    assert one == pytest.approx(1e10 / (stack.weight_bytes(model) + 4 * 2 * 2 * 2 * 16 * 65), rel=1e-6)


def test_equal_share_counts_tokens_before_the_first_difference():
    assert stack.equal_share([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 0, 6]]) == pytest.approx(4 / 6)
    assert stack.equal_share([[1, 2]], [[1, 2]]) == 1.0


def test_largest_concurrency_keeps_the_pace():
    sweep = {"1": {"tpot_p99_s": 0.05}, "4": {"tpot_p99_s": 0.09}, "16": {"tpot_p99_s": 0.2}}
    assert stack.largest_concurrency(sweep) == 4
    assert stack.largest_concurrency({"1": {"tpot_p99_s": 0.5}}) == 0


def test_one_at_a_time_and_engine_runs_give_generate_cached_tokens(tiny):
    model, _, tokenizer = tiny
    reqs = workload(tokenizer)
    alone = [generate_cached(model, r.prompt_token_ids, stack._greedy(r.max_tokens)).tokens for r in reqs]
    naive = stack.run_one_at_a_time(model, reqs, stack.generate_naive)
    engine = stack.run_engine(model, reqs, max_num_seqs=4, enable_prefix_caching=True, block_size=4)
    assert naive["tokens"] == alone == engine["tokens"]
    assert naive["peak_kv_bytes"] == 0 and engine["peak_kv_bytes"] > 0 and engine["prefix_hit_rate"] > 0
    assert engine["rows_per_step_mean"] > 1 and naive["output_tokens"] == 20


def test_the_stack_on_a_tiny_model(tiny, tmp_path, monkeypatch):
    model, quantized, tokenizer = tiny
    monkeypatch.setattr(stack, "QUALITY", dict(seqlen=64, max_tokens=256))
    monkeypatch.setattr(stack, "make_workload", lambda tok, n, new, seed=0: workload(tok, n, new, seed))
    report = stack.bench_stack(model, quantized, tokenizer, CEILINGS, num_requests=4, new_tokens=5, naive_requests=2,
                               concurrency=(1, 2), sweep_tokens=3, quant_recipe="RTN g32", kernel_rows=(1, 4),
                               progress=False)
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["no KV cache", "KV cache", "paged engine", "int4 weights", "prefix caching",
                          "speculative decoding", "int4 draft, float target"]
    assert [r["label"] for r in report["rows"]] == ["1", "2", "3", "4", "5", "6", "6b"]
    for name in ("no KV cache", "KV cache", "paged engine", "int4 draft, float target"):  # exact, no quality cost
        assert rows[name]["greedy_equal_share"] == 1.0 and rows[name]["kl"] == 0.0 and rows[name]["weights"] == "float32"
    assert rows["int4 weights"]["kl"] > 0 and 0 < rows["int4 weights"]["top1_agreement"] <= 1
    assert rows["prefix caching"]["prefix_hit_rate"] > 0 and rows["int4 weights"]["prefix_hit_rate"] == 0
    assert rows["int4 weights"]["weight_bytes"] < rows["paged engine"]["weight_bytes"]
    assert rows["KV cache"]["over_row2"] == 1.0 and rows["no KV cache"]["gain_in_stack"] is None
    assert rows["speculative decoding"]["greedy_equal_share"] == rows["prefix caching"]["greedy_equal_share"]
    assert 0 <= rows["speculative decoding"]["acceptance_rate"] <= 1
    assert report["full_stack_over_row2"] == rows["speculative decoding"]["over_row2"]
    assert set(report["gains"]) == {"KV cache", "paged engine", "int4 weights", "prefix caching", "speculative decoding"}
    assert set(report["sweep"]) == {"paged engine", "int4 weights", "prefix caching", "speculative decoding"}
    assert set(report["int4_over_float_engine"]) == {"1", "2"} and set(report["linear_seconds"]) == {"float32", "int4"}
    assert all(r["bound_tokens_per_s"] > 0 for r in report["rows"])
    assert "prefix caching" in stack.format_report(report)
    plot_stack(report, tmp_path / "stack.png")
    assert (tmp_path / "stack.png").stat().st_size > 0


@pytest.mark.parametrize("args,message", [
    (["--requests", "2", "--naive-requests", "3"], "--naive-requests: 3 is more than --requests 2"),
    (["--quant-file", "model.gguf"], "--quant-file: 'model.gguf' is not a .safetensors file"),
    (["--dtype", "bfloat16"], "--dtype: the stack starts from float32"),
])
def test_bad_options_are_refused_before_loading(args, message, capsys):
    assert main(["bench", "stack", *args]) == 2
    assert message in capsys.readouterr().err


def test_recurrent_state_sizes_follow_the_papers_formulas():
    from minillm.lab.stack_plots import STATE_MODELS, crossover_tokens, state_elements

    assert state_elements("mamba1", 768, 24) == 24 * (1536 * 16 + 1536 * 3)  # SSM state + convolution's last 3 inputs
    assert state_elements("mamba2", 768, 24, d_state=128) == 24 * (1536 * 128 + (1536 + 256) * 3)
    assert state_elements("rwkv4", 768, 12) == 12 * 5 * 768
    assert state_elements("rwkv6", 768, 12) == 12 * (768 * 64 + 2 * 768)
    assert set(STATE_MODELS) >= {"Mamba-1 130M", "Mamba-2 130M"}
    assert crossover_tokens(46080 * 100, 46080) == 100
    with pytest.raises(ValueError, match="kind"):
        state_elements("lstm", 8, 1)


def test_stack_tables_state_each_row_and_its_gain(tmp_path):
    from test_tables import _stack_report

    from tools.tables import record
    from tools.tables import stack as stack_tables

    record(_stack_report(), tmp_path / "stack.json", "python -m minillm bench stack")
    short = stack_tables.stack_short(tmp_path)
    assert "| 3. + paged engine | 50.0 | 5.00x | 25.0x | 100% |" in short and "`python -m minillm bench stack`" in short
    full = stack_tables.stack_full(tmp_path)
    assert "| int4 weights | 1.50x | 1.10x |" in full and "1.50x at 1, 1.20x at 4" in full
    assert "| paged engine | 10 (0.100) | 30 (0.200) |" in full


def test_the_command_prints_strict_json_on_a_tiny_model(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from helpers import tiny_llama_weights

    cfg = {**TINY, "ctx": 1024}
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_llama_weights(cfg=cfg), cfg=cfg, chat_template=CHATML)
    p = subprocess.run([sys.executable, "-m", "minillm", "bench", "stack", "--model", str(path), "--requests", "2",
                        "--new-tokens", "3", "--naive-requests", "1", "--concurrency", "1,2", "--json"],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert [r["label"] for r in report["rows"]] == ["1", "2", "3", "4", "5", "6", "6b"]
    assert report["quant_recipe"] == "RTN g32" and set(report["sweep"]["paged engine"]) == {"1", "2"}
