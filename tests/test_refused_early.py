"""Options that would throw work away are refused before the work (and mostly before the model is
loaded), with exit status 2 and a message naming the option; what the commands report says what ran."""

import os
import shutil
import subprocess
import warnings

import pytest
from helpers import CHATML, TINY, run_cli, tiny_llama_weights, write_tiny_gguf

from minillm import ModelFileError, load_model
from minillm.cli import build_parser
from minillm.quant import Recipe
from minillm.quant.pipeline import quantize_model


run = run_cli  # in this process: the refusals come before any work, the rest is a tiny model's


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.mark.parametrize("args,message", [
    (["quantize", "--quant", "gptq", "--out", "/nonexistent-folder/m.safetensors"], "error: --out: the folder"),
    (["quantize", "--quant", "q4_0", "--out", "/nonexistent-folder/m.gguf"], "error: --out: the folder"),
    (["quantize", "--quant", "rtn", "--out", "DIR.safetensors"], "error: --out: "),
    (["distill-draft", "--out", "FILE"], "error: --out: "),
    (["generate", "--prompt", "x", "--kv-dtype", "int8", "--cache", "dynamic"], "error: kv-dtype: int8 is implemented for"),
    (["generate", "--prompt", "x", "--draft", "ngram", "--cache", "none"], "error: draft: speculative decoding uses"),
    (["generate", "--prompt", "x", "--draft", "/nonexistent-draft"], "error: draft: '/nonexistent-draft' is neither"),
    (["quantize", "--quant", "rtn", "--act-order", "--out", "x.safetensors"], "error: quant: rtn does not use --act-order"),
    (["perplexity", "--quant", "awq", "--static-groups"], "error: quant: awq does not use --static-groups"),
    (["perplexity", "--quant", "gptq", "--awq-clip"], "error: quant: gptq does not use --awq-clip"),
    (["quantize", "--quant", "rtn", "--dtype", "bfloat16", "--out", "x.safetensors"], "error: dtype: quantize works on float32"),
])
def test_refused_before_the_model_is_loaded(tmp_path, args, message):
    (tmp_path / "DIR.safetensors").mkdir()
    (tmp_path / "FILE").write_text("not a folder")
    p = run(*args, cwd=tmp_path)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert "dequantizing" not in p.stderr  # the embedded model was never loaded


@pytest.mark.parametrize("args,message", [
    (["quantize", "--quant", "gptq", "--calib-seqlen", "200", "--out", "OUT/q.safetensors"],
     "error: calib-seqlen: 200 tokens do not fit the model's context of 128 tokens"),
    (["perplexity", "--seqlen", "200", "--max-tokens", "1000"], "error: seqlen: windows of 200 tokens do not fit the model's context of 128"),
    (["roofline", "--batch-sizes", "2000000", "--prompt-lengths", ""], "error: --batch-sizes: 2000000 needs about"),
])
def test_options_past_the_model_are_refused_before_the_work(tiny, tmp_path, args, message):
    p = run(*[a.replace("OUT", str(tmp_path)) for a in args], "--model", str(tiny))
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert "GB/s" not in p.stdout and not list(tmp_path.iterdir())  # no ceilings measured, nothing written


def test_perplexity_says_which_tokens_it_scored(tiny):
    p = run("perplexity", "--model", str(tiny), "--seqlen", "100", "--max-tokens", "250")
    assert p.returncode == 0, p.stderr
    assert "198 tokens scored in 2 windows of 100" in p.stdout and "first 200 of 250 tokens taken" in p.stdout


def test_the_commands_draw_into_a_git_ignored_folder_unless_told():
    args = build_parser().parse_args(["bench", "quant"])
    assert args.out.startswith("figures/runs/")
    assert build_parser().parse_args(["tour"]).out is None  # tour then uses tour.runs_folder()
    from minillm.lab.tour import runs_folder

    assert str(runs_folder()) in ("figures/runs", os.environ.get("MINILLM_FIGURES"))
    ignored = subprocess.run(["git", "check-ignore", "-q", "figures/runs/x.png"], cwd=os.path.dirname(__file__) + "/..")
    assert ignored.returncode == 0
    for cmd in (["tour", "--help"], ["bench", "quant", "--help"]):
        assert "MINILLM_FIGURES" in run(*cmd).stdout


@pytest.mark.parametrize("bits,group_size", [(8, 32), (4, 48)])
def test_layers_without_an_int4_kernel_are_named_when_the_model_is_built(tiny, bits, group_size):
    model, _ = load_model(tiny)
    with pytest.warns(UserWarning, match="quantized layers have no int4 kernel"):
        quantize_model(model, Recipe.of("rtn", bits=bits, group_size=group_size), progress=False)
    model, _ = load_model(tiny)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_model(model, Recipe.of("rtn", bits=4, group_size=32), progress=False)  # the kernel's layout: no warning
    assert "dequantize every forward" in run("quantize", "--help").stdout.replace("\n", " ").replace("  ", " ")


def test_a_quantized_file_skips_the_peer_and_warns_when_its_tokenizer_moved(tmp_path):
    src = tmp_path / "src.gguf"
    cfg = {**TINY, "ctx": 1024}  # the tour's speculative row chats with a 342-token prompt
    write_tiny_gguf(src, tiny_llama_weights(cfg=cfg), cfg=cfg, chat_template=CHATML)
    out = tmp_path / "q.safetensors"
    assert run("quantize", "--quant", "rtn", "--group-size", "32", "--model", str(src), "--out", str(out)).returncode == 0
    p = run("bench", "decode", "--model", str(out), "--new-tokens", "2", "--repeats", "1", "--json")
    assert p.returncode == 0 and "the peer is skipped" in p.stderr, p.stderr
    p = run("tour", "--model", str(out), "--new-tokens", "2", "--out", str(tmp_path))
    assert p.returncode == 0 and "int4" not in p.stdout, p.stdout + p.stderr
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~umask()  # readable as any file the user writes
    src.unlink()
    with pytest.raises(ModelFileError, match=f"its tokenizer was recorded as {src}, which no longer exists, and the "
                       "embedded model's has another vocabulary"):
        load_model(out)


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_quantized_file_records_its_source_as_an_absolute_path(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf")
    p = run("quantize", "--quant", "rtn", "--group-size", "32", "--model", "t.gguf", "--out", "q.safetensors",
            cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    model, tokenizer = load_model(tmp_path / "q.safetensors")  # from another working folder
    assert tokenizer.vocab_size == model.config.vocab_size == 300


@pytest.mark.parametrize("args", [["tour", "--out", "FILE"], ["fragmentation", "--out", "FILE"]])
def test_an_output_folder_that_is_a_file_is_refused_first(tmp_path, args):
    (tmp_path / "FILE").write_text("")
    p = run(*args, cwd=tmp_path)
    assert p.returncode == 2 and "error: --out: 'FILE' is a file, and a folder is written there" in p.stderr, p.stderr
    assert "dequantizing" not in p.stderr
