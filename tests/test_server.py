"""The OpenAI-compatible server (minillm.server): what the openai client and raw HTTP see, against a server
started here on 127.0.0.1 and a free port. A tiny random model where the text does not matter; the
embedded model (slow) where it does. Every wait is bounded."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from helpers import CHATML, TINY, write_tiny_gguf
from prometheus_client.parser import text_string_to_metric_families

from minillm import LLM, SamplingParams, load_model
from minillm.paged import LLMEngine
from minillm.server.app import ServerThread, create_app
from minillm.server.loop import EngineLoop

PROMPTS = ["hello there", "the cat sat on", "a b c d e", "once upon a time"]
NUM_BLOCKS = 64  # x 16 tokens: a pool smaller than the tiny model's context of 4096


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the engine and the HTTP threads share 2 cores here (a tiny step then takes ~3 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("server") / "tiny.gguf"
    write_tiny_gguf(path, cfg=dict(TINY, ctx=4096), chat_template=CHATML)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_model(tiny_path)


class Served:
    """A running server: its url, its engine loop, an openai client and an httpx client."""

    def __init__(self, thread, loop):
        self.thread, self.loop, self.url = thread, loop, thread.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def engine(self, fn, timeout=10):
        """fn(engine) on the engine thread."""
        return self.loop.call(fn).result(timeout)

    def wait_all_free(self, timeout=10.0):
        """Every block free and nothing unfinished, within ``timeout`` seconds; returns the last reading."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.engine(lambda e: (e.manager.num_free_blocks, e.num_blocks, e.has_unfinished_requests()))
            if (state[0] == state[1] and not state[2]) or time.monotonic() > deadline:
                return state
            time.sleep(0.02)

    def finished(self, reason):
        return dict(self.loop.snapshot.finished).get(reason, 0)


def serve(model, tokenizer, name="tiny", max_queue=64, engine_cls=LLMEngine, **engine_kwargs):
    engine_kwargs = {"num_blocks": NUM_BLOCKS, "max_num_seqs": 16, **engine_kwargs}
    engine = engine_cls(model, tokenizer, **engine_kwargs)
    loop = EngineLoop(engine, max_pending=engine_kwargs["max_num_seqs"] + max_queue)
    return ServerThread(create_app(loop, name)), loop


@pytest.fixture(scope="module")
def server(tiny):
    thread, loop = serve(*tiny)
    with thread:
        served = Served(thread, loop)
        yield served
        served.http.close()


def long_request(**kw):
    return {"model": "tiny", "prompt": "hello", "max_tokens": 900, "ignore_eos": True, "temperature": 0, **kw}


