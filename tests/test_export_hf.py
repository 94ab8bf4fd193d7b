"""export-hf: the Hugging Face folder transformers opens counts minillm's tokens and computes minillm's logits.

The oracle is transformers itself: ``AutoTokenizer`` and ``AutoModelForCausalLM.from_pretrained`` on the written
folder, against minillm's tokenizer and model on the source (a tiny GGUF, a tiny Llama or GPT-2 folder, a file
written by ``quantize``, the embedded SmolLM2-135M-Instruct).
"""

import json
import shutil

import pytest
import torch

from helpers import CHATML, write_hf_checkpoint, write_tiny_gguf
from minillm.cli import main
from minillm.formats import hf_export
from minillm.formats.hf import load_hf_checkpoint
from minillm.generation import generate
from minillm.loading import load_model
from minillm.sampling_params import SamplingParams
from minillm.tokenizer import Tokenizer

TEXTS = ["Hello world!", "The year 2024 had 365 days;  two  spaces\n\n\tand a tab", "Café naïve 東京 🤖",
         "ROMEO. But soft, what light through yonder window breaks?", "   leading", "trailing   \n", "  123456 7.5e-3",
         "aaaa a0a1 ab"]
MESSAGES = [[{"role": "user", "content": "What is 2+2?"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a play."},
             {"role": "assistant", "content": "Macbeth."}, {"role": "user", "content": "Another?"}]]


def hf_chat_ids(hf_tok, messages):
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def check_tokenizer(folder, tokenizer, texts):
    """transformers' tokenizer on the folder encodes, decodes and applies the chat template as minillm's does."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(folder)
    for text in texts:
        ids = tokenizer.encode(text)
        assert hf_tok.encode(text, add_special_tokens=False) == ids, text
        assert hf_tok.decode(ids) == tokenizer.decode(ids)
    if tokenizer.chat_template:
        for messages in MESSAGES:
            assert hf_chat_ids(hf_tok, messages) == tokenizer.apply_chat_template(messages)
    assert hf_tok.eos_token_id == tokenizer.eos_id and hf_tok.pad_token_id == tokenizer.eos_id
    back = Tokenizer.from_hf_folder(folder)  # minillm reads its own folder back to the same encoding
    assert [back.encode(t) for t in texts] == [tokenizer.encode(t) for t in texts]
    return hf_tok


def check_model(folder, model, prompts, new_tokens=12, atol=1e-4):
    """transformers' model on the folder: logits within ``atol`` of minillm's, and the same greedy tokens."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    for ids in prompts:
        with torch.no_grad():
            theirs = hf_model(torch.tensor([ids])).logits[0]
            ours = model(torch.tensor([ids]), torch.arange(len(ids)), None)[0]
            assert (theirs - ours).abs().max().item() < atol * max(1.0, ours.abs().max().item())
            greedy = hf_model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                       min_new_tokens=new_tokens)[0, len(ids):].tolist()
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        assert generate(model, ids, params).tokens == greedy


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "tiny.gguf"
    write_tiny_gguf(path, chat_template=CHATML)
    return path


def test_tiny_gguf_tokenizer_counts_minillm_tokens(tiny_gguf, tmp_path):
    out = hf_export.export_hf(tmp_path / "hf", tiny_gguf)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    _, tokenizer = load_model(tiny_gguf)
    hf_tok = check_tokenizer(out, tokenizer, TEXTS)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML and config["model_max_length"] == 128
    assert hf_tok.convert_ids_to_tokens(0) == "<|endoftext|>" and 0 in hf_tok.all_special_ids


def test_tiny_gguf_weights_give_minillm_logits_and_greedy_tokens(tiny_gguf, tmp_path):
    out = hf_export.export_hf(tmp_path / "hf", tiny_gguf, weights=True)
    model, tokenizer = load_model(tiny_gguf)
    check_model(out, model, [tokenizer.encode(t) for t in TEXTS[:3]] + [[5, 17, 200, 3]])
    # minillm reads the folder back to the very tensors it wrote
    config, state = load_hf_checkpoint(out)
    assert config == model.config
    src = hf_export.read_source(tiny_gguf, weights=True)[2]
    assert state.keys() == src.keys() and all(torch.equal(state[k], src[k]) for k in src)


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("gpt2", True)])
def test_hf_folders_round_trip(arch, tie, tiny_gguf, tmp_path):
    """A Llama (untied and tied) and a GPT-2 folder, each with the tiny GGUF's tokenizer beside it."""
    src = tmp_path / "src"
    write_hf_checkpoint(src, arch=arch, tie=tie)
    tok_dir = hf_export.export_hf(tmp_path / "tok", tiny_gguf)
    for name in hf_export.TOKENIZER_FILES:
        shutil.copy(tok_dir / name, src / name)
    out = hf_export.export_hf(tmp_path / "hf", src, weights=True)
    model, tokenizer = load_model(src)
    check_model(out, model, [tokenizer.encode(t) for t in TEXTS[:3]])
    names = set(json.loads((out / "config.json").read_text())) & {"n_embd", "hidden_size"}
    assert names == ({"n_embd"} if arch == "gpt2" else {"hidden_size"})


