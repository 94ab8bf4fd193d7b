"""Damaged quantized checkpoints are refused before any tensor is used: ``check_file`` reads the metadata
(bits, group size, layer count, the model's sizes) against every tensor's shape and dtype, ``check_spare_bits``
the packed words; a good file loads and generates what the model it was written from generates."""

import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import TINY, run_cli, tiny_llama_weights, write_tiny_gguf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minillm import SamplingParams, generate_cached, load_model
from minillm.errors import ModelFileError
from minillm.quant import Recipe, quantize_model
from minillm.quant.checkpoint import load_quantized, save_quantized
from minillm.quant.head import quantize_output

CFG = {**TINY, "n_layers": 3, "vocab": 320}  # vocab a multiple of 16: the int4 head's kernel packs rows by 16
PROMPT = [5, 17, 260, 3, 99]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: path} of good files written by save_quantized from a tiny 3-layer model, and the live models."""
    folder = tmp_path_factory.mktemp("ckpt")
    src, q8_src = folder / "tiny.gguf", folder / "tiny_q8_0_embedding.gguf"
    write_tiny_gguf(src, tiny_llama_weights(cfg=CFG), cfg=CFG)
    # an embedding in Q8_0 blocks, as the shipped model's, is saved as those blocks (tok_embeddings.q8_0)
    write_tiny_gguf(q8_src, tiny_llama_weights(cfg=CFG), cfg=CFG, qtypes={"token_embd.weight": Q.Q8_0})
    tokens = torch.randint(0, CFG["vocab"], (1, 16), generator=torch.Generator().manual_seed(0))
    out = {"src": src}
    for name, bits, head in (("q4", 4, "none"), ("q3", 3, "none"), ("q7", 7, "none"), ("q8", 8, "none"),
                             ("q4_int8_head", 4, "int8"), ("q4_q8_0_embedding", 4, "none")):
        model, _ = load_model(q8_src if name == "q4_q8_0_embedding" else src, fast=False)
        report = quantize_model(model, Recipe.of("rtn", bits=bits, group_size=32), tokens, fast=False, progress=False)
        quantize_output(model, head, fast=False)  # the reference path, as load_quantized(fast=False) below
        out[name] = save_quantized(model, folder / f"{name}.safetensors", report, tokenizer_source=str(src))
        out[f"{name}_model"] = model
    return out


def damage(path, out, tensors=None, drop=(), **meta_edits):
    """Write ``path``'s tensors (``tensors`` replacing or adding some, ``drop`` leaving some out) and its metadata
    (each keyword a metadata key: a dict is merged into that key's JSON, a string replaces it) to ``out``."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    state = {k: v for k, v in load_file(str(path)).items() if k not in drop}
    state.update(tensors or {})
    for key, edit in meta_edits.items():
        meta[key] = json.dumps({**json.loads(meta[key]), **edit}) if isinstance(edit, dict) else edit
    save_file({k: v.contiguous() for k, v in state.items()}, str(out), metadata=meta)
    return out


def quant_config(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["quant_config"])


def refuses(path, match):
    with pytest.raises(ModelFileError, match=f"{path.name}: {match}") as e:
        load_quantized(path, fast=False)
    assert "python -m minillm quantize" in str(e.value)  # what to do


def with_bits(path, bits):
    """The metadata edit that says every layer holds ``bits``-bit codes."""
    q = quant_config(path)
    return {"bits": bits, "layer_configs": {k: [bits, g] for k, (_, g) in q["layer_configs"].items()}}


def test_metadata_saying_3_bits_on_4_bit_codes_is_refused(files, tmp_path):
    # 4-bit words are longer than 3-bit ones (8 vs 10 codes a word): the over-long qweight passed and gave garbage
    bad = damage(files["q4"], tmp_path / "bits3.safetensors", quant_config=with_bits(files["q4"], 3))
    refuses(bad, r"layers\.0\.attn\.wqkv\.qweight has shape \(8, 128\), but the metadata implies \(7, 128\) "
                 r"\(3-bit codes, 10 per int32 word")


def test_metadata_saying_7_bits_on_8_bit_codes_is_refused(files, tmp_path):
    # 7 and 8 bits both pack 4 codes a word, so the shapes agree; 8-bit codes set the top 4 bits 7-bit words leave 0
    bad = damage(files["q8"], tmp_path / "bits7.safetensors", quant_config=with_bits(files["q8"], 7))
    refuses(bad, r"layers\.0\.attn\.wqkv\.qweight has bits set above its 4 7-bit codes per word")


def test_over_long_packed_buffers_are_refused(files, tmp_path):
    state = load_file(str(files["q4"]))
    qw, qz = state["layers.1.mlp.w_down.qweight"], state["layers.2.attn.wo.qzeros"]
    bad = damage(files["q4"], tmp_path / "long_qweight.safetensors",
                 {"layers.1.mlp.w_down.qweight": torch.cat([qw, torch.zeros_like(qw[:1])])})
    refuses(bad, r"layers\.1\.mlp\.w_down\.qweight has shape \(17, 64\), but the metadata implies \(16, 64\)")
    bad = damage(files["q4"], tmp_path / "long_qzeros.safetensors",
                 {"layers.2.attn.wo.qzeros": torch.cat([qz, torch.zeros_like(qz[:, :1])], 1)})
    refuses(bad, r"layers\.2\.attn\.wo\.qzeros has shape \(2, 9\), but the metadata implies \(2, 8\)")


def test_a_group_size_the_scales_do_not_have_is_refused(files, tmp_path):
    # scales and g_idx agreed with each other, so a group size of 16 in the metadata loaded as 32
    q = quant_config(files["q4"])
    edit = {"group_size": 16, "layer_configs": {k: [b, 16] for k, (b, _) in q["layer_configs"].items()}}
    bad = damage(files["q4"], tmp_path / "g16.safetensors", quant_config=edit)
    refuses(bad, r"layers\.0\.attn\.wqkv\.qzeros has shape \(2, 16\), but the metadata implies \(4, 16\)")


@pytest.mark.parametrize("n_layers", [1, 5])
def test_n_layers_other_than_the_file_holds_is_refused(files, tmp_path, n_layers):
    # n_layers 1 of 3 loaded a 1-layer model; 5 of 3 was refused as a missing tensor, not a wrong n_layers
    bad = damage(files["q4"], tmp_path / f"layers{n_layers}.safetensors", model_config={"n_layers": n_layers})
    refuses(bad, f"model_config.n_layers is {n_layers} but the file holds the tensors of 3 layers")


def test_layer_configs_other_than_n_layers_are_refused(files, tmp_path):
    q = quant_config(files["q4"])
    fewer = {k: v for k, v in q["layer_configs"].items() if not k.startswith("layers.2.")}
    bad = damage(files["q4"], tmp_path / "fewer.safetensors", quant_config={"layer_configs": fewer})
    refuses(bad, r"quant_config\.layer_configs lacks layers\.2\.attn\.wqkv, and model_config\.n_layers is 3")
    nine = {**q["layer_configs"], "layers.1.attn.wo": [9, 32]}
    bad = damage(files["q4"], tmp_path / "nine.safetensors", quant_config={"layer_configs": nine})
    refuses(bad, r"quant_config\.layer_configs\['layers\.1\.attn\.wo'\]: bits: must be an integer in 2\.\.8, got 9")


@pytest.mark.parametrize("name,length", [("layers.1.ffn_norm.weight", 60), ("norm.weight", 65)])
def test_a_norm_weight_of_the_wrong_length_is_refused(files, tmp_path, name, length):
    # it loaded, and the first forward failed with a traceback
    bad = damage(files["q4"], tmp_path / "norm.safetensors", {name: torch.ones(length)})
    refuses(bad, rf"{name} has shape \({length},\), but the metadata implies \(64,\) \(model_config\.dim\)")


def test_the_embedding_and_every_tensor_are_checked(files, tmp_path):
    emb = load_file(str(files["q4"]))["tok_embeddings.weight"]
    refuses(damage(files["q4"], tmp_path / "emb.safetensors", {"tok_embeddings.weight": emb[:300]}),
            r"tok_embeddings\.weight has shape \(300, 64\), but the metadata implies \(320, 64\)")
    refuses(damage(files["q4"], tmp_path / "drop.safetensors", drop=["layers.2.mlp.w_down.g_idx"]),
            r"missing tensor layers\.2\.mlp\.w_down\.g_idx \(the metadata implies shape \(128,\)\)")
    refuses(damage(files["q4"], tmp_path / "extra.safetensors", {"layers.0.attn.wqkv.bias": torch.zeros(128)}),
            r"tensor layers\.0\.attn\.wqkv\.bias \(128,\) is not one the metadata implies \(model_config's attn_bias")
    # a bias the config asks for and the file lacks was left out silently
    refuses(damage(files["q4"], tmp_path / "nobias.safetensors", model_config={"attn_bias": True}),
            r"missing tensor layers\.0\.attn\.wqkv\.bias")
    blocks = load_file(str(files["q4_q8_0_embedding"]))["tok_embeddings.q8_0"]  # (320, 2 * 34) uint8
    refuses(damage(files["q4_q8_0_embedding"], tmp_path / "q8.safetensors", {"tok_embeddings.q8_0": blocks[:, :34]}),
            r"tok_embeddings\.q8_0 has shape \(320, 34\), but the metadata implies \(320, 68\)")
    qw = load_file(str(files["q4"]))["layers.0.attn.wo.qweight"]
    refuses(damage(files["q4"], tmp_path / "int64.safetensors", {"layers.0.attn.wo.qweight": qw.long()}),
            r"layers\.0\.attn\.wo\.qweight is I64, not I32")


def test_a_quantized_head_is_checked_against_its_kind(files, tmp_path):
    # int8 words (4 codes) read as int4 (8 codes): over-long again
    refuses(damage(files["q4_int8_head"], tmp_path / "head4.safetensors", quant_head="int4"),
            r"output\.qweight has shape \(16, 320\), but the metadata implies \(8, 320\)")
    refuses(damage(files["q4_int8_head"], tmp_path / "head3.safetensors", quant_head="int3"),
            r"quant_head is 'int3', not one of")


def test_damaged_metadata_fields_are_named(files, tmp_path):
    refuses(damage(files["q4"], tmp_path / "nosym.safetensors", quant_config=json.dumps(
        {k: v for k, v in quant_config(files["q4"]).items() if k != "sym"})), r"its metadata .*KeyError: 'sym'")
    refuses(damage(files["q4"], tmp_path / "symstr.safetensors", quant_config={"sym": "false"}),
            r"quant_config\.sym / mse must be true or false")


@pytest.mark.parametrize("name", ["q4", "q3", "q7", "q8", "q4_int8_head", "q4_q8_0_embedding"])
def test_a_good_file_loads_and_generates_the_same_tokens(files, name):
    loaded, meta = load_quantized(files[name], fast=False)
    live = files[f"{name}_model"]
    pos = torch.arange(len(PROMPT))
    with torch.inference_mode():
        assert torch.equal(loaded(torch.tensor([PROMPT]), pos), live(torch.tensor([PROMPT]), pos))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert generate_cached(loaded, PROMPT, params).tokens == generate_cached(live, PROMPT, params).tokens
    assert meta["quant_config"]["bits"] == int(name[1])


def run_generate(path):
    return run_cli("generate", "--model", path, "--prompt", "a0 a1", "--max-new-tokens", "6", "--json")


def test_generate_refuses_each_damaged_file_with_exit_2_and_one_line(files, tmp_path):
    q4 = files["q4"]
    damaged = [damage(q4, tmp_path / "bits3.safetensors", quant_config=with_bits(q4, 3)),
               damage(q4, tmp_path / "layers1.safetensors", model_config={"n_layers": 1}),
               damage(q4, tmp_path / "norm.safetensors", {"layers.1.ffn_norm.weight": torch.ones(60)})]
    for path in damaged:
        p = run_generate(path)
        assert p.returncode == 2, p.stderr
        assert p.stderr.startswith(f"error: {path}: ") and p.stderr.count("\n") == 1, p.stderr
    good = run_generate(q4)
    assert good.returncode == 0, good.stderr
    model, tokenizer = load_model(q4)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    assert json.loads(good.stdout)["tokens"] == generate_cached(model, tokenizer.encode("a0 a1"), params,
                                                                tokenizer=tokenizer).tokens
