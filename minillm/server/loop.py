"""The engine thread: one thread drives the ``LLMEngine`` for every connection.

Orca's iteration-level scheduling (Yu et al. 2022, Sec. 4) pays off online only if the requests of every
connection meet in the same step, so the server has exactly one driver: a thread that adds requests,
aborts them and steps the engine. ``LLMEngine`` is single-driver (never two threads in it), so nothing
else touches it: the HTTP handlers (asyncio) hand it requests and aborts through a thread-safe queue, and
it hands each request's outputs back to the handler's asyncio queue with ``loop.call_soon_threadsafe``.
When no request is unfinished it blocks on its queue (no busy spin); otherwise it reads every message
that arrived, then steps, so an abort frees the request's blocks before the next step runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import Counter, deque
from dataclasses import dataclass

log = logging.getLogger("minillm.server")


class RequestRefused(ValueError):
    """``add_request`` refused the request (its message names the field): a 4xx for the client."""


class RequestFailed(RuntimeError):
    """The request was ended by the server: an engine step failed, or the server is shutting down."""


class Overloaded(RuntimeError):
    """The server holds as many unfinished requests as it may (``max_pending``): a 503 for the client."""


_ACCEPTED = object()  # the engine added the request
_END = object()       # the stream is over (after a RequestOutput with finished=True, or an error)


@dataclass(frozen=True)
class EngineSnapshot:
    """What /metrics reads, published by the engine thread after each step (never read from the engine).

    Counts of requests (not sequences): running and waiting; KV blocks in use of num_blocks; prompt tokens
    and those served from the prefix cache (first admission of each request); output tokens generated;
    preemptions; steps; failed steps; finished requests by reason (stop, length, abort, error); with speculation,
    vLLM's counters: drafts (sequences that carried a draft into a step), draft tokens, accepted tokens, and
    accepted tokens by draft position."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    step_failures: int = 0
    finished: tuple[tuple[str, int], ...] = ()
    speculating: bool = False
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        """Blocks in use / blocks in the pool, in [0, 1] (vLLM's kv_cache_usage_perc)."""
        return self.num_blocks_used / self.num_blocks if self.num_blocks else 0.0


class RequestStream:
    """The asyncio side of one request: what the engine thread sent it, in order.

    ``accepted()`` waits for the engine's verdict on the request (raises ``RequestRefused``);
    ``outputs()`` yields its ``RequestOutput``s (cumulative, as vLLM's: one that arrives while another waits
    for the reader replaces it, so at most one waits) until the finished one, or raises ``RequestFailed``;
    ``close()`` aborts it if it is still running and gives back its place in the queue.
    """

    def __init__(self, request_id: str, owner: "EngineLoop", loop: asyncio.AbstractEventLoop):
        self.request_id, self._owner, self._loop = request_id, owner, loop
        self._items: deque = deque()
        self._ready = asyncio.Event()
        self.finished = self._closed = False

    def _put(self, item) -> None:  # the engine thread
        try:
            self._loop.call_soon_threadsafe(self._push, item)
        except RuntimeError:  # the event loop has closed (the server is gone): nobody is left to read it
            pass

    def _push(self, item) -> None:  # the event loop's thread
        # a newer cumulative output holds everything a queued one does, so it takes its place: a client that
        # stops reading holds one output per request (memory linear in its length), not one per step
        if _is_output(item) and self._items and _is_output(self._items[-1]):
            self._items[-1] = item
        else:
            self._items.append(item)
        self._ready.set()

    @property
    def queued(self) -> int:
        """Items waiting for the reader (at most one output, then at most the end or an error)."""
        return len(self._items)

    async def _next(self):
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        return item

    async def accepted(self) -> None:
        await self._next()

    async def outputs(self):
        while not self.finished:
            item = await self._next()
            if item is _END:
                self.finished = True
                return
            self.finished = item.finished
            yield item

    async def final(self):
        """The finished ``RequestOutput`` (raises ``RequestFailed``)."""
        last = None
        async for last in self.outputs():
            pass
        return last

    def close(self) -> None:
        """Abort the request unless it finished; idempotent."""
        if not self._closed:
            self._closed = True
            self._owner._release(self.request_id, abort=not self.finished)


