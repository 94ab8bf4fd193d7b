"""The real clients against ``python -m minillm serve``: lm-eval's ``local-completions`` and guidellm.

Both need the tools of requirements-tools.txt (``make setup`` installs them) and a folder written by
``python -m minillm export-hf --weights``: lm-eval's ``hf`` backend loads the model from it, and both tools read
its tokenizer. Everything runs offline, on 127.0.0.1, with a time limit on every process.

- lm-eval scores the small local task of ``tools.lm_eval_task`` twice, through the server and with transformers
  on the folder; every choice's log-likelihood agrees within 1e-3, so the two scores are equal.
- guidellm sends a fixed count of requests at two concurrencies: none fails, and its prompt and output token
  counts are the server's (``usage`` and the counters of ``/metrics``).
"""

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from minillm.formats.hf_export import export_hf
from tools.lm_eval_task import TASK, write_task

TOOLS = "pip install -r requirements-tools.txt (make setup does)"
pytest.importorskip("lm_eval", reason=f"lm-eval is not installed: {TOOLS}")
pytest.importorskip("guidellm", reason=f"guidellm is not installed: {TOOLS}")
pytestmark = pytest.mark.slow

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
ITEMS = 8
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS, STREAMS = 20, 48, 8, (1, 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, tmp_path, timeout, name):
    """Run a tool with a time limit; its output goes to a log that a failure shows."""
    log = tmp_path / f"{name}.log"
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=tmp_path)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{text[-4000:]}"
    return text


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return export_hf(tmp_path_factory.mktemp("export") / "smollm2", weights=True)


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    """``python -m minillm serve`` on a free port, serving the model under the folder's path (the name the
    tools send); stopped by SIGTERM, as a person's Ctrl-C would."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "serve.log"
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--port", str(port), "--served-model-name",
                             str(folder), "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            assert proc.poll() is None, f"the server exited {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the server did not answer /health in 300 s:\n{log.read_text()[-4000:]}"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


def samples(output_path) -> dict[int, list[float]]:
    """lm-eval's --log_samples: {doc id: each choice's log-likelihood}."""
    (path,) = glob.glob(str(output_path / "*" / f"samples_{TASK}_*.jsonl"))
    out = {}
    for line in open(path):
        row = json.loads(line)
        out[int(row["doc_id"])] = [float(resp[0]) for resp in row["filtered_resps"]]
    return out


def scores(output_path) -> dict[str, float]:
    (path,) = glob.glob(str(output_path / "*" / "results_*.json"))
    result = json.load(open(path))["results"][TASK]
    return {k.split(",")[0]: v for k, v in result.items() if k in ("acc,none", "acc_norm,none")}


def test_lm_eval_through_the_server_scores_as_transformers_on_the_folder(folder, server, tmp_path):
    task_dir = write_task(tmp_path / "task", n=ITEMS).parent
    common = ["--include_path", str(task_dir), "--tasks", TASK, "--batch_size", "4", "--log_samples"]
    base = [sys.executable, "-m", "lm_eval", "run"]
    served = run(base + ["--model", "local-completions", "--model_args",
                         f"model={folder},base_url={server}/v1/completions,tokenizer_backend=huggingface,"
                         f"tokenizer={folder},num_concurrent=1,max_retries=1",
                         "--output_path", str(tmp_path / "served")] + common, tmp_path, 600, "lm_eval_served")
    run(base + ["--model", "hf", "--model_args", f"pretrained={folder},dtype=float32", "--device", "cpu",
                "--output_path", str(tmp_path / "hf")] + common, tmp_path, 600, "lm_eval_hf")
    ours, theirs = samples(tmp_path / "served"), samples(tmp_path / "hf")
    assert sorted(ours) == sorted(theirs) == list(range(ITEMS))
    diffs = [abs(a - b) for i in ours for a, b in zip(ours[i], theirs[i], strict=True)]
    assert len(diffs) == 4 * ITEMS and max(diffs) < 1e-3, max(diffs)
    assert scores(tmp_path / "served") == scores(tmp_path / "hf")
    assert "Traceback" not in served


# guidellm's text helpers import ftfy, whose codecs ("sloppy-windows-1252") an installed package, future_typing,
# shadows: its .pth registers a codec search function that answers every encoding name. It answers none here.
GUIDELLM_MAIN = """
import sys, types
try:
    import future_typing.codec
    future_typing.codec.codecs = types.SimpleNamespace(CodecInfo=lambda **kwargs: None)
except ImportError:
    pass
if __name__ == "__main__":  # guidellm's workers are spawned processes, which import this file again
    from guidellm.__main__ import cli
    sys.argv[0] = "guidellm"
    cli()
"""


def counters(url) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {name: float(v) for name, v in re.findall(r"^minillm:(prompt_tokens_total|generation_tokens_total)"
                                                      r"\{[^}]*\} (\S+)$", text, re.M)}


def test_guidellm_counts_the_servers_tokens_and_no_request_fails(folder, server, tmp_path):
    scenario = {
        "metadata": {"name": "minillm", "description": "minillm's server, synthetic prompts"},
        "spec": {
            "backend": {"kind": "openai_http", "target": server, "model": str(folder),
                        "request_format": "/v1/completions", "timeout": 300},
            "tokenizer": {"kind": "huggingface_auto", "model": str(folder)},
            "profile": {"kind": "concurrent", "streams": [STREAMS[0]]},
            "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}],
            "constraints": [{"kind": "max_requests", "count": REQUESTS}, {"kind": "max_errors", "count": 1}],
            "outputs": [{"kind": "console"}, {"kind": "json", "path": str(tmp_path / "benchmarks.json")}],
        },
        "benchmarks": [{"profile.streams": n} for n in STREAMS],
    }
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    (tmp_path / "guidellm_main.py").write_text(GUIDELLM_MAIN)
    before = counters(server)
    run([sys.executable, str(tmp_path / "guidellm_main.py"), "run", "-c", str(tmp_path / "scenario.json"),
         "--disable-progress"], tmp_path, 600, "guidellm")
    after = counters(server)
    report = json.loads((tmp_path / "benchmarks.json").read_text())
    assert [b["config"]["strategy"]["streams"] for b in report["benchmarks"]] == list(STREAMS)
    prompt = output = 0
    for bench in report["benchmarks"]:
        requests = bench["requests"]
        assert (len(requests["successful"]), len(requests["errored"]), len(requests["incomplete"])) == (REQUESTS, 0, 0)
        for r in requests["successful"]:
            # guidellm made each prompt PROMPT_TOKENS long with the folder's tokenizer; the server counted as many
            assert (r["prompt_tokens"], r["output_tokens"]) == (PROMPT_TOKENS, OUTPUT_TOKENS)
            prompt, output = prompt + r["prompt_tokens"], output + r["output_tokens"]
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == prompt
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == output
