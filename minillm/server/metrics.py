"""``GET /metrics``: the engine's state in Prometheus' text format, under vLLM's metric names.

vLLM's server exports ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_hits``
and so on; these are the same quantities as ``minillm:...``, so a dashboard written for one reads the
other after a rename. Gauges and counters come from the engine thread's ``EngineSnapshot`` (read when
scraped, never from the engine); latencies are histograms observed by the engine thread as requests
finish. Each server has its own registry (no global state: tests run several servers in one process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _SnapshotCollector:
    def __init__(self, loop, model_name: str):
        self.loop, self.labels = loop, {"model_name": model_name}

    def collect(self):
        s = self.loop.snapshot
        names = ["model_name"]
        label = [self.labels["model_name"]]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"minillm:{name}", doc, labels=names)
            g.add_metric(label, value)
            return g

        def counter(name, doc, value, prefix="minillm"):
            c = CounterMetricFamily(f"{prefix}:{name}", doc, labels=names)
            c.add_metric(label, value)
            return c

        yield gauge("num_requests_running", "Requests with sequences in the running batch.", s.num_requests_running)
        yield gauge("num_requests_waiting", "Requests waiting for blocks or a seat (preempted included).",
                    s.num_requests_waiting)
        yield gauge("kv_cache_usage_perc", "KV cache usage: blocks in use / blocks in the pool (1 = full).",
                    s.kv_cache_usage)
        yield gauge("num_kv_blocks_used", "KV blocks in use.", s.num_blocks_used)
        yield gauge("num_kv_blocks_total", "KV blocks in the pool.", s.num_blocks)
        yield gauge("num_requests_pending", "Unfinished requests the server holds (its queue's bound: "
                    "--max-num-seqs + --max-queue).", self.loop.pending)
        hit = s.cached_prompt_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        yield gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens.", hit)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prompt_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.cached_prompt_tokens)
        yield counter("prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens)
        yield counter("generation_tokens", "Output tokens generated.", s.generation_tokens)
        yield counter("num_preemptions", "Sequences preempted (their blocks freed, recomputed later).", s.preemptions)
        yield counter("engine_steps", "Engine steps run.", s.steps)
        yield counter("engine_step_failures", "Engine steps that raised (their requests were aborted).",
                      s.step_failures)
        if s.speculating:  # vLLM's spec_decode counters under vLLM's own names (dashboards read them as they are),
            # exported as vLLM does only when the engine speculates
            yield counter("spec_decode_num_drafts", "Sequences that carried a draft into a step.", s.spec_drafts, "vllm")
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_draft_tokens, "vllm")
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_accepted_tokens, "vllm")
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted "
                                          "at each draft position.", labels=names + ["position"])
            for pos, n in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric(label + [str(pos)], n)
            yield per_pos
        done = CounterMetricFamily("minillm:request_success", "Finished requests by reason (abort: the client "
                                   "left; error: a failed step or shutdown).", labels=names + ["finished_reason"])
        for reason, n in s.finished:
            done.add_metric(label + [reason], n)
        yield done


class ServerMetrics:
    """The registry of one server: the snapshot's gauges and counters, the latency histograms (``observe``
    is the engine loop's ``on_finish`` hook) and the rejected-request counter (``rejected``)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram("minillm:time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("minillm:e2e_request_latency_seconds", "End-to-end latency (arrival to finish).", labels,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("minillm:request_time_per_output_token_seconds", "Time per output token after the "
                              "first: (last - first token time) / (output tokens - 1).", labels,
                              buckets=TOKEN_BUCKETS, registry=self.registry)
        self.rejected = Counter("minillm:request_rejected", "Requests refused with 503 (the queue was full or the "
                                "server was stopping).", labels, registry=self.registry)

    def attach(self, loop) -> None:
        self.registry.register(_SnapshotCollector(loop, self.model_name))

    def observe(self, out) -> None:
        """A finished ``RequestOutput`` (engine thread): its TTFT, latency and time per output token."""
        m, name = out.metrics, self.model_name
        if m.first_token_time is not None:
            self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)
        n = max((len(c.token_ids) for c in out.outputs), default=0)
        if n > 1 and m.last_token_time is not None and m.first_token_time is not None:
            self.tpot.labels(name).observe((m.last_token_time - m.first_token_time) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
