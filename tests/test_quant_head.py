"""The quantized output layer (minillm.quant.head), the rows a tied embedding reads from it, the int8
kernel path of QuantLinear, and checkpoints that carry a quantized head."""

import copy

import pytest
import torch
from helpers import TINY, rel_err, tiny_llama_weights, write_tiny_gguf

from minillm.fast import accelerate
from minillm import SamplingParams, generate_cached, load_model
from minillm.quant import QuantConfig, QuantLinear, Recipe, gptq_quantize, quantize_model, rtn_quantize
from minillm.quant.checkpoint import load_quantized, save_quantized
from minillm.quant.head import HEAD_KINDS, head_config, quantize_output
from minillm.quant.qlinear import quant_linear_naive

CFG = {**TINY, "vocab": 320}  # a multiple of 16: the int4 kernel packs output rows in blocks of 16


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path, tiny_llama_weights(cfg=CFG), cfg=CFG)
    return path


@pytest.mark.parametrize("bits,group_size,act_order", [(4, 32, False), (4, 64, True), (3, 32, False), (8, -1, False),
                                                        (2, -1, False), (8, 32, True)])
def test_rows_dequantize_only_the_rows_asked_for_bit_exactly(bits, group_size, act_order):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(40, 96, generator=g)  # 40 rows: the packed zeros' last word is partly filled
    x = torch.randn(256, 96, generator=g) * torch.linspace(0.1, 3, 96)
    qw = gptq_quantize(w, 2 * x.t() @ x, QuantConfig(bits, group_size), act_order=act_order)
    layer = QuantLinear(qw)
    index = torch.tensor([[0, 39, 7], [7, 8, 31]])
    rows = layer.rows(index)
    assert rows.shape == (2, 3, 96)
    assert torch.equal(rows, qw.dequantize()[index])


@pytest.mark.parametrize("sym", [True, False])
def test_int8_per_channel_takes_the_int8_kernel_and_agrees_with_the_reference(sym):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(48, 64, generator=g), torch.randn(5, 64, generator=g)
    layer = QuantLinear(rtn_quantize(w, QuantConfig(8, -1, sym=sym)), bias=torch.randn(48, generator=g))
    assert layer.fast and isinstance(layer._kernel[0], str)
    y_ref = quant_linear_naive(x, layer)
    assert rel_err(y_ref, x @ layer.dequantize().t() + layer.bias) < 1e-6
    assert rel_err(layer(x), y_ref) < 2e-2  # bfloat16 activations and scales in the kernel
    # with the zero point's correction left out, an asymmetric layer would be far off
    if not sym:
        _, w8, s, offset = layer._kernel
        assert offset is not None and rel_err(torch.ops.aten._weight_int8pack_mm(
            x.bfloat16(), w8, s).float() + layer.bias, y_ref) > 0.05
    # one byte per weight; per row a bfloat16 scale, the bias and (asymmetric) a float32 offset
    assert layer.kernel_nbytes() == 48 * 64 + 48 * (2 + 4 + (0 if sym else 4))


def test_int4_layer_with_rows_not_a_multiple_of_16_falls_back_on_the_cpu():
    layer = QuantLinear(rtn_quantize(torch.randn(20, 64), QuantConfig(4, 32)))
    assert not layer.fast
    x = torch.randn(2, 64)
    assert torch.equal(layer(x), quant_linear_naive(x, layer))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_head_serves_the_tied_embedding_and_stays_close_to_float(tiny_path, kind):
    model, _ = load_model(tiny_path)
    q = copy.deepcopy(model)
    report = quantize_output(q, kind)
    assert isinstance(q.output, QuantLinear) and q.output.fast
    assert report["quant_head"] == kind and report["bytes"] < report["float_bytes"] / (3.5 if kind == "int8" else 5)
    assert q.device == model.device and q.dtype == torch.float32
    tokens = torch.tensor([[5, 9, 200, 31, 7, 319]])
    # the embedding is the quantized head's rows, dequantized on lookup
    assert torch.equal(q.embed(tokens), q.output.dequantize()[tokens])
    assert not torch.equal(q.embed(tokens), model.embed(tokens))
    pos = torch.arange(tokens.shape[1])
    with torch.inference_mode():
        err = rel_err(q(tokens, pos), model(tokens, pos))
    assert 0 < err < (0.02 if kind == "int8" else 0.2)  # 8 bits per channel vs 4 bits in groups of 32
    # decoding runs and the refusals name the problem
    assert len(generate_cached(q, [5, 9], SamplingParams(max_new_tokens=5)).tokens) == 5
    with pytest.raises(ValueError, match="quantized already"):
        quantize_output(q, kind)


def test_head_kinds_are_checked():
    assert head_config("none") is None and set(HEAD_KINDS) == {"none", "int8", "int4"}
    with pytest.raises(ValueError, match="quant_head"):
        head_config("int3")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_checkpoint_round_trips_a_quantized_head(tiny_path, tmp_path, kind):
    model, _ = load_model(tiny_path)
    report = quantize_model(model, Recipe.of("rtn", bits=4, group_size=32), progress=False)
    quantize_output(model, kind)
    path = save_quantized(model, tmp_path / "q.safetensors", report)
    loaded, meta = load_quantized(path)
    accelerate(loaded)  # the same kernels as the accelerated model it was written from
    assert meta["quant_head"] == kind and isinstance(loaded.output, QuantLinear)
    assert loaded.output.config == model.output.config
    tokens, pos = torch.tensor([[1, 2, 300, 4]]), torch.arange(4)
    with torch.inference_mode():
        assert torch.equal(loaded(tokens, pos), model(tokens, pos))
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        assert not any(k.startswith("tok_embeddings") for k in f.keys())  # the head's rows are the embedding


def test_quantize_and_perplexity_commands_take_quant_head(tiny_path, tmp_path, capsys):
    import json

    from minillm.cli import main

    out = tmp_path / "q.safetensors"
    assert main(["quantize", "--quant", "rtn", "--group-size", "32", "--quant-head", "int4", "--out", str(out),
                 "--model", str(tiny_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quant_head"] == "int4"
    assert isinstance(load_model(out)[0].output, QuantLinear)
    text = tmp_path / "t.txt"
    text.write_text("a0 a1 a2 " * 200)
    runs = {}
    for head in ("none", "int8"):
        assert main(["perplexity", "--quant", "rtn", "--group-size", "32", "--quant-head", head, "--seqlen", "32",
                     "--max-tokens", "128", "--text", str(text), "--model", str(tiny_path), "--json"]) == 0
        runs[head] = json.loads(capsys.readouterr().out)
    assert runs["int8"]["quant_head"] == "int8" and runs["int8"]["kl"] != runs["none"]["kl"]
    assert main(["perplexity", "--quant-head", "int8", "--model", str(tiny_path)]) == 2  # needs --quant
    assert "add --quant" in capsys.readouterr().err
