"""`python -m minillm perplexity` and `python -m minillm quantize`, run as users run them."""

import json
import os
import subprocess
import sys

import pytest
import torch

from minillm.data import HELD_OUT_PLAY, play_text
from minillm.evaluation import perplexity


def run(*args):
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=900, env=env)


def test_perplexity_json_matches_the_library(model, tokenizer):
    p = run("perplexity", "--seqlen", "128", "--max-tokens", "512", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {"perplexity", "tokens", "seqlen", "text"} <= out.keys()
    ref = perplexity(model, tokenizer.encode(play_text(HELD_OUT_PLAY)), 128, 512)
    assert out["tokens"] == ref["tokens"] == 4 * 127 and out["seqlen"] == 128
    assert out["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-4)


def test_perplexity_of_an_own_text_file(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["the cat sat on the mat."] * 80))
    p = run("perplexity", "--text", str(text), "--seqlen", "64", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["perplexity"] < 3  # a text that repeats itself is easy to predict


def test_quantize_then_generate_and_score_the_saved_model(tmp_path, model, tokenizer):
    out = tmp_path / "rtn4.safetensors"
    p = run("quantize", "--quant", "rtn", "--bits", "4", "--group-size", "64", "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["bytes"] == out.stat().st_size < 0.3 * info["float32_bytes"]  # 4-bit: under 30% of float32
    g = run("generate", "--model", str(out), "--prompt", "To be, or not to be", "--max-new-tokens", "8", "--json")
    assert g.returncode == 0, g.stderr
    assert len(json.loads(g.stdout)["tokens"]) == 8
    s = run("perplexity", "--model", str(out), "--seqlen", "128", "--max-tokens", "512", "--json")
    base = run("perplexity", "--seqlen", "128", "--max-tokens", "512", "--quant", "rtn", "--bits", "4",
               "--group-size", "64", "--json")
    assert s.returncode == 0 and base.returncode == 0, s.stderr + base.stderr
    saved, live = json.loads(s.stdout), json.loads(base.stdout)
    # the saved model scores what the live quantization scored, and worse than float
    assert saved["perplexity"] == pytest.approx(live["perplexity"], rel=2e-3)
    assert live["float_perplexity"] < live["perplexity"] and live["kl"] > 0


def test_quantize_to_gguf_q8_0(tmp_path):
    out = tmp_path / "m-q8_0.gguf"
    p = run("quantize", "--quant", "q8_0", "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["bytes"] > info["source_bytes"]  # Q8_0 (8.5 bits) is larger than the shipped Q4_1 (5 bits)
    s = run("perplexity", "--model", str(out), "--seqlen", "128", "--max-tokens", "256", "--json")
    assert s.returncode == 0, s.stderr


@pytest.mark.parametrize("args,message", [
    (["quantize", "--quant", "gptq", "--out", "x.bin"], "error: out: gptq writes safetensors"),
    (["quantize", "--quant", "q4_0", "--out", "x.safetensors"], "error: out: q4_0 writes a GGUF file"),
    (["quantize", "--quant", "rtn", "--bits", "9", "--out", "x.safetensors"], "error: bits: must be an integer in 2..8"),
    (["perplexity", "--quant", "rtn", "--group-size", "0"], "error: group_size: must be -1"),
    (["perplexity", "--seqlen", "100000"], "error: seqlen: the text has"),
    (["perplexity", "--text", "/nonexistent.txt"], "error: text: cannot read"),
])
def test_bad_input_is_named(args, message):
    p = run(*args)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_quant_flags_reach_the_library():
    """--recipe picks GPTQ's preset (best by default; awq+gptq: without v2), each flag given changes one field
    of it, and the five flags that were the paper's settings give exactly --recipe paper; bench quant's
    --no-mse reaches quant_table."""
    from dataclasses import replace

    from minillm import cli
    from minillm.quant import cli as cli_quant
    from minillm.quant import pipeline
    from minillm.quant.recipe import AWQ_GPTQ, BEST, PAPER

    def recipe(*flags, quant="gptq"):
        return cli_quant._recipe(cli.build_parser().parse_args(["perplexity", "--quant", quant, *flags]))

    assert recipe() == recipe("--recipe", "best") == BEST
    assert recipe("--recipe", "paper") == PAPER
    assert recipe("--no-act-order", "--no-mse", "--percdamp", "0.01", "--no-true-sequential", "--no-v2") == PAPER
    assert recipe("--recipe", "paper", "--act-order", "--bits", "3", "--group-size", "-1") == replace(
        PAPER, act_order=True, bits=3, group_size=-1)
    assert recipe(quant="awq+gptq") == AWQ_GPTQ and recipe("--v2", "--v2-percdamp", "0.1", quant="awq+gptq").v2_percdamp == 0.1
    for flags, clip in (([], False), (["--awq-clip"], True), (["--no-awq-clip"], False)):
        assert recipe("--mse", *flags, quant="awq+gptq").clip is clip
    assert recipe("--no-mse", quant="awq+gptq").clip is True
    assert recipe("--quant-head", "int8", quant="rtn").quant_head == "int8"
    args = cli.build_parser().parse_args(["perplexity", "--quant", "gptq"])
    assert (args.calib_samples, args.calib_seqlen) == (pipeline.CALIB_SAMPLES, 512)
    args = cli.build_parser().parse_args(["bench", "quant", "--no-mse"])
    assert args.mse is False and args.calib_samples == pipeline.CALIB_SAMPLES and args.avenues is None
    assert cli.build_parser().parse_args(["bench", "quant", "--avenues"]).avenues == "all"


def test_gptq_only_flags_are_refused_for_other_methods():
    from minillm import cli
    from minillm.quant import cli as cli_quant

    for flag in (["--no-act-order"], ["--percdamp", "0.01"], ["--v2"], ["--v2-percdamp", "0.1"], ["--recipe", "paper"]):
        args = cli.build_parser().parse_args(["perplexity", "--quant", "awq", *flag])
        with pytest.raises(ValueError, match="does not use"):
            cli_quant._recipe(args)


def test_llama_cpp_formats_refuse_the_other_methods_options(tmp_path):
    """q4_0 and the other GGUF formats fix their bits and blocks: --bits 9 or --act-order was ignored, exit 0."""
    from minillm import cli
    from minillm.quant import cli as cli_quant

    for flag, name in ((["--bits", "9"], "bits"), (["--act-order"], "act-order"), (["--recipe", "paper"], "recipe"),
                       (["--calib-samples", "7"], "calib-samples"), (["--bpw", "3"], "bpw")):
        args = cli.build_parser().parse_args(["quantize", "--quant", "q4_0", *flag, "--out", str(tmp_path / "x.gguf")])
        with pytest.raises(ValueError, match=f"{name}: q4_0 is one of llama.cpp's block formats.*drop --{name}"):
            cli_quant.cmd_quantize(args)
    assert not (tmp_path / "x.gguf").exists()


def test_a_quantized_source_is_refused_before_any_work(tmp_path):
    from minillm import cli
    from minillm.quant import cli as cli_quant

    args = cli.build_parser().parse_args(["quantize", "--quant", "awq", "--model", str(tmp_path / "q.safetensors"),
                                          "--out", str(tmp_path / "r.safetensors")])
    with pytest.raises(ValueError, match="model: .*q.safetensors is already quantized"):
        cli_quant.cmd_quantize(args)


def test_v2_options_that_cannot_apply_are_refused_before_the_model_loads():
    """--v2-percdamp dampens GPTQv2's correction: refused where v2 is off (--no-v2, or awq+gptq's default)
    and outside [0, 1), by _recipe, which runs before the model is loaded; --measure and
    --measurement without --bpw are refused rather than ignored."""
    from minillm import cli
    from minillm.quant import cli as cli_quant

    for argv in (["--quant", "gptq", "--no-v2", "--v2-percdamp", "0.1"], ["--quant", "awq+gptq", "--v2-percdamp", "0.1"],
                 ["--quant", "gptq", "--v2-percdamp", "1.5"]):
        with pytest.raises(ValueError, match="v2-percdamp"):
            cli_quant._recipe(cli.build_parser().parse_args(["perplexity", *argv]))
    cli_quant._recipe(cli.build_parser().parse_args(["perplexity", "--quant", "awq+gptq", "--v2", "--v2-percdamp", "0.1"]))
    for argv in (["quantize", "--quant", "gptq", "--out", "x.safetensors", "--measure", "kl"],
                 ["bench", "quant", "--measurement", "m.json"]):
        args = cli.build_parser().parse_args(argv)
        with pytest.raises(ValueError, match="add --bpw"):
            args.func(args)


def test_help_states_the_defaults():
    p = run("perplexity", "--help")
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    for phrase in ("--no-act-order", "--no-mse", "--no-true-sequential", "--no-v2", "(default 0.001; the paper: 0.01)",
                   "calibration windows (default 32)", "--recipe {paper,best}"):
        assert phrase in text, phrase


def test_an_existing_out_is_refused_before_any_work_and_replaced_with_overwrite(tmp_path, capsys):
    from helpers import write_tiny_gguf

    from minillm.cli import main
    from minillm.formats.gguf_quant import write_gguf

    old = b"a file the user may still want"
    for quant, name in (("gptq", "m.safetensors"), ("q4_k_m", "m.gguf")):  # the embedded model: minutes of work
        out = tmp_path / name
        out.write_bytes(old)
        assert main(["quantize", "--quant", quant, "--out", str(out)]) == 2
        assert f"error: --out: '{out}' exists; add --overwrite" in capsys.readouterr().err
        assert out.read_bytes() == old
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    out = tmp_path / "m.gguf"
    assert main(["quantize", "--quant", "q8_0", "--model", str(src), "--out", str(out), "--overwrite", "--json"]) == 0
    assert out.read_bytes() == write_gguf(src, tmp_path / "ref.gguf", "q8_0").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.safetensors", "ref.gguf", "tiny.gguf"]
