"""Two ``minillm serve`` replicas (one core each) behind SGLang's router (``sglang-router`` from PyPI, a test
and bench tool, not a dependency of the library), on a shared-prefix trace, once per routing policy.

Per policy, on fresh replicas: requests arrive as a Poisson process and stream their tokens through the router
on 127.0.0.1; the report gives TTFT percentiles, output tokens/s over the run, and each replica's prefix-cache
hit rate read from its ``/metrics`` (``minillm:prefix_cache_hits`` / ``prefix_cache_queries``). Every process
it starts it stops, also on an error. ``python -m minillm.lab.router_bench --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager

import numpy as np

from ..data import HELD_OUT_PLAY, play_text
from .online import arrival_times

HOST = "127.0.0.1"


def shared_prefix_prompts(num_requests: int, num_prefixes: int, prefix_chars: int = 600, question_chars: int = 80,
                          seed: int = 0) -> tuple[list[str], list[int]]:
    """Text prompts: one of ``num_prefixes`` passages of the held-out play (a "system prompt"), then a passage
    of its own; returns the prompts and each one's prefix index (seeded)."""
    text = play_text(HELD_OUT_PLAY)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(text) - prefix_chars, num_prefixes)
    prefixes = [text[s:s + prefix_chars] for s in starts]
    which = rng.integers(0, num_prefixes, num_requests).tolist()
    prompts = []
    for w in which:
        q = int(rng.integers(0, len(text) - question_chars))
        prompts.append(prefixes[w] + "\n\nQuestion: " + text[q:q + question_chars])
    return prompts, which


@contextmanager
def process(cmd: list[str], log_path: str):
    """A child process in its own session, stopped (SIGTERM, then SIGKILL after 20 s) when the block ends."""
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def wait_ready(url: str, proc, timeout: float = 180.0) -> None:
    """Poll ``url`` until it answers 200. Raises RuntimeError if the process exits or the time runs out."""
    import httpx
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url}: not ready after {timeout:.0f} s")


def prefix_counters(base: str) -> dict:
    """{"queries", "hits"}: prompt tokens looked up in / served from the replica's prefix cache (/metrics)."""
    import httpx
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out = {}
    for key in ("queries", "hits"):
        m = re.search(rf"^minillm:prefix_cache_{key}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        out[key] = float(m.group(1)) if m else float("nan")
    return out


async def _client(url: str, model: str, prompts: list[str], arrivals, max_tokens: int) -> list[dict]:
    import httpx

    async def one(client, i):
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        sent = time.perf_counter()
        first, chunks = None, 0
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if json.loads(line[6:]).get("choices"):
                        first = first or time.perf_counter()
                        chunks += 1
        return {"ttft": first - sent, "end": time.perf_counter() - t0, "chunks": chunks}

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))


def run_policy(policy: str, prompts: list[str], arrivals, max_tokens: int, base_port: int, logs: str,
               threads: int = 1) -> dict:
    """Fresh replicas on cores 0 and 1 (``taskset``), the router with ``policy`` in front; the trace through it."""
    router_bin = shutil.which("sglang-router") or os.path.join(os.path.dirname(sys.executable), "sglang-router")
    ports = [base_port + 1, base_port + 2]
    with ExitStack() as stack:
        replicas = []
        for core, port in enumerate(ports):
            cmd = ["taskset", "-c", str(core), sys.executable, "-m", "minillm", "serve", "--host", HOST, "--port",
                   str(port), "--threads", str(threads), "--served-model-name", "smollm2", "--log-level", "warning"]
            replicas.append(stack.enter_context(process(cmd, f"{logs}/replica{core}-{policy}.log")))
        for port, proc in zip(ports, replicas):
            wait_ready(f"http://{HOST}:{port}/health", proc)
        router = stack.enter_context(process(
            [router_bin, "launch", "--host", HOST, "--port", str(base_port), "--policy", policy, "--log-level", "warn",
             "--worker-urls", *(f"http://{HOST}:{p}" for p in ports)], f"{logs}/router-{policy}.log"))
        wait_ready(f"http://{HOST}:{base_port}/health", router, 60)
        before = [prefix_counters(f"http://{HOST}:{p}") for p in ports]
        started = time.time()
        results = asyncio.run(_client(f"http://{HOST}:{base_port}", "smollm2", prompts, arrivals, max_tokens))
        after = [prefix_counters(f"http://{HOST}:{p}") for p in ports]
    per = [{"queries": a["queries"] - b["queries"], "hits": a["hits"] - b["hits"]} for a, b in zip(after, before)]
    wall = max(r["end"] for r in results)
    ttft = [r["ttft"] for r in results]
    return {"policy": policy, "requests": len(prompts), "wall_s": wall, "seconds": time.time() - started,
            "output_tokens_per_s": len(prompts) * max_tokens / wall,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "replica_prompt_tokens": [p["queries"] for p in per],
            "replica_hit_rates": [p["hits"] / p["queries"] if p["queries"] else 0.0 for p in per],
            "prefix_hit_rate": sum(p["hits"] for p in per) / max(1.0, sum(p["queries"] for p in per))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--port", type=int, default=8300, help="the router's; the replicas take the next two")
    p.add_argument("--policies", default="round_robin,cache_aware")
    p.add_argument("--logs", default="/tmp")
    args = p.parse_args(argv)
    prompts, _ = shared_prefix_prompts(args.requests, args.prefixes)
    arrivals = arrival_times(args.requests, args.rate)
    load = os.getloadavg()
    rows = [run_policy(policy, prompts, arrivals, args.max_tokens, args.port, args.logs)
            for policy in args.policies.split(",")]
    print(json.dumps({"load_before": load, "load_after": os.getloadavg(), "rows": rows,
                      "trace": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
