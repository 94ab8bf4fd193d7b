"""Decode attention read from the block pool through ``torch.nn.attention.flex_attention``, measured against
the engine's indexed read (one ``index_select`` of every row's slots, then SDPA) and its default, "bucketed"
(``PagedKVCache.attend``: rows grouped by the keys they attend over, one read and one SDPA per group).

FlexAttention takes a ``BlockMask``: for each query block, the key blocks it attends. With one query row per
sequence and key blocks the size of the pool's blocks, a row's block table *is* its list of key blocks, so
the kernel reads keys and values where they lie in the pool (PagedAttention's idea, Kwon et al. 2023, Sec. 4.1)
with nothing gathered. Full blocks need no mask; a row's last, partly filled block is cut at the row's length
by a ``mask_mod``. The pool is stored head-major here, (1, Hkv, num_blocks * block_size, D), the layout the
kernel reads; the engine's pool is (num_blocks, block_size, Hkv, D).

``python -m minillm.lab.flex_paged`` prints per-layer times for a few batch shapes (docs/paged.md quotes a run).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..config import ModelConfig
from ..paged.attention import padded_slots
from ..fast.paged import FastPagedKVCache
from ..timing import machine, time_median

_flex = torch.compile(flex_attention, dynamic=False)


def paged_block_mask(tables: list[list[int]], lens: list[int], block_size: int, num_blocks: int) -> BlockMask:
    """The ``BlockMask`` of one decode step: query row b attends the blocks of ``tables[b]``, its full
    blocks unmasked and its last block (when partly filled) up to ``lens[b]``."""
    logical = torch.zeros(num_blocks, dtype=torch.long)  # physical block -> its logical index in its row
    for table in tables:
        logical[torch.tensor(table)] = torch.arange(len(table))
    lens_t = torch.tensor(lens)

    def mask_mod(b, h, q_idx, kv_idx):
        return logical[kv_idx // block_size] * block_size + kv_idx % block_size < lens_t[q_idx]

    def padded(lists):
        return (torch.tensor([len(x) for x in lists], dtype=torch.int32)[None, None],
                torch.tensor([x + [0] * (num_blocks - len(x)) for x in lists], dtype=torch.int32)[None, None])

    held = [t[:-(-n // block_size)] for t, n in zip(tables, lens)]  # a table may hold blocks reserved past n
    partial = [[t[-1]] if n % block_size else [] for t, n in zip(held, lens)]
    full = [t[:-1] if n % block_size else t for t, n in zip(held, lens)]
    return BlockMask.from_kv_blocks(*padded(partial), *padded(full), BLOCK_SIZE=(1, block_size), mask_mod=mask_mod,
                                    seq_lengths=(len(tables), num_blocks * block_size))


def flex_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """q (B, H, D), one decode query per row; pools (1, Hkv, num_blocks * block_size, D) -> (B, H, D)."""
    out = _flex(q.transpose(0, 1)[None].contiguous(), k_pool, v_pool, block_mask=block_mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def indexed_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: list[list[int]],
                   lens: list[int], block_size: int) -> torch.Tensor:
    """The baseline, same inputs as ``flex_decode`` but the engine's pools (num_blocks, block_size, Hkv, D):
    every row's slots read with one ``index_select``, then SDPA with a length mask. Returns (B, H, D)."""
    B, Hkv, D, S = len(tables), k_pool.shape[2], k_pool.shape[3], max(lens)
    slots = padded_slots(tables, lens, S, block_size, q.device)
    mask = (torch.arange(S)[None] < torch.tensor(lens)[:, None])[:, None, None, :]
    k = k_pool.view(-1, Hkv, D).index_select(0, slots).view(B, S, Hkv, D).transpose(1, 2)
    v = v_pool.view(-1, Hkv, D).index_select(0, slots).view(B, S, Hkv, D).transpose(1, 2)
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]


def head_major(pool: torch.Tensor) -> torch.Tensor:
    """(num_blocks, block_size, Hkv, D) -> (1, Hkv, num_blocks * block_size, D), the layout flex reads."""
    nb, bs, hkv, d = pool.shape
    return pool.reshape(nb * bs, hkv, d).permute(1, 0, 2).contiguous()[None]