def sse_events(response):
    """The data fields of a server-sent event stream, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


# ---- what a client gets --------------------------------------------------------------------------
def test_greedy_completions_over_http_equal_llm_generate_and_streams_add_up(server, tiny):
    model, tok = tiny
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = LLM(model, tokenizer=tok, num_blocks=NUM_BLOCKS).generate(PROMPTS, params, use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected):
        got = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.outputs[0].text
        assert got.choices[0].finish_reason == want.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
        stream = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                  stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == got.choices[0].text
        assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason
    with server.http.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 5, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
        events = list(sse_events(r))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] <= 5
    assert json.loads(events[-3])["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_completions_use_the_chat_template(server, tiny):
    model, tok = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    want = LLM(model, tokenizer=tok, num_blocks=NUM_BLOCKS).chat(messages, SamplingParams(max_tokens=10, temperature=0),
                                                                  use_tqdm=False)[0]
    got = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(tok.apply_chat_template(messages))
    chunks = list(server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                                        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == got.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_n_seed_and_stop(server):
    a = server.client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=1.0, seed=3, n=2)
    b = server.client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=1.0, seed=3, n=2)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: the same samples
    full = server.client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0).choices[0].text
    stop = full[3:5]
    cut = server.client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = server.client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0,
                                                stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text  # no part of the stop string shown


def test_stop_token_ids_end_a_choice_as_eos_does(server, tiny):
    """vLLM's ``stop_token_ids`` extension: the choice ends at the first listed id, its text decoded
    without it, finish_reason "stop"."""
    ids = LLM(tiny[0], tokenizer=tiny[1]).generate(["hello"], SamplingParams(temperature=0, max_tokens=12),
                                                   use_tqdm=False)[0].outputs[0].token_ids
    stop_id = ids[4]
    cut = ids[:ids.index(stop_id)]
    got = server.client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0,
                                           extra_body={"stop_token_ids": [stop_id]}).choices[0]
    assert got.text == tiny[1].decode(cut) and got.finish_reason == "stop"
    r = server.http.post("/v1/completions", json={"prompt": "hi", "stop_token_ids": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


def test_models_health_and_metrics(server):
    assert server.http.get("/health").json() == {"status": "ok"}
    assert [m["id"] for m in server.http.get("/v1/models").json()["data"]] == ["tiny"]

    def read():
        text = server.http.get("/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    long_prompt = "abcdefghij" * 4  # 40 byte tokens: two full blocks for the prefix cache
    server.client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2)
    before = read()
    server.client.completions.create(model="tiny", prompt=long_prompt, max_tokens=7, temperature=0,
                                     extra_body={"ignore_eos": True})
    after = read()
    for name in ("minillm:num_requests_running", "minillm:num_requests_waiting", "minillm:kv_cache_usage_perc",
                 "minillm:num_kv_blocks_used", "minillm:prefix_cache_hit_rate", "minillm:prefix_cache_queries_total",
                 "minillm:prefix_cache_hits_total", "minillm:time_to_first_token_seconds_count"):
        assert name in after
    assert after["minillm:generation_tokens_total"] - before["minillm:generation_tokens_total"] == 7
    assert after["minillm:num_kv_blocks_total"] == NUM_BLOCKS
    assert after["minillm:prefix_cache_hits_total"] - before["minillm:prefix_cache_hits_total"] == 32


def test_concurrent_streams_run_in_the_same_engine_steps(server):
    ids = [None] * 4

    def stream(i):
        for c in server.client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=150, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True}):
            ids[i] = c.id

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(ids)
    together = server.engine(lambda e: max(len(set(ids) & {run[0] for run in rec.runs}) for rec in e.stats.records))
    assert together == 4


# ---- clients that leave ----------------------------------------------------------------------------
def test_a_client_killed_mid_stream_frees_every_block(server):
    aborted = server.finished("abort")
    with server.http.stream("POST", "/v1/completions", json=long_request(stream=True)) as r:
        events = sse_events(r)
        for _ in range(3):
            assert json.loads(next(events))["choices"][0]["finish_reason"] is None
    # leaving the block closes the connection mid-stream
    free, total, unfinished = server.wait_all_free()
    assert free == total and not unfinished
    assert server.finished("abort") == aborted + 1
    assert server.loop.pending == 0


def test_a_dropped_non_streaming_request_frees_every_block(server):
    aborted = server.finished("abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=long_request(), timeout=0.5)
    free, total, unfinished = server.wait_all_free()
    assert free == total and not unfinished
    assert server.finished("abort") == aborted + 1


# ---- refusals ----------------------------------------------------------------------------------------
BAD = [  # (path, body, status, the field the message names, code)
    ("/v1/completions", "{not json", 400, None, "invalid_json"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": "tiny", "max_tokens": 4}, 400, "prompt", None),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "seed": -5}, 400, "seed", None),
    ("/v1/completions", {"prompt": "hi", "stop": [3]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": [5, 99999]}, 400, "prompt", None),  # refused by the engine's add_request
    ("/v1/completions", {"prompt": [[5, 6] * 100, [5, 99999]], "max_tokens": 500}, 400, "prompt", None),  # the first
    # was running when the second was refused: it is aborted (every block free at the end)
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2000}, 400, "max_tokens", None),  # past the KV pool
    ("/v1/completions", {"prompt": [5] * 1100}, 400, "prompt", None),  # the prompt alone past the KV pool
    ("/v1/completions", '{"prompt": "hi \\ud83d"}', 400, "prompt", None),  # valid JSON, a lone surrogate
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", None),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}, 400, "response_format", None),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, 400, "stop", None),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 1001]}, 400, "stop", None),
]


def test_bad_requests_get_4xx_naming_the_field_and_disturb_nothing(server):
    result = {}
    background = threading.Thread(target=lambda: result.setdefault("out", server.client.completions.create(
        model="tiny", prompt="hello", max_tokens=300, temperature=0, extra_body={"ignore_eos": True})))
    background.start()
    for path, body, status, param, code in BAD:
        content = body if isinstance(body, str) else json.dumps(body)
        r = server.http.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param and error["code"] == code, (body, error)
        if param:
            assert param in error["message"]
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="hi")
    background.join(60)
    assert result["out"].usage.completion_tokens == 300  # the request running meanwhile, in full
    assert server.client.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens <= 3
    free, total, _ = server.wait_all_free()
    assert free == total and server.loop.pending == 0


def test_null_is_the_default_where_openai_allows_null(server):
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, "presence_penalty": None, "frequency_penalty": None,
            "stream": None, "echo": None, "ignore_eos": None, "suffix": None, "tools": None, "repetition_penalty": 1.0,
            "min_p": 0, "response_format": {"type": "text"}}  # neutral values some clients always send
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == server.client.completions.create(
        model="tiny", prompt="hi", max_tokens=2, temperature=0).choices[0].text


def test_wrongly_typed_fields_are_refused_not_coerced(server):
    """As OpenAI's API: true is not 1, 1.0 not 1, "12" not 12, "yes" not true; an integer is a number though."""
    wrong = [("/v1/completions", {"n": True}, "n", "integer"), ("/v1/completions", {"n": 1.0}, "n", "integer"),
             ("/v1/completions", {"max_tokens": "12"}, "max_tokens", "integer"),
             ("/v1/completions", {"temperature": "0.5"}, "temperature", "number"),
             ("/v1/completions", {"stream": "yes"}, "stream", "boolean"),
             ("/v1/completions", {"ignore_eos": 1}, "ignore_eos", "boolean"),
             ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options",
              "boolean"),
             ("/v1/chat/completions", {"max_completion_tokens": "5"}, "max_completion_tokens", "integer"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages", "string")]
    for path, fields, param, kind in wrong:
        body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
        r = server.http.post(path, json={**body, "max_tokens": 2, **fields})
        assert r.status_code == 400, (fields, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (fields, error)
        assert error["message"].startswith(param) and f"valid {kind}" in error["message"], (fields, error)
    ints = server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0, "top_p": 1,
                                                      "presence_penalty": 0})
    floats = server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0.0,
                                                        "top_p": 1.0, "presence_penalty": 0.0})
    assert ints.status_code == 200, ints.text
    assert ints.json()["choices"][0]["text"] == floats.json()["choices"][0]["text"]


