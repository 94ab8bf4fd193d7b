"""Attention over KV blocks with an online softmax: the algorithm of the PagedAttention kernel.

Kwon et al. 2023 (vLLM, arXiv 2309.06180), Sec. 4.1, Eq. 4: the attention of a query is accumulated
block by block, A_ij = exp(q_i K_j^T / sqrt(D)) / sum_t exp(q_i K_t 1 / sqrt(D)), o_i = sum_j V_j A_ij^T;
the running maximum and sum of the softmax (Milakov & Gimelshein 2018, "Online normalizer calculation
for softmax") let each block be read once, from wherever it lies in the pool, without gathering a
sequence's keys into one tensor.

Here it is written with torch operations, one loop iteration per logical block, to show the
algorithm and to test it against the gathered path. On this 2-core CPU it is not the path
``PagedKVCache`` takes: each block costs a dozen small operator calls (indexing, two products,
the max / exp / rescale of the running softmax), while the "indexed" read of the cache is one
``index_select`` per layer followed by one fused SDPA call. Measured with
``measure_attention_paths()`` on SmolLM2-135M's shapes (B=1, H=9, Hkv=3, D=64, one query,
block_size 16), per layer, medians on the 2-core CPU: at 64 / 512 / 2,048 cached tokens the block
loop takes 0.48 / 3.5 / 13.7 ms, index_select + SDPA 0.037 / 0.11 / 0.42 ms, and SDPA on a
contiguous cache 0.012 / 0.035 / 0.13 ms. A fused kernel (vLLM's CUDA kernel, or Triton) is what
makes the block-wise form pay: there the loop runs inside one kernel launch and nothing is copied.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over each row's blocks, one block at a time (online softmax).

    Args:
        q: (B, H, T, D) queries.
        k_pool, v_pool: (num_blocks, block_size, Hkv, D), one layer of the pool (H a multiple of Hkv).
        block_tables: (B, W) int64 physical blocks of each row's logical blocks 0..W-1; a row with
            fewer blocks pads with one of its own (padding blocks are masked, never used).
        seq_lens: (B,) int64 tokens held by each row's sequence.
        query_pos: (B, T) int64 position of each query (causal: it sees keys at positions <= its
            own); -1 marks a padding query, whose output is 0.

    Returns:
        (B, H, T, D) in q's dtype (accumulated in float32). Key slots at or past a row's length are
        never multiplied in, whatever they hold (NaN included).
    """
    B, H, T, D = q.shape
    block_size, Hkv = k_pool.shape[1], k_pool.shape[2]
    qg = q.float().reshape(B, Hkv, H // Hkv, T, D) / math.sqrt(D)  # each KV head's group of query heads
    m = torch.full((B, Hkv, H // Hkv, T, 1), float("-inf"), device=q.device)  # running max of the scores
    l = torch.zeros_like(m)  # running sum of exp(score - m)
    acc = torch.zeros_like(qg)  # running sum of exp(score - m) v
    offsets = torch.arange(block_size, device=q.device)
    for j in range(block_tables.shape[1]):
        key_pos = j * block_size + offsets  # (bs,)
        held = key_pos[None, :] < seq_lens[:, None]  # (B, bs)
        visible = held[:, None, :] & (key_pos[None, None, :] <= query_pos[:, :, None])  # (B, T, bs)
        kb = k_pool[block_tables[:, j]].float()  # (B, bs, Hkv, D): one block per row, from anywhere in the pool
        vb = torch.where(held[:, :, None, None], v_pool[block_tables[:, j]].float(), 0.0)
        s = torch.einsum("bhgtd,bshd->bhgts", qg, kb)  # (B, Hkv, G, T, bs)
        s = s.masked_fill(~visible[:, None, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # no visible key yet: keep exp() finite
        p = torch.exp(s - m_safe)
        rescale = torch.exp(m - m_safe)
        l = l * rescale + p.sum(-1, keepdim=True)
        acc = acc * rescale + torch.einsum("bhgts,bshd->bhgtd", p, vb)
        m = m_new
    out = acc / l.clamp_min(torch.finfo(torch.float32).tiny)
    return out.reshape(B, H, T, D).to(q.dtype)


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
