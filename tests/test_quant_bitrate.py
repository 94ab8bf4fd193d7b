"""Variable bitrate (minillm/quant/bitrate.py): the measurement pass, the optimizer against exhaustive
search, the per-layer quantization and its checkpoint, on tiny random models."""

import copy
import itertools
import json

import pytest
import torch

from minillm.quant import QuantConfig, Recipe, load_quantized, quantize_model, save_quantized
from minillm.quant.bitrate import (format_choice, format_measurement, layer_errors, measure, merge_tables, model_bpw,
                                   optimize, optimize_naive, option_bits, quantize_variable)
from minillm.quant.pipeline import LAYERS, linear_of

from helpers import random_decoder

OPTIONS = [(2, 32), (3, 32), (4, 32)]


@pytest.fixture(scope="module")
def tiny():
    return random_decoder(300)


@pytest.fixture(scope="module")
def calib():
    return torch.randint(0, 300, (4, 64), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def table(tiny, calib):
    return measure(tiny, calib, OPTIONS, error_windows=2, progress=False)


def random_table(seed, n_layers=5, n_options=4):
    """A problem with whole-bit costs, as the DP's units are then exact."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for j in range(n_layers):
        bits = sorted(torch.randint(5, 60, (n_options,), generator=g).tolist())
        errors = sorted(torch.rand(n_options, generator=g).tolist(), reverse=True)
        norm = float(torch.rand((), generator=g)) + 0.5
        layers.append({"name": f"layers.{j}.attn.wqkv", "out_features": 1, "in_features": 10, "bits": bits,
                       "errors": errors, "out_norm": 2 * norm, "update_norm": norm})
    return {"options": [[b, 32] for b in range(2, 2 + n_options)], "layers": layers, "setup": {}}


def test_option_bits_count_codes_scales_and_zeros():
    # 4-bit group 64 on 576 inputs: 9 groups of a 16-bit scale and a 4-bit zero per row
    assert option_bits(10, 576, 4, 64) == 10 * (576 * 4 + 9 * 20)
    assert option_bits(10, 576, 4, 64) / (10 * 576) == pytest.approx(QuantConfig(4, 64).bits_per_weight(576))


@pytest.mark.parametrize("seed", range(6))
def test_optimize_agrees_with_exhaustive_search(seed):
    t = random_table(seed)
    weights = 5 * 10
    cheapest = sum(min(r["bits"]) for r in t["layers"]) / weights
    dearest = sum(max(r["bits"]) for r in t["layers"]) / weights
    for bpw in torch.linspace(cheapest, dearest, 7, dtype=torch.float64).tolist():
        for relative_to in ("update", "output"):
            fast, naive = optimize(t, bpw, relative_to=relative_to), optimize_naive(t, bpw, relative_to=relative_to)
            assert fast["objective"] == pytest.approx(naive["objective"], rel=1e-12)
            assert fast["total_bits"] <= bpw * weights + 1e-9


def test_optimize_fits_the_budget_and_spends_more_where_it_can(table):
    prev = float("inf")
    for bpw in (2.8, 3.2, 3.6, 4.0, 4.6):
        r = optimize(table, bpw, resolution=500)  # coarse units: the answer must still fit
        assert r["bpw"] <= bpw + 1e-9
        assert r["objective"] <= prev + 1e-15  # a larger budget never does worse
        prev = r["objective"]
    top = optimize(table, 10.0)
    assert all(v == [4, 32] for v in top["choice"].values())  # everything affordable: the best option everywhere


def test_errors_relative_to_the_block_update(table):
    r = table["layers"][0]
    assert r["update_norm"] < r["out_norm"]  # the residual carries the input: ||Y - X|| < ||Y|| here
    assert layer_errors(r, "update") == pytest.approx([e * r["out_norm"] / r["update_norm"] for e in r["errors"]])
    assert layer_errors(r, "output") == r["errors"]
    with pytest.raises(ValueError, match="relative_to"):
        layer_errors(r, "input")


def test_a_budget_below_the_cheapest_options_is_refused(table):
    with pytest.raises(ValueError, match="bpw: 2.0 is below"):
        optimize(table, 2.0)


def test_measure_errors_fall_with_bits_and_leave_the_model_unchanged(tiny, calib, table):
    before = copy.deepcopy(tiny.state_dict())
    assert [r["name"] for r in table["layers"]] == [f"layers.{i}.{n}" for i in range(2) for n in LAYERS]
    for r in table["layers"]:
        assert r["errors"][0] > r["errors"][1] > r["errors"][2] > 0  # 2 > 3 > 4 bits
    again = measure(tiny, calib, OPTIONS, error_windows=2, progress=False)
    assert again["layers"] == table["layers"]  # deterministic, and measuring changed nothing
    after = tiny.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "layers.0.attn.wqkv" in format_measurement(table)


def test_measure_split_by_blocks_merges_to_the_whole(tiny, calib, table):
    parts = [measure(tiny, calib, OPTIONS, error_windows=2, blocks=[b], progress=False) for b in (1, 0)]
    merged = merge_tables(parts)
    assert merged["layers"] == table["layers"]
    with pytest.raises(ValueError, match="measured twice"):
        merge_tables([parts[0], parts[0]])


def test_measure_refuses_bad_arguments(tiny, calib):
    with pytest.raises(ValueError, match="error_windows"):
        measure(tiny, calib, OPTIONS, error_windows=9, progress=False)
    with pytest.raises(ValueError, match="bits"):
        measure(tiny, calib, [(9, 32)], progress=False)
    with pytest.raises(ValueError, match="blocks"):
        measure(tiny, calib, OPTIONS, blocks=[5], progress=False)


@pytest.mark.parametrize("options", [{}, {"v2": True, "v2_percdamp": 0.1}, {"v2": False, "true_sequential": False}])
def test_a_uniform_choice_is_the_pipelines_gptq(tiny, calib, options):
    """The same recipe (default: BEST; v2 and true_sequential as it says) gives the pipeline's layers."""
    names = [f"layers.{i}.{n}" for i in range(2) for n in LAYERS]
    a, b = copy.deepcopy(tiny), copy.deepcopy(tiny)
    recipe = Recipe.of("gptq", bits=3, group_size=32, **options)
    rep = (quantize_variable(a, {n: [3, 32] for n in names}, calib, recipe, progress=False) if options else
           quantize_variable(a, {n: [3, 32] for n in names}, calib, progress=False))
    quantize_model(b, recipe, calib, progress=False)
    assert all(rep[k] == v for k, v in options.items())
    for i in range(2):
        for n in LAYERS:
            assert torch.equal(linear_of(a.layers[i], n)[0].dequantize(), linear_of(b.layers[i], n)[0].dequantize())


def test_variable_model_has_the_chosen_bits_and_loads_back(tiny, calib, table, tmp_path):
    choice = optimize(table, 3.4)
    assert len({tuple(v) for v in choice["choice"].values()}) > 1  # a real mix
    q = copy.deepcopy(tiny)
    report = quantize_variable(q, choice["choice"], calib, progress=False)
    for name, (bits, group) in choice["choice"].items():
        i, rest = int(name.split(".")[1]), name.split(".", 2)[2]
        lin = linear_of(q.layers[i], rest)[0]
        assert (lin.config.bits, lin.config.group_size) == (bits, group)
    assert model_bpw(q) == pytest.approx(choice["bpw"])
    assert "achieved" in format_choice(choice)
    path = save_quantized(q, tmp_path / "v.safetensors", report)
    loaded, meta = load_quantized(path, fast=False)
    assert meta["quant_config"]["layer_configs"] == report["layer_configs"]
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16)
    q.eval()
    for m in q.modules():
        if hasattr(m, "want_fast"):
            m.want_fast = False
            m._kernel = None
    torch.testing.assert_close(loaded(tokens, pos), q(tokens, pos))