class ThreadRecordingTokenizer:
    """The real tokenizer, noting the thread that tokenizes each prompt."""

    def __init__(self, tokenizer):
        self.tokenizer, self.threads = tokenizer, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, text, allow_special=False):
        self.threads.append(threading.current_thread())
        return self.tokenizer.encode(text, allow_special)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        self.threads.append(threading.current_thread())
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)


def test_prompts_are_tokenized_off_the_event_loop(tiny):
    """A long prompt takes long to tokenize (20 MB: over a second); on the event loop's thread it would stall
    every other client's stream meanwhile."""
    model, tok = tiny
    recording = ThreadRecordingTokenizer(tok)
    thread, loop = serve(model, recording)
    with thread:
        served = Served(thread, loop)
        got = served.client.completions.create(model="tiny", prompt="hello there", max_tokens=2)
        assert got.usage.prompt_tokens == len(tok.encode("hello there"))
        messages = [{"role": "user", "content": "hi"}]
        got = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        assert got.usage.prompt_tokens == len(tok.apply_chat_template(messages))
        served.http.close()
    assert len(recording.threads) >= 2
    assert thread.thread not in recording.threads  # uvicorn runs its event loop on the server's thread


def test_past_the_queue_bound_new_requests_get_503(tiny):
    thread, loop = serve(*tiny, max_queue=1, max_num_seqs=2)  # at most 3 unfinished requests
    with thread, httpx.Client(base_url=thread.url, timeout=30) as http:
        served = Served(thread, loop)
        streams = [http.stream("POST", "/v1/completions", json=long_request(stream=True)) for _ in range(3)]
        responses = [s.__enter__() for s in streams]
        assert [r.status_code for r in responses] == [200] * 3
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        assert "retry" in r.json()["error"]["message"]
        for s in streams:
            s.__exit__(None, None, None)
        assert served.wait_all_free()[0] == NUM_BLOCKS
        deadline = time.monotonic() + 10
        while loop.pending and time.monotonic() < deadline:
            time.sleep(0.02)
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


