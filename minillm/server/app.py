"""The HTTP routes: an OpenAI-compatible server over one engine thread (FastAPI, served by uvicorn).

``POST /v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or one JSON body),
``POST /tokenize`` and ``/detokenize``, ``GET /tokenizer_info``, ``/v1/models``, ``/health`` and ``/metrics``.
A handler checks the request, tokenizes it on a worker thread (never on the event loop, which relays every
stream), hands each of its prompts to the engine thread (``loop.EngineLoop``) as one engine request and relays
what comes back; every connection's requests meet in the engine's steps (continuous batching, Kwon et al.
2023, Sec. 4.5). Log-probabilities are computed on the engine thread too, between steps (``logprobs.Scorer``).
A client that goes away, with a stream open or while waiting for a whole response, aborts its requests, which
frees their blocks before the next step. Refusals carry OpenAI's error body with a 4xx (503 when the queue is
full).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .logprobs import Scorer, chat_logprobs, completion_logprobs
from .loop import EngineLoop, Overloaded, RequestFailed, RequestRefused, RequestStream
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LogprobsWanted,
                       TextStream, TokenizeRequest, brief, chat_prompt, choice, chunk, chunk_choice,
                       completion_prompts, completion_response, detokenize_response, error_body, logprobs_wanted,
                       new_id, param_of, sampling_params, tokenize_response, tokenizer_info_response, usage)
from .relay import Scored, merged, scoring


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs ``on_close`` however it ends: finished, failed, or the client gone
    (Starlette then cancels the body and returns)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def create_app(loop: EngineLoop, model_name: str, metrics: ServerMetrics | None = None,
               stop_loop_on_shutdown: bool = True) -> FastAPI:
    """The app over a started or unstarted ``EngineLoop`` (started in the app's lifespan if needed, and
    stopped when the server shuts down, after uvicorn has let running requests finish or cancelled them).

    ``model_name``: what /v1/models lists and requests must name (or leave out).
    """
    metrics = metrics or ServerMetrics(model_name)
    if loop.on_finish is None:
        loop.on_finish = metrics.observe
    metrics.attach(loop)
    pool_tokens = loop.num_blocks * loop.block_size

    @asynccontextmanager
    async def lifespan(app):
        if not loop.started:
            loop.start()
        yield
        if stop_loop_on_shutdown:
            await asyncio.get_running_loop().run_in_executor(None, loop.stop)

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.loop, app.state.metrics = loop, metrics

    # ---- errors in OpenAI's shape ------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            message = f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"
            return JSONResponse(error_body(400, message, None, "invalid_json"), status_code=400)
        param = loc[0] if loc else None
        where = ".".join(loc) if loc else "body"
        return JSONResponse(error_body(400, f"{where}: {err.get('msg')} (got {brief(err.get('input'))})", param),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body", for bytes not UTF-8
            bad = exc.__cause__
            message = (f"body: is not valid UTF-8 (byte 0x{bad.object[bad.start:bad.start + 1].hex()} at offset "
                       f"{bad.start}); send the JSON encoded as UTF-8")
            return JSONResponse(error_body(400, message, None, "invalid_encoding"), status_code=400)
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    app.add_middleware(JSONBodiesOnly)

    # ---- routes ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not loop.running:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "minillm",
                                            "max_model_len": loop.max_seq_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check_model(req.model, model_name)
        # tokenizing is work in proportion to the prompt (a 20 MB prompt takes over a second): on a worker thread,
        # the event loop keeps relaying every other client's stream meanwhile
        prompts = await asyncio.to_thread(completion_prompts, req, loop.tokenizer)
        return await _serve(request, req, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        _check_model(req.model, model_name)
        prompt = await asyncio.to_thread(chat_prompt, req, loop.tokenizer)  # off the event loop, as above
        return await _serve(request, req, [prompt], chat=True)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        _check_model(req.model, model_name)
        return await asyncio.to_thread(tokenize_response, req, loop.tokenizer, loop.max_seq_len)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        _check_model(req.model, model_name)
        return await asyncio.to_thread(detokenize_response, req, loop.tokenizer, loop.vocab_size)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenizer_info_response(loop.tokenizer, loop.max_seq_len)

    async def _serve(request: Request, req, prompts: list[tuple[str | None, list[int]]], chat: bool):
        wanted = logprobs_wanted(req, loop.tokenizer is not None)
        params = [sampling_params(req, len(ids), loop.max_seq_len, pool_tokens, wanted.echo) for _, ids in prompts]
        rid = new_id("chatcmpl" if chat else "cmpl")
        streams = await _submit(rid, prompts, params)  # None: a prompt scored only (max_tokens 0)
        live = [s for s in streams if s is not None]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = include_usage and req.stream_options.continuous_usage_stats
            events = _events(live, prompts, rid, params, req.n or 1, chat, wanted, include_usage, continuous)
            return EngineStreamingResponse(events, lambda: _close(live))
        try:
            finals = await _unless_disconnected(request, asyncio.gather(*(s.final() for s in live)))
        except RequestFailed as e:
            raise APIError(500, str(e)) from None
        finally:
            _close(live)
        if finals is None:  # the client left; nobody reads this
            return Response(status_code=499)
        finals = iter(finals)
        outs = [next(finals) if s is not None else Scored(ids, req.n or 1) for s, (_, ids) in zip(streams, prompts)]
        choices = []
        for p, ((text, ids), out) in enumerate(zip(prompts, outs)):
            for c in out.outputs:
                choices.append(await _choice(p * (req.n or 1) + c.index, text, ids, c, chat, wanted))
        return completion_response(rid, model_name, choices, usage(outs), chat)

    async def _submit(rid: str, prompts, params) -> list[RequestStream | None]:
        """Hand every prompt to the engine at once (one engine request each, admitted in the same step), then wait
        for the verdicts; if one is refused, the others are aborted and the first refusal is raised."""
        streams = []
        try:
            for p, ((text, ids), par) in enumerate(zip(prompts, params)):
                sub = rid if len(prompts) == 1 else f"{rid}-{p}"
                streams.append(None if par is None else loop.submit(sub, {"prompt_token_ids": ids, "prompt": text},
                                                                    par))
            live = [s for s in streams if s is not None]
            verdicts = await asyncio.gather(*(s.accepted() for s in live), return_exceptions=True)
        except Overloaded as e:
            _close(streams)
            metrics.rejected.labels(model_name).inc()
            raise APIError(503, str(e)) from None
        except BaseException:
            _close(streams)
            raise
        error = next((v for v in verdicts if isinstance(v, BaseException)), None)
        if error is not None:
            _close(streams)
            if isinstance(error, RequestRefused):
                raise APIError(400, str(error), param_of(str(error))) from None
            if isinstance(error, RequestFailed):
                raise APIError(503, str(error)) from None
            raise error
        return streams

    async def _on_engine(fn):
        """``fn(engine)`` on the engine thread, between steps (the one thread that runs the model)."""
        if not loop.running:
            raise RequestFailed("the server is shutting down")
        future = loop.call(fn)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancelled():  # the loop stopped before it ran
                raise RequestFailed("the server is shutting down") from None
            raise

    async def _choice(index: int, text, ids: list[int], c, chat: bool, wanted: LogprobsWanted) -> dict:
        """One whole choice: its text (after the prompt's, with echo) and its logprobs."""
        prompt_text = (text if text is not None else loop.tokenizer.decode(ids)) if wanted.echo else ""
        logprobs = None
        if wanted.top is not None:
            def score(engine):
                scorer = Scorer(engine.model, len(ids) + len(c.token_ids), wanted.top)
                return scorer.extend(ids, want=wanted.echo), scorer.extend(c.token_ids)

            try:
                prompt_entries, entries = await _on_engine(score)
            except RequestFailed as e:
                raise APIError(500, str(e)) from None
            if chat:
                logprobs = chat_logprobs(loop.tokenizer, c.token_ids, entries, wanted.top)
            else:
                scored = (ids if wanted.echo else []) + c.token_ids
                logprobs = completion_logprobs(loop.tokenizer, scored, prompt_entries + entries, wanted.top)
        return choice(index, prompt_text + c.text, c.finish_reason, c.stop_reason, chat, logprobs)

    async def _events(streams, prompts, rid: str, params, n: int, chat: bool, wanted: LogprobsWanted,
                      include_usage: bool, continuous: bool):
        created = int(time.time())
        keys = [(p, i) for p in range(len(prompts)) for i in range(n)]
        texts = {key: TextStream(params[key[0]].stop) for key in keys}
        scored = dict.fromkeys(keys, 0)  # tokens whose logprobs were sent
        offsets = dict.fromkeys(keys, 0)  # text_offset of the next token
        scorers = {}
        done: set[tuple[int, int]] = set()
        last = {}
        try:
            if chat:  # the first chunk gives the role, as OpenAI's does
                yield _sse(chunk(rid, model_name, created, [chunk_choice(i, "", None, True, first=True)
                                                            for i in range(n)], True))
            async for p, out in merged(streams):
                last[p] = out
                choices = []
                for c in out.outputs:
                    key = (p, c.index)
                    if key in done:
                        continue
                    finished = c.finish_reason is not None
                    delta = texts[key].delta(c.text, finished)
                    logprobs, new = None, c.token_ids[scored[key]:]
                    if wanted.top is not None and new:
                        entries = await _on_engine(scoring(scorers, key, prompts[p][1], params[p], new, wanted.top))
                        scored[key] += len(new)
                        if chat:
                            logprobs = chat_logprobs(loop.tokenizer, new, entries, wanted.top)
                        else:
                            logprobs = completion_logprobs(loop.tokenizer, new, entries, wanted.top, offsets[key])
                            offsets[key] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    if delta or finished or logprobs:
                        choices.append(chunk_choice(p * n + c.index, delta, c.finish_reason, chat, logprobs=logprobs))
                    if finished:
                        done.add(key)
                        scorers.pop(key, None)  # its KV cache goes with it
                if choices:
                    yield _sse(chunk(rid, model_name, created, choices, chat, usage([out]) if continuous else None))
            if include_usage and last:
                yield _sse(chunk(rid, model_name, created, [], chat, usage(list(last.values()))))
        except RequestFailed as e:
            yield _sse(error_body(500, str(e)))
        yield "data: [DONE]\n\n"

    return app


class JSONBodiesOnly:
    """ASGI middleware: a POST whose Content-Type is not JSON gets a 400 naming the header (FastAPI would read
    its body as bytes and answer that the body is not an object, which does not say what to change)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            given = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
            kind = given.split(";", 1)[0].strip().lower()
            if not (kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))):
                message = ((f"Content-Type: got {given!r}" if given else "Content-Type: the header is missing")
                           + "; send the body as JSON with the header Content-Type: application/json")
                response = JSONResponse(error_body(400, message, None, "invalid_content_type"), status_code=400)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _close(streams) -> None:
    for stream in streams:
        if stream is not None:
            stream.close()


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise APIError(404, f"model: {name!r} is not served here; this server serves {served!r} (GET /v1/models)",
                       "model", "model_not_found")


async def _unless_disconnected(request: Request, work):
    """``await work``, unless the client disconnects first (then None; the work is cancelled). After the
    body is read, the ASGI receive channel yields only ``http.disconnect``, which is what is awaited."""
    task = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        finished, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task in finished else None


#: seconds uvicorn's own shutdown timeout leaves after the engine's: its abort lands first and every response ends
#: in OpenAI's shape; uvicorn cancels only a handler that still has not returned by then
SHUTDOWN_GRACE = 5.0


def engine_server(config, loop: EngineLoop, shutdown_timeout: float | None, on_started=None):
    """uvicorn's server for ``config``, whose graceful shutdown ends the engine's requests itself: ``shutdown_timeout``
    seconds after Ctrl-C / SIGTERM the engine loop aborts what is still running (a 500 in OpenAI's shape, or a final
    error event and [DONE] on a stream), before uvicorn's timeout would cancel the handlers (a traceback each, a
    plain-text 500, a stream cut mid-body). None: wait for every request. A second Ctrl-C aborts them at once, the
    same way (uvicorn's own answer to it, a forced exit, cuts every stream mid-body and closes the event loop
    under the engine thread); a third is uvicorn's forced exit. ``on_started(port)``: called once the socket is bound, with the port it got.

    Raises:
        ValueError: ``shutdown_timeout`` negative or not finite.
    """
    import signal
    import sys

    import uvicorn

    if shutdown_timeout is not None and not (math.isfinite(shutdown_timeout) and shutdown_timeout >= 0):
        raise ValueError(f"shutdown_timeout: must be a finite number of seconds >= 0, got {shutdown_timeout!r}")

    class EngineServer(uvicorn.Server):
        abort_now: asyncio.Event | None = None
        event_loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets=None):
            self.event_loop, self.abort_now = asyncio.get_running_loop(), asyncio.Event()
            await super().startup(sockets)
            if self.started and on_started is not None:
                on_started(self.servers[0].sockets[0].getsockname()[1])

        def handle_exit(self, sig, frame):
            if not (self.should_exit and sig == signal.SIGINT):
                return super().handle_exit(sig, frame)
            if self.abort_now is None or self.abort_now.is_set():  # a third: uvicorn's forced exit, the way out
                return super().handle_exit(sig, frame)
            print("second Ctrl-C: aborting the open requests now (a third forces the exit)", file=sys.stderr,
                  flush=True)
            # a signal handler runs between two bytecodes of the event loop's thread: the event is set by the loop
            self.event_loop.call_soon_threadsafe(self.abort_now.set)

        async def shutdown(self, sockets=None):
            abort = asyncio.ensure_future(self._abort_after(shutdown_timeout))
            try:
                await super().shutdown(sockets)
            finally:
                abort.cancel()

        async def _abort_after(self, seconds: float | None) -> None:
            try:
                await asyncio.wait_for(self.abort_now.wait(), seconds)
            except asyncio.TimeoutError:
                pass
            await asyncio.get_running_loop().run_in_executor(None, loop.stop)

    if shutdown_timeout is not None:
        config.timeout_graceful_shutdown = shutdown_timeout + SHUTDOWN_GRACE
    return EngineServer(config)


class ServerThread:
    """uvicorn serving ``app`` on a thread of this process, on a free port (tests and the online benchmark):
    ``with ServerThread(app) as server: httpx.get(server.url + "/health")``. Leaving the block shuts the
    server down as Ctrl-C would (the app's lifespan then stops its engine thread).

    Raises:
        RuntimeError: the server did not start within ``timeout`` seconds.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 shutdown_timeout: float | None = 5.0, timeout: float = 30.0):
        import uvicorn

        self.host, self.timeout = host, timeout
        self.server = engine_server(uvicorn.Config(app, host=host, port=port, log_level=log_level),
                                    app.state.loop, shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, name="minillm-http", daemon=True)
        self.url = None

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + self.timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (see its log)")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(self.timeout)