def test_quantize_variable_refuses_a_partial_choice(tiny, calib):
    with pytest.raises(ValueError, match="choice: must name every linear layer"):
        quantize_variable(copy.deepcopy(tiny), {"layers.0.attn.wqkv": [4, 32]}, calib, progress=False)


def test_exhaustive_search_refuses_a_large_problem():
    t = random_table(0, n_layers=12, n_options=4)
    with pytest.raises(ValueError, match="too many"):
        optimize_naive(t, 100.0)
    assert list(itertools.islice(optimize(t, 100.0)["choice"].values(), 1))  # the DP still answers


# ---- the commands, on a tiny GGUF model ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from helpers import TINY, tiny_llama_weights, write_tiny_gguf

    cfg = {**TINY, "ctx": 1024}  # bench quant's windows are 512 tokens
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path, tiny_llama_weights(cfg=cfg), cfg=cfg)
    return path


def run(*args, cwd=None):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINILLM_FIGURES": str(cwd or ".")}
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=900,
                          env=env, cwd=cwd)


def strict(text):
    def refuse(c):
        raise ValueError(f"{c} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.slow  # two command runs in subprocesses
def test_quantize_bpw_writes_a_mixed_model_that_loads(tiny_gguf, tmp_path):
    out, m = tmp_path / "v.safetensors", tmp_path / "m.json"
    p = run("quantize", "--quant", "gptq", "--bpw", "3.4", "--calib-samples", "4", "--calib-seqlen", "64",
            "--measurement", str(m), "--model", str(tiny_gguf), "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr
    rep = strict(p.stdout)
    assert rep["bpw"] <= 3.4 and len(set(map(tuple, rep["layer_configs"].values()))) > 1
    assert m.exists() and set(rep["measured_errors"]) == set(rep["layer_configs"])
    _, meta = load_quantized(out, fast=False)
    assert meta["quant_config"]["layer_configs"] == rep["layer_configs"]
    # the saved measurement is read back (no second measurement), and the text output names the choice
    p2 = run("quantize", "--quant", "gptq", "--bpw", "3.4", "--calib-samples", "4", "--calib-seqlen", "64",
             "--measurement", str(m), "--model", str(tiny_gguf), "--out", str(tmp_path / "w.safetensors"))
    assert p2.returncode == 0, p2.stderr
    assert "achieved" in p2.stdout and "layers.1.mlp.w_down" in p2.stdout
    bad = run("quantize", "--quant", "awq", "--bpw", "3.4", "--model", str(tiny_gguf), "--out", str(tmp_path / "r.safetensors"))
    assert bad.returncode != 0 and "--quant gptq or --quant rtn" in bad.stderr
    # the default measurement is the end-to-end one (KL, RTN one layer at a time): any quantizer may read it
    assert json.loads(m.read_text())["setup"]["end_to_end"] is True
    # the GPTQ and head flags reach the variable model and its file records them
    flags = run("quantize", "--quant", "gptq", "--bpw", "3.4", "--no-v2", "--percdamp", "0.05", "--quant-head", "int8",
                "--calib-samples", "4", "--calib-seqlen", "64", "--measurement", str(m), "--model", str(tiny_gguf),
                "--out", str(tmp_path / "f.safetensors"))
    assert flags.returncode == 0, flags.stderr
    _, meta = load_quantized(tmp_path / "f.safetensors", fast=False)
    q = meta["quant_config"]
    assert (q["v2"], q["v2_percdamp"], q["percdamp"], meta["quant_head"]) == (False, None, 0.05, "int8")
    assert q["calib_samples"] == 4 and q["true_sequential"] is True
    mismatch = run("quantize", "--quant", "gptq", "--bpw", "3.4", "--measure", "block", "--measurement", str(m),
                   "--model", str(tiny_gguf), "--out", str(tmp_path / "g.safetensors"))
    assert mismatch.returncode != 0 and "holds a kl measurement" in mismatch.stderr
    rtn = run("quantize", "--quant", "rtn", "--bpw", "3.4", "--measurement", str(m), "--model", str(tiny_gguf),
              "--out", str(tmp_path / "r.safetensors"))
    assert rtn.returncode == 0, rtn.stderr
    # a block measurement holds GPTQ's errors: the RTN variant refuses it rather than mixing the two
    mb = tmp_path / "mb.json"
    block = run("quantize", "--quant", "gptq", "--bpw", "3.4", "--measure", "block", "--calib-samples", "4",
                "--calib-seqlen", "64", "--measurement", str(mb), "--model", str(tiny_gguf), "--out", str(tmp_path / "b.safetensors"))
    assert block.returncode == 0, block.stderr
    assert "end_to_end" not in json.loads(mb.read_text())["setup"]
    other = run("quantize", "--quant", "rtn", "--bpw", "3.4", "--measurement", str(mb), "--model", str(tiny_gguf),
                "--out", str(tmp_path / "r2.safetensors"))
    assert other.returncode != 0 and "measured with gptq" in other.stderr


@pytest.mark.slow
def test_bench_quant_bpw_json_and_figures(tiny_gguf, tmp_path):
    p = run("bench", "quant", "--bpw", "3,4", "--uniform", "rtn", "--calib-samples", "4", "--max-tokens", "1100",
            "--model", str(tiny_gguf), "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    res = strict(p.stdout)
    assert [v["target_bpw"] for v in res["variable"]] == [3.0, 4.0]
    assert all(v["bpw"] <= v["target_bpw"] for v in res["variable"])
    assert {(r["bits"], r["group_size"]) for r in res["uniform"]} == {tuple(o) for o in res["measurement"]["options"]}
    assert set(res["goals"]) >= {"met", "never_worse", "strictly_better", "budgets"}
    for name in ("05b_bitrate.json", "05b_bitrate_ppl.png", "05b_bitrate_bits.png"):
        assert (tmp_path / name).stat().st_size > 0
    bad = run("bench", "quant", "--bpw", "3,x", "--model", str(tiny_gguf), cwd=tmp_path)
    assert bad.returncode != 0 and "bpw" in bad.stderr


def test_the_rtn_variant_measures_and_quantizes_with_round_to_nearest(tiny, calib):
    t = measure(tiny, calib, OPTIONS, error_windows=2, method="rtn", progress=False)
    assert t["setup"]["method"] == "rtn" and all(r["errors"][0] > r["errors"][2] for r in t["layers"])
    names = [f"layers.{i}.{n}" for i in range(2) for n in LAYERS]
    a, b = copy.deepcopy(tiny), copy.deepcopy(tiny)
    quantize_variable(a, {n: [4, 32] for n in names}, None, Recipe("rtn"), progress=False)
    quantize_model(b, Recipe.of("rtn", bits=4, group_size=32), None, progress=False)
    for i in range(2):
        for n in LAYERS:
            assert torch.equal(linear_of(a.layers[i], n)[0].dequantize(), linear_of(b.layers[i], n)[0].dequantize())
    with pytest.raises(ValueError, match="method"):
        measure(tiny, calib, OPTIONS, method="awq", progress=False)


def test_the_measurement_pass_of_a_bpw_command(tiny, calib):
    """--measure kl is sensitivity.measure_logits on the first 2 windows; block is measure's; others are refused."""
    from minillm.quant.bitrate_cli import measure_pass
    from minillm.quant.sensitivity import measure_logits

    kl = measure_pass(tiny, calib, "gptq", "kl", OPTIONS, progress=False)
    assert kl["setup"]["end_to_end"] and kl["layers"] == measure_logits(tiny, calib[:2], OPTIONS, progress=False)["layers"]
    block = measure_pass(tiny, calib, "rtn", "block", OPTIONS, progress=False)
    assert block["setup"]["method"] == "rtn" and not block["setup"].get("end_to_end")
    with pytest.raises(ValueError, match="measure"):
        measure_pass(tiny, calib, "rtn", "hessian", OPTIONS)
