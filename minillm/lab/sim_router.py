"""Routing a trace over replicas as SGLang's router does (``round_robin``, ``cache_aware``: sgl-router's
approximate prefix tree), each replica its own simulated engine (``simulate.SimEngine``) on one shared clock,
and the shared-prefix requests that show why the policy matters.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..paged.prefix_cache import hash_block_tokens
from .hardware import Device
from .simulate import SimEngine, _pct

__all__ = ["route", "shared_prefix_requests", "simulate_router"]


def _block_keys(token_ids: list[int], block_size: int) -> list[int]:
    """Chained keys of the prompt's full blocks (the prefix cache's own ``hash_block_tokens``)."""
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        keys.append(parent)
    return keys


def route(policy: str, prompt: list[int], trees: list[set], loads: list[int], counter: int, block_size: int = 16,
          cache_threshold: float = 0.5, balance_abs: int = 32, balance_rel: float = 1.0001) -> int:
    """The replica SGLang's router picks. ``round_robin``: ``counter`` mod replicas. ``cache_aware``
    (sgl-router's approximate tree, here at block granularity): when loads are imbalanced (max - min >
    ``balance_abs`` and max > ``balance_rel`` x min) the least loaded; else the longest prefix match if it covers
    more than ``cache_threshold`` of the prompt, else the replica whose tree is smallest. ``trees``: each
    replica's prompt-block keys routed to it so far (updated here); ``loads``: requests in flight per replica.

    Raises:
        ValueError: an unknown policy.
    """
    if policy == "round_robin":
        return counter % len(trees)
    if policy != "cache_aware":
        raise ValueError(f"policy: {policy!r} is not 'round_robin' or 'cache_aware'")
    keys = _block_keys(prompt, block_size)
    if max(loads) - min(loads) > balance_abs and max(loads) > balance_rel * min(loads):
        pick = int(np.argmin(loads))
    else:
        matched = [next((i for i, k in enumerate(keys) if k not in tree), len(keys)) for tree in trees]
        best = int(np.argmax(matched))
        share = matched[best] * block_size / max(1, len(prompt))
        pick = best if share > cache_threshold else int(np.argmin([len(t) for t in trees]))
    trees[pick].update(keys)
    return pick


def simulate_router(config: ModelConfig, device: Device, requests: list[tuple[list[int], int]], arrivals,
                    replicas: int, policy: str, **engine_kwargs) -> dict:
    """``replicas`` simulated engines behind ``route(policy)``: each request goes where the router sends it at
    its arrival, every replica's clock having reached that time. Returns the throughput over the makespan,
    TTFT / TPOT percentiles over all requests, the prefix-cache hit rate of each replica and overall, and how
    many requests each replica got."""
    engines = [SimEngine(config, device, **engine_kwargs) for _ in range(replicas)]
    trees: list[set] = [set() for _ in range(replicas)]
    arrivals = np.asarray(arrivals, dtype=float)
    got = [0] * replicas
    for n, i in enumerate(np.argsort(arrivals, kind="stable")):
        for e in engines:
            e.run_until(float(arrivals[i]))
        pick = route(policy, requests[i][0], trees, [e.num_running for e in engines], n,
                     engine_kwargs.get("block_size", 16))
        engines[pick].add_request(str(i), *requests[i], arrival=float(arrivals[i]))
        got[pick] += 1
    for e in engines:
        while e.has_unfinished():
            e.step()
    ts = [t for e in engines for t in e.timings.values()]
    wall = max(t.last for t in ts) - float(arrivals.min())
    prompt = sum(t.prompt_len for t in ts)
    tpot = [(t.last - t.first) / (t.max_tokens - 1) for t in ts if t.max_tokens > 1]
    return {"policy": policy, "replicas": replicas, "requests_per_replica": got,
            "output_tokens_per_s": sum(t.max_tokens for t in ts) / wall,
            "ttft_p50_s": _pct([t.first - t.arrival for t in ts], 50),
            "ttft_p99_s": _pct([t.first - t.arrival for t in ts], 99),
            "tpot_p50_s": _pct(tpot, 50), "prefix_hit_rate": sum(t.cached or 0 for t in ts) / prompt,
            "replica_hit_rates": [e.summary()["prefix_hit_rate"] if e.timings else 0.0 for e in engines]}


def shared_prefix_requests(num_requests: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                           output_len: int, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Requests that share one of ``num_prefixes`` system prompts of ``prefix_len`` tokens, each followed by
    its own ``suffix_len`` tokens (random ids, seeded), ``output_len`` tokens each; prefixes drawn at random."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(vocab_size, size=prefix_len).tolist() for _ in range(num_prefixes)]
    return [(prefixes[int(rng.integers(num_prefixes))] + rng.integers(vocab_size, size=suffix_len).tolist(),
             output_len) for _ in range(num_requests)]
