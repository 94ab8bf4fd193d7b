"""What the engine's choices cost, measured apart from it: each way of reading keys and values for one
decode query (``measure_attention_paths``: contiguous SDPA, an indexed gather then SDPA, and the block-wise
``paged_attention``) and the two constants of ``minillm.paged.batching``'s row cost model
(``measure_row_costs``: c_token and c_key); what a step is made of (``profile_ops``: operations per step
and where the time goes, torch.profiler); and what a run's steps take in the linear layers alone
(``linear_floor``). Benchmarks, not tests; docs/paged.md and docs/decode.md give the numbers."""

from __future__ import annotations

import collections
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from ..paged.attention import paged_attention
from ..fast.paged import FastPagedKVCache


def measure_attention_paths(seq_lens=(64, 512, 2048), block_size: int = 16, n_heads: int = 9, n_kv_heads: int = 3,
                            head_dim: int = 64, repeats: int = 7) -> dict[int, dict[str, float]]:
    """Milliseconds per call of one decode query's attention (B=1), median of ``repeats`` timings,
    for each number of cached tokens: "contiguous" (SDPA on one (1, Hkv, S, D) tensor), "indexed"
    (``index_select`` of the slots from a shuffled pool into a reused buffer, then SDPA) and
    "blockwise" (``paged_attention``). On the CPU, float32; a benchmark, not a test."""
    gen = torch.Generator().manual_seed(0)
    H, Hkv, D = n_heads, n_kv_heads, head_dim
    out = {}
    for S in seq_lens:
        nb = -(-S // block_size)
        k_pool, v_pool = (torch.randn(2 * nb, block_size, Hkv, D, generator=gen) for _ in range(2))
        table = torch.randperm(2 * nb, generator=gen)[:nb]  # blocks out of order, half the pool unused
        slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:S]
        buf_k, buf_v = torch.empty(S, Hkv, D), torch.empty(S, Hkv, D)
        k, v = (torch.randn(1, Hkv, S, D, generator=gen) for _ in range(2))
        q = torch.randn(1, H, 1, D, generator=gen)

        def indexed():
            torch.index_select(k_pool.view(-1, Hkv, D), 0, slots, out=buf_k)
            torch.index_select(v_pool.view(-1, Hkv, D), 0, slots, out=buf_v)
            F.scaled_dot_product_attention(q, buf_k[None].transpose(1, 2), buf_v[None].transpose(1, 2),
                                           enable_gqa=True)

        paths = {"contiguous": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), "indexed": indexed,
                 "blockwise": lambda: paged_attention(q, k_pool, v_pool, table[None], torch.tensor([S]),
                                                      torch.tensor([[S - 1]]))}
        out[S] = {name: _median_ms(f, repeats) for name, f in paths.items()}
    return out


@torch.inference_mode()
def _median_ms(f, repeats: int, calls: int = 20) -> float:
    f()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t0) / calls)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def measure_row_costs(model, num_rows: int = 32, short: int = 64, long: int = 1024, chunk: int = 64) -> dict:
    """c_token and c_key of the cost model (seconds; median of 3 forwards on a ``PagedKVCache``):
    c_key from num_rows decode rows at ``long`` vs ``short`` keys, c_token from one row of ``chunk`` tokens
    vs one token. Returns {"c_token_s", "c_key_s", "key_cost"} (key_cost = c_key / c_token)."""
    def forward(B, T, S):
        cache = FastPagedKVCache(model.config, B * -(-S // 16) + B, 16, dtype=model.dtype, device=model.device,
                                 attention="indexed")
        for i in range(B):
            cache.add_sequence(i)
            if S > T:
                cache.manager.grow(i, S - T)
        tokens = torch.zeros((B, T), dtype=torch.long, device=model.device)
        pos = torch.arange(S - T, S, device=model.device)[None].expand(B, T).contiguous()
        times = []
        for _ in range(3):
            for i in range(B):
                cache.manager.truncate(i, S - T)
            cache.set_rows(range(B))
            start = time.perf_counter()
            model(tokens, pos, cache)
            times.append(time.perf_counter() - start)
        return sorted(times)[1]

    c_key = (forward(num_rows, 1, long) - forward(num_rows, 1, short)) / (num_rows * (long - short))
    c_token = (forward(1, chunk, chunk) - forward(1, 1, chunk)) / (chunk - 1)
    return {"c_token_s": c_token, "c_key_s": c_key, "key_cost": c_key / c_token}


def profile_ops(step, steps: int = 5, top: int = 12) -> dict:
    """What ``steps`` calls of ``step()`` (one decode or engine step each) are made of, under torch.profiler:
    the top-level operations per step (each is a dispatch, and the large ones a parallel region whose
    threads meet at a barrier) and, for the ``top`` most frequent, their count and milliseconds per step.
    Counts do not depend on the machine's load; milliseconds do. Returns {"ops_per_step", "ms_per_step", "top"}."""
    from torch.profiler import ProfilerActivity, profile

    step()  # warm-up outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    count, micros = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.cpu_parent is None:
            count[e.name] += 1
            micros[e.name] += e.cpu_time_total
    return {"ops_per_step": sum(count.values()) / steps, "ms_per_step": sum(micros.values()) / steps / 1e3,
            "top": [(name, n / steps, micros[name] / steps / 1e3) for name, n in count.most_common(top)]}


#: rows at which ``linear_seconds`` times the linear layers; other counts are interpolated
LINEAR_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@torch.inference_mode()
def linear_seconds(model, rows, repeats: int = 3) -> dict[int, tuple[float, float]]:
    """{M: (blocks, head)}: median seconds of one pass through every block's linear layers (wqkv, wo,
    w_gate_up, w_down, through their own forward, the path a step takes) and of the output layer, on M
    rows of random activations, for each M in ``rows``."""
    blocks = [m for layer in model.layers for m in layer.modules() if hasattr(m, "in_features")]  # Linear, QuantLinear
    gen = torch.Generator(device=model.device).manual_seed(0)

    def median(layers, M):
        xs = {n: torch.randn(1, M, n, generator=gen, device=model.device, dtype=model.dtype)
              for n in {m.in_features for m in layers}}
        times = []
        for _ in range(repeats + 1):  # the first pass warms up (and packs oneDNN's copies)
            t0 = time.perf_counter()
            for m in layers:
                m(xs[m.in_features])
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    return {M: (median(blocks, M), median([model.output], M)) for M in rows}


def linear_floor(model, records) -> dict:
    """What the engine's steps would take in the linear layers alone: for each step (``StepRecord``),
    the blocks' linear layers on its tokens and the output layer on its sampled rows, timed at
    ``LINEAR_GRID`` row counts (``linear_seconds``) and interpolated. The rest of a step (attention,
    norms, RoPE, the scheduler, sampling) is what a faster engine could still cut; the linear layers'
    time is what it cannot, with these kernels. Returns {"linear_s", "grid": {M: [blocks_s, head_s]}}."""
    tokens = [sum(r[2] for r in rec.runs) for rec in records]
    sampled = [rec.sampled for rec in records]
    top = max(tokens + sampled, default=1)
    grid = sorted({m for m in LINEAR_GRID if m < top} | {top})
    t = linear_seconds(model, grid)
    blocks = np.interp(tokens, grid, [t[m][0] for m in grid])
    head = np.interp(sampled, grid, [t[m][1] for m in grid]) * (np.array(sampled) > 0)
    return {"linear_s": float(blocks.sum() + head.sum()), "grid": {m: list(t[m]) for m in grid}}