def random_step(batch: int, lo: int, hi: int, num_blocks: int = 728, block_size: int = 16, heads: int = 9,
                kv_heads: int = 3, head_dim: int = 64, seed: int = 0):
    """A decode step's inputs: lengths in lo..hi, block tables drawn from a shuffled pool, random q and pools."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
    free, tables = torch.randperm(num_blocks, generator=g).tolist(), []
    for n in lens:
        need = -(-n // block_size)
        tables.append(free[:need])
        free = free[need:]
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    return torch.randn(batch, heads, head_dim, generator=g), k, v, tables, lens


def bucketed_step(lens: list[int], num_blocks: int, block_size: int):
    """A one-layer ``PagedKVCache`` on the "bucketed" path holding sequences of ``lens`` tokens, planned for
    one decode step; returns (cache, its tables, a function attending q (B, H, D) -> (B, H, D) through it).
    Planning (``prepare``) is once per step, as the block mask's build; ``attend`` writes the step's new keys
    and values too, as in the engine."""
    cache = FastPagedKVCache(ModelConfig(n_layers=1), num_blocks, block_size, enable_prefix_caching=False,
                             attention="bucketed")
    for i, n in enumerate(lens):
        cache.add_sequence(i)
        cache.manager.grow(i, n - 1)
    cache.set_rows(list(range(len(lens))), widths=[1] * len(lens))
    cache.prepare(torch.tensor([[n - 1 for n in lens]]))
    kv = torch.zeros(1, cache.n_kv_heads, len(lens), cache.head_dim)

    def attend(q):
        return cache.attend(0, q.transpose(0, 1)[None], kv, kv, None)[0].transpose(0, 1)  # one flat row of B tokens
    return cache, [cache.manager.block_table(i) for i in range(len(lens))], attend


def measure(cases=((1, 64, 64), (1, 512, 512), (16, 32, 256), (16, 128, 512), (64, 32, 256)), rounds: int = 3,
            block_size: int = 16, num_blocks: int = 728) -> list[dict]:
    """Per case (batch, shortest, longest), on one step's pool and block tables: milliseconds per layer of
    the indexed read + SDPA, of "bucketed" and of flex (the medians of ``rounds`` interleaved rounds); what
    each does once per step for all layers (bucketed's plan, flex's block mask); the largest difference of
    flex's and bucketed's outputs from the indexed read's."""
    rows = []
    with torch.inference_mode():
        for batch, lo, hi in cases:
            q, k, v, _, lens = random_step(batch, lo, hi, num_blocks, block_size)
            cache, tables, bucketed = bucketed_step(lens, num_blocks, block_size)
            cache.k[0].copy_(k)
            cache.v[0].copy_(v)
            bucketed(q)  # its write of the step's keys and values, once, so that every path reads the same pool
            k, v = cache.k[0], cache.v[0]
            kf, vf = head_major(k), head_major(v)
            mask = paged_block_mask(tables, lens, block_size, num_blocks)
            ref = indexed_decode(q, k, v, tables, lens, block_size)
            paths = {"indexed": lambda: indexed_decode(q, k, v, tables, lens, block_size),
                     "bucketed": lambda: bucketed(q), "flex": lambda: flex_decode(q, kf, vf, mask)}
            diff = {name: float((paths[name]() - ref).abs().max()) for name in ("bucketed", "flex")}
            times = {name: [] for name in paths}
            for _ in range(rounds):
                for name, fn in paths.items():
                    times[name].append(time_median(fn, repeats=30, warmup=3))
            pos = torch.tensor([[n - 1 for n in lens]])
            rows.append({"batch": batch, "lens": (lo, hi), "mean_len": sum(lens) / batch,
                         **{f"{name}_ms": statistics.median(t) * 1e3 for name, t in times.items()},
                         "plan_ms": time_median(lambda: cache.prepare(pos), repeats=10) * 1e3,
                         "mask_build_ms": time_median(lambda: paged_block_mask(tables, lens, block_size, num_blocks),
                                                      repeats=10) * 1e3,
                         "max_abs_diff": max(diff.values())})
    return rows


if __name__ == "__main__":
    print(machine(), "float32, H 9, Hkv 3, D 64, block 16, pool 728 blocks; ms per layer, then once per step")
    for r in measure():
        print(f"B={r['batch']:<3} lengths {r['lens'][0]}-{r['lens'][1]} (mean {r['mean_len']:.0f}): indexed "
              f"{r['indexed_ms']:.3f}, bucketed {r['bucketed_ms']:.3f}, flex {r['flex_ms']:.3f} "
              f"({r['bucketed_ms'] / r['flex_ms']:.2f}x bucketed); per step: bucketed's plan {r['plan_ms']:.2f}, "
              f"flex's block mask {r['mask_build_ms']:.2f}; max |diff| {r['max_abs_diff']:.1e}")
