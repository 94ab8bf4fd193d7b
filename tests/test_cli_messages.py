"""serve-bench's options are refused with exit status 2 and a message naming the option and the fix,
before the model loads where the check does not need it (right after, before any work, where it does);
--quick sets defaults that an explicit --requests or --scale overrides; generate names --max-seq-len as typed."""

import argparse
import json

import pytest
from helpers import write_tiny_gguf

from minillm import SamplingParams, generate_cached, load_model
from minillm.cli import main
from minillm.lab.serve_bench_cli import register, serve_bench_kwargs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama with a tokenizer and a context of 128 tokens."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def refused(capsys, *args):
    """serve-bench's exit status and stderr; argparse's own refusals exit through SystemExit."""
    try:
        code = main(["serve-bench", "--threads", "1", *args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert out == "", out  # nothing measured, nothing printed
    return code, err


@pytest.mark.parametrize("args,message", [
    (["--block-size", "100000"], "error: --block-size: 100000 tokens per block is more than the longest sequence "
                                 "serve-bench runs (2048 tokens"),
    (["--block-size", "100000"], "use at most 2048"),
    (["--block-size", "0"], "argument --block-size: must be >= 1, got 0"),
    (["--scale", "0"], "argument --scale: must be in (0, 1]"),
    (["--scale", "-0.5"], "argument --scale: must be in (0, 1]"),
    (["--scale", "nan"], "argument --scale: must be in (0, 1]"),
    (["--scale", "1.5"], "argument --scale: must be in (0, 1]"),
    (["--scale", "half"], "argument --scale: expected a number in (0, 1], got 'half'"),
    (["--requests", "0"], "argument --requests: must be >= 1, got 0"),
    (["--requests", "-4"], "argument --requests: must be >= 1, got -4"),
    (["--num-blocks", "0"], "argument --num-blocks: must be >= 1, got 0"),
    (["--num-blocks", "1"], "error: --num-blocks: 1 block of 16 tokens cannot hold the longest request (12 prompt + "
                            "380 output tokens: 25 blocks); give at least 25"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
    (["--max-num-batched-tokens", "-1"], "argument --max-num-batched-tokens: must be >= 1, got -1"),
    (["--threads", "0"], "argument --threads: must be >= 1, got 0"),
    # --quick honours --scale: at full lengths its 4 requests need more blocks than at 1/32
    (["--quick", "--scale", "1", "--num-blocks", "2"], "error: --num-blocks: 2 blocks of 16 tokens cannot hold the "
                                                       "longest request (185 prompt + 755 output tokens: 59 blocks)"),
])
def test_serve_bench_refuses_bad_options_before_loading_the_model(capsys, args, message):
    code, err = refused(capsys, *args)
    assert code == 2 and message in err, err
    assert "kv_bytes" not in err and "num_requests / scale" not in err  # the option's name, not a function's
    assert "dequantizing" not in err  # the embedded model was never loaded


@pytest.mark.parametrize("args,message", [
    (["--scale", "1"], "error: --scale: the longest prompt (693 tokens) leaves no room for a new token in the "
                       "model's context of 128; lower --scale"),
    (["--quick", "--block-size", "2048", "--max-num-seqs", "1"],
     "error: --block-size: the default KV pool (64 KiB) holds 0 blocks of 2048 tokens"),
    (["--quick", "--num-blocks", "1000000000"], "error: --num-blocks: 1000000000 blocks of 16 tokens take"),
])
def test_serve_bench_refuses_what_needs_the_model_before_any_work(capsys, tiny, args, message):
    code, err = refused(capsys, "--model", str(tiny), "--json", *args)
    assert code == 2 and message in err, err
    assert "kv_bytes" not in err


def _args(*argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve-bench", *argv])


@pytest.mark.parametrize("argv,requests,scale", [
    ([], 64, 0.25), (["--quick"], 4, 1 / 32), (["--quick", "--requests", "6"], 6, 1 / 32),
    (["--quick", "--scale", "0.5"], 4, 0.5), (["--requests", "3", "--scale", "0.125"], 3, 0.125)])
def test_quick_sets_defaults_that_requests_and_scale_override(argv, requests, scale):
    kwargs, lengths = serve_bench_kwargs(_args(*argv))
    assert (kwargs["num_requests"], kwargs["scale"], len(lengths)) == (requests, scale, requests)
    small = {"sharing_requests": 1, "memory_requests": 2}  # --quick's; else serve_bench's own defaults
    assert {k: kwargs[k] for k in small if k in kwargs} == (small if "--quick" in argv else {})


def test_quick_with_requests_runs_them_and_the_report_says_so(capsys, tiny):
    assert main(["serve-bench", "--model", str(tiny), "--quick", "--requests", "3", "--scale", "0.0625", "--json",
                 "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_requests"] == 3 and report["scale"] == 0.0625
    assert all(m["same_tokens_as_sequential"] == 3 for m in report["modes"].values())


@pytest.mark.parametrize("draft", [[], ["--draft", "ngram"]], ids=["plain", "speculative"])
def test_generate_names_max_seq_len_as_the_option_typed(capsys, tiny, draft):
    """The library names its argument max_seq_len; the command's user typed --max-seq-len."""
    code = main(["generate", "--model", str(tiny), "--max-seq-len", "4", "--prompt", "a a a a a a", *draft])
    err = capsys.readouterr().err
    assert code == 2 and "tokens do not fit the context of 4 tokens (--max-seq-len)" in err, err
    assert "or raise --max-seq-len (the model allows 128)" in err and "max_seq_len" not in err, err
    with pytest.raises(ValueError, match=r"context of 4 tokens \(max_seq_len\).*or raise max_seq_len"):
        generate_cached(load_model(tiny)[0], [1] * 11, SamplingParams(max_new_tokens=1), max_seq_len=4)  # Python's name