class FlakyEngine(LLMEngine):
    """An engine whose next step raises when told to (before it touches anything)."""

    fail_next = False

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        return super().step()


def test_a_failed_step_reaches_its_clients_and_the_loop_goes_on(tiny):
    thread, loop = serve(*tiny, engine_cls=FlakyEngine)
    with thread:
        served = Served(thread, loop)
        got = {}

        def plain():
            got["plain"] = httpx.post(thread.url + "/v1/completions", json=long_request(), timeout=60)

        def streamed():
            with httpx.stream("POST", thread.url + "/v1/completions", json=long_request(stream=True), timeout=60) as r:
                got["stream"] = list(sse_events(r))

        workers = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 10
        while loop.snapshot.num_requests_running < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        served.engine(lambda e: setattr(e, "fail_next", True))
        for w in workers:
            w.join(30)
        assert got["plain"].status_code == 500
        assert "injected failure" in got["plain"].json()["error"]["message"]
        assert got["stream"][-1] == "[DONE]" and "injected failure" in json.loads(got["stream"][-2])["error"]["message"]
        with pytest.raises(openai.APIError):  # the openai client raises on the error event
            for i, _ in enumerate(served.client.completions.create(model="tiny", prompt="x", max_tokens=500,
                                                                   stream=True, extra_body={"ignore_eos": True})):
                if i == 0:
                    served.engine(lambda e: setattr(e, "fail_next", True))
        assert served.client.completions.create(model="tiny", prompt="hi", max_tokens=4,
                                                extra_body={"ignore_eos": True}).usage.completion_tokens == 4
        assert served.wait_all_free()[0] == NUM_BLOCKS
        assert loop.snapshot.step_failures == 2


