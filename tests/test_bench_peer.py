"""bench decode --peer llamacpp: the byte counts it prints and its refusals (always run), and the whole
command beside llama.cpp (only where the optional llama-cpp-python is installed; never required)."""

import json

import pytest
import torch
from helpers import TINY, tiny_llama_weights, write_tiny_gguf

import minillm.cli
from minillm import load_model
from minillm.lab.decode import decode_bytes_per_token, weight_bytes_per_token
from minillm.lab.llamacpp import gguf_bytes_per_token
from minillm.lab.peers import llamacpp_available
from minillm.cli import main
from minillm.formats.gguf import read_gguf
from minillm.quant import QuantLinear, Recipe, quantize_model
from minillm.quant.head import quantize_output

CFG = {**TINY, "vocab": 320}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path, tiny_llama_weights(cfg=CFG), cfg=CFG)
    return path


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_bytes_per_token_count_what_each_step_reads(tiny_path):
    model, _ = load_model(tiny_path)
    C, V, L = CFG["dim"], CFG["vocab"], CFG["n_layers"]
    float_bytes = 4 * (L * model.config.layer_linear_params + V * C + (2 * L + 1) * C)  # tied head once, norms
    assert decode_bytes_per_token(model) == weight_bytes_per_token(model) == float_bytes
    quantize_model(model, Recipe.of("rtn", bits=4, group_size=32), progress=False)
    quantize_output(model, "int4")
    kernels = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(kernels) == 4 * L + 1 and all(m.fast for m in kernels)
    # int4 codes (half a byte per weight) + per 32 weights a (scale, zero) pair: float32 in minillm's kernel,
    # bfloat16 in torch's; + float norms
    weights = L * model.config.layer_linear_params + V * C
    pair = 8 if kernels[0].kernel == "minillm-int4" else 4
    assert {m.kernel for m in kernels} == {kernels[0].kernel}
    assert decode_bytes_per_token(model) == weights // 2 + weights // 32 * pair + 4 * (2 * L + 1) * C
    # llama.cpp reads every tensor of the GGUF as stored, the tied embedding once (all float32 here)
    reader = read_gguf(tiny_path)
    assert gguf_bytes_per_token(tiny_path) == sum(int(t.n_bytes) for t in reader.tensors) == float_bytes


def test_peer_llamacpp_is_refused_with_the_install_line_when_absent(tiny_path, monkeypatch, capsys):
    monkeypatch.setattr(minillm.cli, "llamacpp_available", lambda: False)
    assert main(["bench", "decode", "--peer", "llamacpp", "--model", str(tiny_path)]) == 2
    assert "pip install llama-cpp-python==0.3.36" in capsys.readouterr().err
    monkeypatch.setattr(minillm.cli, "llamacpp_available", lambda: True)
    assert main(["bench", "decode", "--peer", "llamacpp", "--no-peer", "--model", str(tiny_path)]) == 2
    assert "contradict" in capsys.readouterr().err


@pytest.mark.skipif(not llamacpp_available(), reason="the optional peer llama-cpp-python is not installed")
def test_bench_decode_beside_llamacpp_on_the_embedded_model(model_path, capsys):
    torch.set_num_threads(torch.get_num_threads())
    assert main(["bench", "decode", "--peer", "llamacpp", "--new-tokens", "6", "--repeats", "2", "--no-compile", "--quant-head", "int4",
                 "--json"]) == 0
    report = strict_json(capsys.readouterr().out)
    rows = report["results"]
    peer = rows["llama.cpp (same GGUF)"]
    assert peer["bytes_per_token"] == gguf_bytes_per_token(model_path)
    float_row, head_row = rows["ours float32 (cached, eager)"], rows["ours int4 (RTN g64), int4 head"]
    body_row = rows["ours int4 (RTN g64), float head"]
    # float32 weights > 4-bit blocks with the float head > llama.cpp's Q4_1 with its Q8_0 head > ours all 4-bit
    sizes = [r["bytes_per_token"] for r in (float_row, body_row, peer, head_row)]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4
    for r in rows.values():
        assert len(r["runs"]) == 2 and r["decode_tokens_per_s"] > 0
        assert r["share_of_bound"] == pytest.approx(r["bytes_per_token"] * r["decode_tokens_per_s"]
                                                    / report["bandwidth"]["ceiling"])
    assert float_row["tokens_equal_to_float"] == 6
    assert peer["tokens_equal_to_float"] >= 1  # Q4_1 vs its float dequantization: the first greedy token agrees
    best = rows[report["best_ours"]]
    assert report["best_over_llamacpp_per_repeat"] == pytest.approx(
        [a / b for a, b in zip(best["runs"], peer["runs"])])
