"""Every way the engine reads keys and values from the pool of blocks, from the reference to the paper's algorithm.

Kwon et al. 2023 (vLLM, arXiv 2309.06180), Sec. 4.1: a sequence's keys and values sit in blocks anywhere in
the pool; its block table says where. ``LLMEngine(attention=...)`` picks the read:

* ``gather_padded`` ("gather", the reference): each row's blocks concatenated, cut to its length, padded.
* ``paged_attention`` ("blockwise", the plain engine's default): block by block with an online softmax
  (Milakov & Gimelshein 2018), nothing gathered.
* ``padded_slots``: every row's key slots as one index (the speed layer's "indexed" read, ``minillm.fast.paged``,
  reads them with one ``index_select`` then SDPA; its "bucketed" read groups rows by the keys they attend over
  and sends short rows to minillm's C++ PagedAttention kernel, ``paged_attention`` fused as vLLM's is on a GPU).
"""

from __future__ import annotations

import math

import torch


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


def padded_tables(tables: list[list[int]], device=None) -> torch.Tensor:
    """(R, W) int64 block tables, each padded to the widest with its own first block (never read: a row
    reads only the blocks its length reaches)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.long, device=device)


def padded_slots(tables: list[list[int]], lens: list[int], S: int, block_size: int, device) -> torch.Tensor:
    """(len(tables) * S,) pool slots of key positions 0..S-1 of each row (slot = block_table[pos //
    block_size] * block_size + pos % block_size); a row of length n reads its position n - 1 from there on
    (masked out), so no slot the sequence does not hold is ever read."""
    table = padded_tables(tables)  # (B, nb)
    key_pos = torch.minimum(torch.arange(S)[None, :], torch.tensor(lens)[:, None] - 1)  # (B, S), within the row
    slots = table.gather(1, key_pos // block_size) * block_size + key_pos % block_size
    return slots.reshape(-1).to(device)


def gather_padded(pool: torch.Tensor, tables: list[list[int]], lens: list[int], S: int) -> torch.Tensor:
    """The reference read of one layer's pool (num_blocks, block_size, Hkv, D): each row's blocks,
    concatenated, cut to its length, padded with its last key to S; (B, Hkv, S, D)."""
    rows = []
    for table, n in zip(tables, lens):
        x = torch.cat([pool[block] for block in table])[:n]  # (n, Hkv, D): the row's positions in order
        rows.append(torch.cat([x, x[-1:].expand(S - n, -1, -1)]))  # (S, Hkv, D)
    return torch.stack(rows).transpose(1, 2)


def attend_blockwise(qt: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, query_pos: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``paged_attention`` on the forward's rows (or a flat row's segments): each row's queries padded to the
    longest, attended block by block, put back in token order.

    Args:
        qt: (N, H, D) the forward's queries, token-major; k_pool, v_pool: (num_blocks, block_size, Hkv, D).
        tables: (R, W) block tables; lens: (R,) tokens held; query_pos: (R, Tmax), -1 for padding;
            index: (R, Tmax) the token of qt each query is (N for padding).
    Returns: (N, H, D); a query never attends outside its own row's sequence.
    """
    N, H, D = qt.shape
    padded = torch.cat([qt, qt.new_zeros((1, H, D))])[index]  # (R, Tmax, H, D)
    out = paged_attention(padded.transpose(1, 2), k_pool, v_pool, tables, lens, query_pos)  # (R, H, Tmax, D)
    y = qt.new_zeros((N + 1, H, D))
    y[index.reshape(-1)] = out.transpose(1, 2).reshape(-1, H, D)
    return y[:N]

