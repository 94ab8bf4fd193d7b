"""Nothing lost, nothing garbled: writers never destroy their source or leave half a file, and bad
options are refused before the work they would throw away."""

import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import write_tiny_gguf

from minillm import KVCache, SamplingParams, generate_cached, load_model
from minillm.generation import generate_batch, prefill
from minillm.loading import default_model_path
from minillm.speculative import NgramProposer, speculative_generate
from minillm.kv_cache import Int8KVCache
from minillm.files import atomic_write, check_output_path
from minillm.formats import gguf_quant
from minillm.formats.gguf_quant import write_gguf


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def test_requantizing_a_gguf_onto_itself_is_refused_and_the_source_survives(tiny_gguf):
    before = digest(tiny_gguf)
    with pytest.raises(ValueError, match="out: .* is the file being read"):
        write_gguf(tiny_gguf, tiny_gguf, "q8_0")
    link = tiny_gguf.parent / "link.gguf"
    link.symlink_to(tiny_gguf)
    p = run("quantize", "--quant", "q8_0", "--model", str(tiny_gguf), "--out", str(link))
    assert p.returncode == 2 and "is the file being read" in p.stderr, p.stderr
    assert digest(tiny_gguf) == before
    load_model(tiny_gguf)  # still loads


def test_the_embedded_model_cannot_be_overwritten():
    src = default_model_path()
    size = os.path.getsize(src)
    p = run("quantize", "--quant", "q8_0", "--out", str(src))
    assert p.returncode == 2 and "is the file being read" in p.stderr, p.stderr
    assert os.path.getsize(src) == size


def test_a_writer_that_fails_half_way_leaves_the_destination_as_it_was(tiny_gguf, monkeypatch):
    dst = tiny_gguf.parent / "out.gguf"
    dst.write_bytes(b"the previous file")

    def broken(w):
        raise RuntimeError("disk full")

    monkeypatch.setitem(gguf_quant.QUANTIZERS, gguf_quant.GGMLQuantizationType.Q8_0, broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_gguf(tiny_gguf, dst, "q8_0")
    assert dst.read_bytes() == b"the previous file"
    assert sorted(p.name for p in tiny_gguf.parent.iterdir()) == ["out.gguf", "tiny.gguf"]  # no temporary left


def test_a_completed_write_replaces_the_destination_with_ordinary_permissions(tmp_path):
    dst = tmp_path / "table.json"
    with atomic_write(dst) as tmp:
        assert tmp.parent == tmp_path and not dst.exists()
        tmp.write_text("{}")
    assert dst.read_text() == "{}"
    umask = os.umask(0)
    os.umask(umask)
    assert dst.stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("kind", ["missing folder", "a directory", "a source"])
def test_output_paths_are_checked_before_any_work(tmp_path, kind):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"x")
    path = {"missing folder": tmp_path / "nope" / "m.gguf", "a directory": tmp_path, "a source": src}[kind]
    message = {"missing folder": "does not exist", "a directory": "is a folder", "a source": "is the file being read"}
    with pytest.raises(ValueError, match=f"--out: .*{message[kind]}"):
        check_output_path(path, "--out", sources=[src])
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="--out: .* is a file, and a folder is written there"):
        check_output_path(tmp_path / "afile", "--out", folder=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path)
    return load_model(path)[0]


@pytest.mark.parametrize("prompt,message", [
    ("To be", "prompt_tokens: must be a list of int token ids, got str"),
    (torch.tensor([1, 2, 3]), "prompt_tokens: must be a list of int token ids, got Tensor"),
    ([1, 2.0, 3], r"prompt_tokens: token ids must be ints, got 2.0 \(float\)"),
    ([1, True], "prompt_tokens: token ids must be ints, got True"),
])
def test_the_python_api_names_a_prompt_of_the_wrong_kind(tiny_model, prompt, message):
    with pytest.raises(ValueError, match=message):
        generate_cached(tiny_model, prompt, SamplingParams(max_new_tokens=2))


def test_a_cache_of_another_batch_size_or_dtype_is_named(tiny_model):
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="cache: holds a batch of 1 rows, the forward has 2"):
        prefill(tiny_model, tokens, KVCache(tiny_model.config, 1, 8))
    with pytest.raises(ValueError, match="cache: stores torch.float16, the model computes in torch.float32"):
        prefill(tiny_model, tokens, KVCache(tiny_model.config, 2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="cache: holds a batch of 1 rows"):
        prefill(tiny_model, tokens, Int8KVCache(tiny_model.config, 1, 8))


def test_a_prompt_past_the_models_own_context_names_its_limit(tiny_model):
    ctx = tiny_model.config.max_seq_len
    with pytest.raises(ValueError, match=f"do not fit the model's context of {ctx} tokens"):
        generate_cached(tiny_model, [1] * ctx, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=f"raise max_seq_len \\(the model allows {ctx}\\)"):
        generate_cached(tiny_model, [1] * 20, SamplingParams(max_new_tokens=2), max_seq_len=10)


@pytest.mark.parametrize("call,message", [
    (lambda m: generate_batch(m, torch.tensor([[1, 2]])), "prompts: must be a list of prompts"),
    (lambda m: generate_batch(m, [1, 2, 3]), "prompts: must be a list of prompts"),
    (lambda m: generate_cached(m, [1, 2], {"temperature": 0}), "params: must be a SamplingParams, got dict"),
    (lambda m: generate_cached(m, [1, 2], max_seq_len="10"), "max_seq_len: must be an int or None"),
    (lambda m: generate_cached(m, [1, 2], eos_ids="0"), "eos_ids: must be a set of int token ids"),
    (lambda m: m(torch.tensor([[1.0, 2.0]]), torch.arange(2)), "tokens: must be \\(B, T\\) integer ids"),
    (lambda m: KVCache(m.config, 0, 8), "batch_size: must be an int >= 1"),
    (lambda m: speculative_generate(m, NgramProposer(m.config.vocab_size), [1, 2], num_speculative_tokens=2.5),
     "num_speculative_tokens: must be an int, got 2.5"),
])
def test_more_wrong_argument_types_are_named(tiny_model, call, message):
    with pytest.raises(ValueError, match=message):
        call(tiny_model)


# `python -m minillm quantize` in a process that sends itself the signal as the rename begins: the whole file is in
# its temporary, the worst moment to stop. (A signal from outside, sent when the temporary appears, lands after
# the rename whenever the machine is loaded: the write takes a fraction of a second.)
SIGNAL_AT_RENAME = """
import os, sys
from minillm.cli import main
rename = os.replace
def replace(src, dst, *args, **kwargs):
    if os.path.basename(dst) == "m.gguf":
        os.kill(os.getpid(), {signum})
    return rename(src, dst, *args, **kwargs)
os.replace = replace
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, id="SIGINT", marks=pytest.mark.slow),
                                    pytest.param(signal.SIGTERM, id="SIGTERM")])
def test_a_quantize_stopped_during_its_write_leaves_neither_the_file_nor_a_temporary(tmp_path, signum):
    out = tmp_path / "m.gguf"
    p = subprocess.run([sys.executable, "-c", SIGNAL_AT_RENAME.format(signum=int(signum)), "quantize", "--quant",
                        "q8_0", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert sorted(tmp_path.iterdir()) == [], p.stderr  # neither m.gguf nor .m.gguf.*.tmp
    if signum == signal.SIGTERM:  # SIGINT is Ctrl-C's KeyboardInterrupt; SIGTERM what kill and service managers send
        assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in p.stderr, p.stderr
    else:
        assert p.returncode != 0 and "KeyboardInterrupt" in p.stderr, p.stderr