# ---- load ----------------------------------------------------------------------------------------------
def test_load_32_clients_x_8_requests_mixed_and_cancelled(server):
    """Every request not cancelled is answered in full; at the end every block is free."""
    clients, each = 32, 8
    outcome = {"full": 0, "cancelled": 0, "short": []}

    async def one(http, c, k):
        max_tokens = 4 + (c * 7 + k * 3) % 20
        body = {"prompt": PROMPTS[(c + k) % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        cancel = (c + k) % 5 == 0
        if (c + k) % 2:  # streamed
            body.update(stream=True, stream_options={"include_usage": True})
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                usage = None
                async for line in r.aiter_lines():
                    if cancel:  # leave after the first event
                        outcome["cancelled"] += 1
                        return
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage") or usage
            tokens = usage["completion_tokens"]
        else:
            if cancel:
                with pytest.raises(httpx.TimeoutException):
                    await http.post("/v1/completions", json=body, timeout=0.001)
                outcome["cancelled"] += 1
                return
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200
            tokens = r.json()["usage"]["completion_tokens"]
        if tokens == max_tokens:
            outcome["full"] += 1
        else:
            outcome["short"].append((tokens, max_tokens))

    async def client(http, c):
        for k in range(each):
            await one(http, c, k)

    async def main():
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            await asyncio.wait_for(asyncio.gather(*(client(http, c) for c in range(clients))), 240)

    asyncio.run(main())
    assert outcome["short"] == []
    assert outcome["full"] + outcome["cancelled"] == clients * each and outcome["cancelled"] > 0
    free, total, unfinished = server.wait_all_free()
    assert free == total and not unfinished and server.loop.pending == 0


# ---- the command -----------------------------------------------------------------------------------------
def test_import_minillm_does_not_import_the_server_stack():
    code = "import sys, minillm, minillm.cli; print(sorted(m for m in ('fastapi', 'uvicorn', 'openai') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_port_already_in_use_is_a_failure_that_says_so(tiny_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "minillm", "serve", "--model", str(tiny_path), "--port", str(port),
                              "--threads", "1", "--log-level", "warning"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"could not start on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr
    assert "server stopped" not in out.stderr


def test_sigterm_finishes_what_it_can_aborts_the_rest_and_exits_cleanly(tiny_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", str(tiny_path), "--port", str(port),
                             "--threads", "1", "--shutdown-timeout", "3", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.2)
        got = {}

        def stream(name, max_tokens):
            body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    for event in sse_events(r):
                        got.setdefault(name, []).append(event)
            except httpx.TransportError:
                got.setdefault(name, []).append("cut")

        whole = {}

        def whole_answer():  # not streamed: the abort is a 500 in OpenAI's shape, not a cancelled handler
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3900, "ignore_eos": True},
                           timeout=60)
            whole.update(status=r.status_code, body=r.json())

        short = threading.Thread(target=stream, args=("short", 40))
        long = threading.Thread(target=stream, args=("long", 3900))
        waiting = threading.Thread(target=whole_answer)
        long.start()
        waiting.start()
        while not got.get("long") and time.monotonic() < deadline:
            time.sleep(0.01)
        short.start()
        while not got.get("short") and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for t in (short, long, waiting):
            t.join(10)
        assert got["short"][-1] == "[DONE]"  # finished within the shutdown timeout
        assert got["long"][-1] == "[DONE]" and "error" in got["long"][-2]  # aborted, and told so
        assert whole["status"] == 500 and "shutting down" in whole["body"]["error"]["message"]
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=10)
    assert "Traceback" not in err, err[-2000:]


# ---- the embedded model -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_embedded_model_over_http_equals_llm(model_and_tokenizer):
    model, tok = model_and_tokenizer
    prompts = ["The capital of France is", "def fibonacci(n):"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=24, temperature=0)
    llm = LLM(model, tokenizer=tok, num_blocks=128)
    want = llm.generate(prompts, params, use_tqdm=False)
    want_chat = llm.chat(messages, params, use_tqdm=False)[0]
    thread, loop = serve(model, tok, name="smollm2", num_blocks=128)
    with thread:
        served = Served(thread, loop)
        for prompt, w in zip(prompts, want):
            got = served.client.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0)
            assert got.choices[0].text == w.outputs[0].text
            parts = served.client.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0,
                                                     stream=True)
            assert "".join(c.choices[0].text for c in parts) == w.outputs[0].text
        got = served.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
        assert got.choices[0].message.content == want_chat.outputs[0].text
        assert "Paris" in got.choices[0].message.content
        parts = served.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0,
                                                      stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in parts) == want_chat.outputs[0].text
        assert served.wait_all_free()[0] == 128
