"""Every command's --json output is strict JSON (no NaN or Infinity), on a tiny random model so
that the whole command runs in seconds."""

import json
import os
import subprocess
import sys

import pytest
from helpers import CHATML, TINY, tiny_llama_weights, write_tiny_gguf


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model with a 1,024-token context (bench quant's windows are 512) and a chat template."""
    cfg = {**TINY, "ctx": 1024}
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path, tiny_llama_weights(cfg=cfg), cfg=cfg, chat_template=CHATML)
    return path


def run(*args, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINILLM_FIGURES": str(cwd or ".")}
    return subprocess.run([sys.executable, "-m", "minillm", *args, "--json"], capture_output=True, text=True,
                          timeout=900, env=env, cwd=cwd)


COMMANDS = {
    "generate": ["generate", "--prompt", "To be", "--max-new-tokens", "4"],
    "generate --draft": ["generate", "--prompt", "To be or not to be", "--max-new-tokens", "6", "--draft", "ngram"],
    "bench decode": ["bench", "decode", "--new-tokens", "3", "--repeats", "1", "--no-peer"],
    "bench spec": ["bench", "spec", "--new-tokens", "3", "--gammas", "1,2"],
    "roofline": ["roofline", "--batch-sizes", "1", "--prompt-lengths", "16"],
    "perplexity": ["perplexity", "--seqlen", "64", "--max-tokens", "200", "--quant", "rtn", "--group-size", "32"],
    "quantize": ["quantize", "--quant", "rtn", "--group-size", "32", "--out", "OUT/q.safetensors"],
    "quantize gguf": ["quantize", "--quant", "q8_0", "--out", "OUT/q.gguf"],
    "tour": ["tour", "--new-tokens", "3"],
    "distill-draft": ["distill-draft", "--layers", "1", "--steps", "2", "--out", "OUT/draft"],
    "fragmentation": ["fragmentation", "--out", "OUT"],
    "serve-bench": ["serve-bench", "--quick"],
    "bench quant": ["bench", "quant", "--quick", "--max-tokens", "600", "--calib-samples", "1", "--out",
                    "OUT/table.json"],
}


@pytest.mark.parametrize("name", COMMANDS)
def test_json_output_is_strict(tiny, tmp_path, name):
    args = [a.replace("OUT", str(tmp_path)) for a in COMMANDS[name]]
    if name != "fragmentation":  # the one command that loads no model
        args += ["--model", str(tiny)]
    p = run(*args, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    out = strict_json(p.stdout)
    assert isinstance(out, dict) and out