def test_a_quantized_file_exports_its_dequantized_weights(tiny_gguf, tmp_path):
    """A file written by quantize: the folder holds the weights its codes stand for (dequantized), so
    transformers computes the quantized model's logits."""
    from minillm.quant import Recipe
    from minillm.quant.checkpoint import save_quantized
    from minillm.quant.pipeline import quantize_model

    model, _ = load_model(tiny_gguf)
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    report = quantize_model(model, Recipe.of("rtn", bits=4, group_size=32), tokens, progress=False)
    q = save_quantized(model, tmp_path / "q.safetensors", report, tokenizer_source=str(tiny_gguf))
    out = hf_export.export_hf(tmp_path / "hf", q, weights=True)
    qmodel, tokenizer = load_model(q, fast=False)
    qlayer = qmodel.layers[0].attn.wqkv
    exported = load_hf_checkpoint(out)[1]["layers.0.attn.wq.weight"]
    assert torch.equal(exported, qlayer.dequantize()[: exported.shape[0]].float())
    # the int4 kernels compute in bfloat16, so logits agree to bfloat16's precision
    check_model(out, qmodel, [tokenizer.encode(TEXTS[3])], new_tokens=4, atol=2e-2)


def test_refuses_a_folder_that_is_not_empty_unless_overwrite(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["export-hf", str(out), "--model", str(tiny_gguf)]) == 2
    err = capsys.readouterr().err
    assert "DIR" in err and "--overwrite" in err and "not empty" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert main(["export-hf", str(out), "--model", str(tiny_gguf), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left beside it
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export-hf", str(empty), "--model", str(tiny_gguf)]) == 0  # an empty folder is filled
    (tmp_path / "file").write_text("x")
    assert main(["export-hf", str(tmp_path / "file"), "--model", str(tiny_gguf)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_refuses_writing_over_the_model_it_reads(tiny_gguf, tmp_path, capsys):
    src = tmp_path / "src"
    write_hf_checkpoint(src)
    shutil.copy(hf_export.export_hf(tmp_path / "tok", tiny_gguf) / "tokenizer.json", src / "tokenizer.json")
    before = sorted(p.name for p in src.iterdir())
    assert main(["export-hf", str(src), "--model", str(src), "--weights", "--overwrite"]) == 2
    assert "being read" in capsys.readouterr().err
    assert sorted(p.name for p in src.iterdir()) == before


def test_a_failure_half_way_leaves_no_folder_and_keeps_the_old_one(tiny_gguf, tmp_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        hf_export.export_hf(tmp_path / "new", tiny_gguf, weights=True)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary
    old = hf_export.export_hf(tmp_path / "old", tiny_gguf)
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    with pytest.raises(OSError, match="No space"):
        hf_export.export_hf(old, tiny_gguf, weights=True, overwrite=True)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["old"]


def test_a_folder_without_a_tokenizer_is_refused(tmp_path):
    src = tmp_path / "src"
    write_hf_checkpoint(src)
    assert main(["export-hf", str(tmp_path / "hf"), "--model", str(src)]) == 2
    assert not (tmp_path / "hf").exists()


# -- the embedded SmolLM2-135M-Instruct -------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    assert main(["export-hf", str(out), "--weights"]) == 0
    return out


def test_embedded_tokenizer_counts_minillm_tokens(embedded_folder, tokenizer, play_text, reader):
    # the merges rebuilt from tiktoken's ranks are the GGUF's own, in its order (minillm's reader refuses merges
    # whose tokens' ids do not follow the list, such as every split of a token into two)
    merges = json.loads((embedded_folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"]
    assert [" ".join(m) for m in merges] == reader.fields["tokenizer.ggml.merges"].contents()
    lines = play_text.splitlines()
    chunks = ["\n".join(lines[i:i + 40]) for i in range(0, min(len(lines), 2000), 40)]
    check_tokenizer(embedded_folder, tokenizer, TEXTS + chunks)


def test_embedded_weights_give_minillm_greedy_tokens(embedded_folder, model, tokenizer):
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("Once upon a time"),
               tokenizer.encode_chat("Write a haiku about the sea.")]
    check_model(embedded_folder, model, prompts, new_tokens=16, atol=1e-3)
