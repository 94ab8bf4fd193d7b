"""The server against clients and operators that misbehave: a client that stops reading its stream, a second
Ctrl-C, `serve` options out of range, bodies that are not JSON in UTF-8. A tiny random model; real server
processes on 127.0.0.1 and a free port where signals or options are the point. Every wait is bounded."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from helpers import run_cli
from test_server import NUM_BLOCKS, free_port, sse_events
from test_server import one_thread, server, tiny, tiny_path  # noqa: F401  (the same fixtures: pytest finds them here)

from minillm import SamplingParams
from minillm.paged import LLMEngine
from minillm.server.loop import EngineLoop


# ---- a client that stops reading -------------------------------------------------------------------------
def test_a_stalled_reader_holds_one_queued_output_not_one_per_step(tiny):
    """Each step's output is cumulative; queued unread, 2 x 400 tokens would hold ~400 outputs of up to 800 ids."""
    engine = LLMEngine(*tiny, num_blocks=NUM_BLOCKS, max_num_seqs=4)
    loop = EngineLoop(engine).start()

    async def stalled():
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0, n=2)
        stream = loop.submit("stalled", {"prompt_token_ids": [5, 6, 7]}, params)
        await stream.accepted()
        most = 0
        deadline = time.monotonic() + 60
        while dict(loop.snapshot.finished).get("length", 0) < 1:  # never reading, while the engine runs it
            assert time.monotonic() < deadline, "the request did not finish"
            most = max(most, stream.queued)
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)  # the engine thread's last hand-over reaches this loop
        most = max(most, stream.queued)
        queued_ids = sum(len(c.token_ids) for item in stream._items for c in item.outputs)
        final = await stream.final()
        return most, queued_ids, final

    try:
        most, queued_ids, final = asyncio.run(stalled())
    finally:
        loop.stop()
    assert most == 1  # one output waits, whatever the reader's delay
    assert queued_ids == 800  # the finished output alone: memory linear in the output
    assert final.finished and [len(c.token_ids) for c in final.outputs] == [400, 400]


def test_a_client_that_leaves_a_stream_of_several_prompts_frees_every_block(server):
    body = {"prompt": ["hello", "the cat", "once upon"], "max_tokens": 900, "ignore_eos": True, "stream": True,
            "logprobs": 1}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        first = next(sse_events(r))
    assert json.loads(first)["choices"]
    free, total, unfinished = server.wait_all_free()
    assert free == total and not unfinished and server.loop.pending == 0


# ---- bodies -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}])
def test_a_body_without_a_json_content_type_gets_400_naming_the_header(server, headers):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = server.http.post(path, content=b'{"prompt": "hi", "max_tokens": 2}', headers=headers)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "Content-Type" in error["message"] and "application/json" in error["message"]
        assert error["code"] == "invalid_content_type"
    ok = server.http.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                          headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_a_body_that_is_not_utf8_gets_400_naming_the_encoding(server):
    r = server.http.post("/v1/completions", content=b'{"prompt": "hi\xff", "max_tokens": 2}',
                         headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "UTF-8" in error["message"] and "0xff" in error["message"] and error["code"] == "invalid_encoding"


# ---- serve's options (refusals in this process) and signals (in real processes) -------------------------------
def serve_args(tiny_path, *options):
    return ["serve", "--model", str(tiny_path), "--threads", "1", "--log-level", "warning", *options]


def serve_command(tiny_path, *options):
    return [sys.executable, "-m", "minillm", *serve_args(tiny_path, *options)]


@pytest.fixture
def refuse(tiny_path, monkeypatch):
    """``serve`` with these options in this process, where it must refuse before it listens: a server that
    starts fails the test instead of serving on."""
    import minillm.server.app as app

    def started(*args, **kwargs):
        raise AssertionError("the server started: the options were not refused")

    monkeypatch.setattr(app, "engine_server", started)
    return lambda *options: run_cli(*serve_args(tiny_path, *options))


@pytest.mark.parametrize("value", ["nan", "-5", "inf", "soon"])
def test_shutdown_timeout_must_be_finite_and_not_negative(refuse, value):
    out = refuse("--shutdown-timeout", value)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--shutdown-timeout" in out.stderr and value in out.stderr


@pytest.mark.parametrize("value, named", [("[1]", "--speculative-config"), ("{bad", "--speculative-config"),
                                          ('{"method": "nope"}', "method")])
def test_a_bad_speculative_config_is_refused_naming_it(refuse, value, named):
    out = refuse("--speculative-config", value, "--port", "0")
    assert out.returncode == 2, out.stderr[-2000:]
    assert named in out.stderr and "Traceback" not in out.stderr


def test_max_seq_len_past_the_models_context_is_refused_naming_it(refuse):
    out = refuse("--max-seq-len", "100000", "--port", "0")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--max-seq-len 100000" in out.stderr and "4096" in out.stderr and "Traceback" not in out.stderr


class ServerProcess:
    """``python -m minillm serve`` in a process; ``port`` from its --json line when started with --port 0."""

    def __init__(self, tiny_path, *options):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(serve_command(tiny_path, *options), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def wait_healthy(self, url, timeout=90):
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)

    def close(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate(timeout=10)[1]


def test_port_0_with_json_reports_the_port_it_bound(tiny_path):
    server = ServerProcess(tiny_path, "--port", "0", "--json")
    try:
        line = server.proc.stdout.readline()  # printed once the socket is bound
        info = json.loads(line)
        assert info["port"] > 0 and info["url"] == f"http://127.0.0.1:{info['port']}/v1"
        server.wait_healthy(f"http://127.0.0.1:{info['port']}")
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 0
    finally:
        err = server.close()
    assert "Traceback" not in err, err[-2000:]


def test_a_second_ctrl_c_ends_open_streams_as_the_first_would_in_one_line(tiny_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # a shutdown timeout the test would not wait for: only the second Ctrl-C can end the stream in time
    server = ServerProcess(tiny_path, "--port", str(port), "--shutdown-timeout", "300")
    got = []

    def stream():
        body = {"prompt": "hello", "max_tokens": 3900, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                got.extend(sse_events(r))
        except httpx.TransportError:
            got.append("cut")

    try:
        server.wait_healthy(url)
        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert server.proc.poll() is None and reader.is_alive()  # the first waits for the stream
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 0
        reader.join(10)
    finally:
        err = server.close()
    assert got[-1] == "[DONE]", got[-3:]
    assert "error" in json.loads(got[-2]) and "shutting down" in got[-2]
    assert err.count("second Ctrl-C") == 1, err[-2000:]
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-2000:]