def _is_output(item) -> bool:
    return item is not _END and item is not _ACCEPTED and not isinstance(item, Exception)


class EngineLoop:
    """Runs ``engine`` on one thread; every other thread talks to it through ``submit``, ``abort``,
    ``call`` and ``stop``, and reads ``snapshot``.

    Args:
        engine: a ``minillm.paged.LLMEngine``, not stepped by anyone else.
        max_pending: unfinished requests at most (running and waiting); ``submit`` raises
            ``Overloaded`` past it (None: no bound).
        on_finish: called on the engine thread with each finished ``RequestOutput`` (the metrics' hook).
        keep_records: step records the engine keeps (``engine.stats.records``; a server runs for days,
            and only recent steps are read).
    """

    def __init__(self, engine, max_pending: int | None = None, on_finish=None, keep_records: int = 10_000):
        self.engine, self.max_pending, self.on_finish, self.keep_records = engine, max_pending, on_finish, keep_records
        # read once, before the thread starts: the handlers check requests against these
        self.max_seq_len, self.num_blocks, self.block_size = engine.max_seq_len, engine.num_blocks, engine.block_size
        self.tokenizer, self.vocab_size = engine.tokenizer, engine.model.config.vocab_size
        self.snapshot = EngineSnapshot(num_blocks=engine.num_blocks)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # the engine thread's
        self._tokens: dict[str, int] = {}  # output tokens seen per request (the engine thread's)
        self._generated, self._failures, self._finished = 0, 0, Counter()
        self._pending, self._lock = 0, threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)

    # ---- any thread ----------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def running(self) -> bool:
        """The thread is alive and not stopping (what /health reports)."""
        return self._thread.is_alive() and not self._stopping

    @property
    def pending(self) -> int:
        """Unfinished requests handed to the loop and not yet closed."""
        return self._pending

    def submit(self, request_id: str, prompt, params) -> RequestStream:
        """Hand a request to the engine thread (from a coroutine: the stream feeds the running event loop).

        Raises:
            Overloaded: ``max_pending`` requests are unfinished, or the loop is stopping.
        """
        with self._lock:
            if self._stopping:
                raise Overloaded("the server is shutting down; it accepts no new requests")
            if self.max_pending is not None and self._pending >= self.max_pending:
                raise Overloaded(f"the server holds {self._pending} unfinished requests, its limit (--max-queue "
                                 "and --max-num-seqs); retry later")
            self._pending += 1
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        self._inbox.put(("add", stream, prompt, params))
        return stream

    def abort(self, request_ids) -> None:
        self._inbox.put(("abort", [request_ids] if isinstance(request_ids, str) else list(request_ids)))

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps; the future holds its result (for tests and
        the benchmark: reading ``engine.stats`` or ``engine.manager`` from another thread is not allowed)."""
        future = concurrent.futures.Future()
        self._inbox.put(("call", fn, future))
        return future

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort what is unfinished (its clients get ``RequestFailed``), end the thread and wait for it."""
        with self._lock:
            self._stopping = True
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)

    def _release(self, request_id: str, abort: bool) -> None:
        with self._lock:
            self._pending -= 1
        if abort:
            self.abort(request_id)

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self.engine.has_unfinished_requests():
                    if not self._handle(self._inbox.get()):  # idle: sleep until a message comes
                        return
                while True:  # everything that arrived, before the next step
                    try:
                        message = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(message):
                        return
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
            except Exception:  # a bug here must not leave clients waiting forever
                log.exception("engine loop: unexpected error; failing every request")
                self._fail(list(self._streams), "the server's engine loop failed (see the server log)")

    def _handle(self, message) -> bool:
        """One message; False for stop."""
        kind = message[0]
        if kind == "add":
            _, stream, prompt, params = message
            try:
                self.engine.add_request(stream.request_id, prompt, params)
            except ValueError as e:
                stream._put(RequestRefused(str(e)))
                return True
            self._streams[stream.request_id] = stream
            self._tokens[stream.request_id] = 0
            stream._put(_ACCEPTED)
        elif kind == "abort":
            live = [rid for rid in message[1] if rid in self._streams]
            if live:
                self.engine.abort_request(live)
                for rid in live:
                    self._forget(rid, "abort")._put(_END)
        elif kind == "call":
            _, fn, future = message
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:
                    future.set_exception(e)
        elif kind == "stop":
            self._fail(list(self._streams), "the server is shutting down")
            while True:  # what came after the stop: nobody may wait for it forever
                try:
                    late = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if late[0] == "add":
                    late[1]._put(RequestFailed("the server is shutting down"))
                elif late[0] == "call":
                    late[2].cancel()
            self._publish()
            return False
        return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # A step that fails in its forward or sampling is undone (the requests stay, and a retry would
            # compute the same, or fail the same); one that fails appending aborts the requests it could not
            # append to, and the next step returns their outputs ("abort") with those of the requests that
            # finished in it. So: if some requests left the engine, the next step tells their clients; if
            # none did, every request is aborted and told, so that a step that keeps failing cannot spin.
            self._failures += 1
            log.exception("engine step failed")
            if not any(rid not in self.engine.requests for rid in self._streams):
                self._fail(list(self._streams), f"the engine's step failed ({type(e).__name__}: {e}); the "
                           "request was aborted")
            return
        deliveries = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            reasons = {c.finish_reason for c in out.outputs}
            if out.finished and "abort" in reasons:  # the engine aborted it (a failed append)
                self._fail([out.request_id], "the engine aborted the request (see the server log)")
                continue
            tokens = sum(len(c.token_ids) for c in out.outputs)
            self._generated += tokens - self._tokens[out.request_id]
            self._tokens[out.request_id] = tokens
            deliveries.append((stream, out))
            if out.finished:
                self._forget(out.request_id, "stop" if reasons == {"stop"} else "length")
                if self.on_finish is not None:
                    self.on_finish(out)
        records = self.engine.stats.records
        if len(records) > 2 * self.keep_records:
            del records[:-self.keep_records]
        self._publish()  # first: a client that has its tokens finds them counted in /metrics
        for stream, out in deliveries:
            stream._put(out)

    def _forget(self, request_id: str, reason: str) -> RequestStream:
        self._finished[reason] += 1
        self._tokens.pop(request_id, None)
        return self._streams.pop(request_id)

    def _fail(self, request_ids: list[str], message: str) -> None:
        live = [rid for rid in request_ids if rid in self.engine.requests]
        if live:
            try:
                self.engine.abort_request(live)
            except Exception:
                log.exception("engine loop: abort_request failed")
        for rid in request_ids:
            self._forget(rid, "error")._put(RequestFailed(message))

    def _publish(self) -> None:
        sched, stats = self.engine.scheduler, self.engine.stats
        self.snapshot = EngineSnapshot(
            num_requests_running=len({s.request_id for s in sched.running}),
            num_requests_waiting=len({s.request_id for s in sched.waiting}),
            num_blocks_used=self.engine.manager.num_used_blocks, num_blocks=self.num_blocks,
            prompt_tokens=stats.prompt_tokens, cached_prompt_tokens=stats.cached_tokens,
            generation_tokens=self._generated, preemptions=stats.preemptions, steps=stats.steps,
            step_failures=self._failures, finished=tuple(sorted(self._finished.items())),
            **_spec_counters(stats.spec_decoding))


def _spec_counters(spec) -> dict:
    if spec is None:
        return {}
    return {"speculating": True, "spec_drafts": spec.num_drafts, "spec_draft_tokens": spec.num_draft_tokens,
            "spec_accepted_tokens": spec.num_accepted_tokens,
            "spec_accepted_per_pos": tuple(spec.num_accepted_tokens_per_pos)}
