"""The engine's fast reads of the KV block pool: ``FastPagedKVCache`` adds "bucketed", "indexed" and "fused" to the
library's ``PagedKVCache`` ("blockwise", "gather"), which stays their reference (tests compare them).

* "fused": every row through minillm's PagedAttention kernel (``kernels.paged_attention``: the online softmax of
  ``minillm.paged.attention.paged_attention``, fused in C++ as vLLM's kernel is on a GPU).
* "bucketed" (what an accelerated model's engine uses): rows of at most ``FUSED_MAX_QUERIES`` queries (decode, a
  short verification) through the fused kernel; longer rows (prefill chunks) grouped by the keys they attend over,
  one rectangle and one SDPA per group (``attention.buckets``, ``attend_groups``), which gains more there.
* "indexed": every row's key slots read with one ``index_select`` per layer into a reused buffer, then SDPA.

Where the kernels are built, the fused QKV product's output goes to ``attend_qkv``: RoPE and the KV write in one
pass (``kernels.rope_write``), then the read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..model import attention, attention_mask
from ..paged.attention import padded_slots, padded_tables
from ..paged.cache import BACKENDS, PagedKVCache
from . import kernels

#: what one more group costs the "bucketed" path (an index_select and an SDPA call per layer), in key positions
BUCKET_COST = 128
#: on the "bucketed" path, segments of at most this many queries (a decode row, a verification of up to 4 drafts)
#: go to the fused PagedAttention kernel where it is built; longer ones gain more from SDPA (docs/paged.md)
FUSED_MAX_QUERIES = 5


def buckets(key_lens: list[int], bucket_cost: float) -> list[list[int]]:
    """Rows grouped so that each group's rows attend over about as many keys: the partition of the rows,
    sorted by key length, minimizing sum over groups of (bucket_cost + rows * longest row's keys) (dynamic
    programming). Returns lists of row indices, each in increasing key length, groups in increasing length."""
    order = sorted(range(len(key_lens)), key=key_lens.__getitem__)
    L = [key_lens[i] for i in order]
    best, cut = [0.0], [0]  # best[j]: cost of the first j sorted rows; cut[j]: where its last group starts
    for j in range(1, len(L) + 1):
        c, i = min((best[i] + bucket_cost + (j - i) * L[j - 1], i) for i in range(j))
        best.append(c)
        cut.append(i)
    groups, j = [], len(L)
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


class Group(NamedTuple):
    """One rectangle of the "bucketed" read: rows of one width that attend over about as many keys."""

    index: slice | torch.Tensor  # the rows' tokens in the forward (token-major), a slice where contiguous
    rows: int  # Bg
    width: int  # Tg, queries per row
    slots: torch.Tensor  # (Bg * Sg,) pool slots of each row's key positions 0..Sg-1 (``padded_slots``)
    keys: int  # Sg
    mask: torch.Tensor | None  # (Bg, 1, G * Tg, Sg), or None where every query sees every key


def attend_groups(qt: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, groups, buffers) -> list[torch.Tensor]:
    """The "bucketed" read: per ``Group`` of rows, its keys and values gathered into a rectangle, its queries as
    each KV head's G query rows.

    Args:
        qt: (N, H, D) the forward's queries, token-major; k_pool, v_pool: (slots, Hkv, D) one layer.
        buffers: ``n -> (k_buf, v_buf)`` two (n, Hkv, D) scratch tensors reused across layers.
    Returns: each group's output, (Bg * Tg, H, D), in the order of ``groups``.
    """
    H, D = qt.shape[1], qt.shape[2]
    Hkv = k_pool.shape[1]
    outs = []
    for index, Bg, Tg, slots, Sg, mask in groups:
        buf_k, buf_v = buffers(Bg * Sg)
        torch.index_select(k_pool, 0, slots, out=buf_k)
        torch.index_select(v_pool, 0, slots, out=buf_v)
        kg = buf_k.view(Bg, Sg, Hkv, D).transpose(1, 2)  # (Bg, Hkv, Sg, D)
        vg = buf_v.view(Bg, Sg, Hkv, D).transpose(1, 2)
        qg = qt[index].view(Bg, Tg, H, D).transpose(1, 2).reshape(Bg, Hkv, (H // Hkv) * Tg, D)  # (Bg, Hkv, G*Tg, D)
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask)  # (Bg, Hkv, G*Tg, D)
        outs.append(out.view(Bg, H, Tg, D).transpose(1, 2).reshape(Bg * Tg, H, D))
    return outs


class FastPagedKVCache(PagedKVCache):
    """``PagedKVCache`` with the speed layer's reads; same arguments, ``attention`` one of ``PATHS``."""

    PATHS = ("bucketed", "indexed", "fused")
    FLAT_PATHS = ("bucketed", "fused")

    def __init__(self, config, num_blocks=None, block_size=16, *, attention="bucketed", **kwargs):
        super().__init__(config, num_blocks, block_size, attention=attention, **kwargs)
        dtype, device = self.k[0].dtype, self.k[0].device
        self.fused_max_queries = FUSED_MAX_QUERIES  # 0: the "bucketed" path never takes the fused kernel
        # the fused kernel reads float32 pools in host memory, 8 floats of a head at a time; asked here, so that
        # its first build (once per machine) happens when the engine is made, not in a request
        self._fused_ok = (attention in self.FLAT_PATHS and dtype == torch.float32 and device.type == "cpu"
                          and config.head_dim % 8 == 0 and kernels.available())
        self._rope_write_ok = self._fused_ok and config.head_dim % 16 == 0  # rope_write: each half in 8-float lanes
        self._buf_k = self._buf_v = None  # the "indexed" path's (B * S, Hkv, D) buffers, grown as needed

    def _plan_read(self, pos: list[list[int]]) -> None:
        """Per row, the slot of every key position 0..S-1 ("indexed"), or the groups of rows with their read slots
        and masks and the fused kernel's rows ("bucketed", "fused")."""
        device = self.k[0].device
        self._groups, self._fused = [], None
        if self.attention == "indexed":
            self._read_slots = padded_slots(self._tables, self._lens, self._S, self.block_size, device)
        elif self.attention == "fused":
            if self._fused_ok and min(map(min, pos)) >= 0:
                self._fused = self._plan_fused(range(len(pos)), pos)
            else:  # padding, or no kernel: the library's online softmax in torch
                self._plan_blockwise(pos)
        else:
            self._plan_groups(pos)

    def _plan_fused(self, rows, pos: list[list[int]]):
        """The fused kernel's inputs for these rows (each a segment of consecutive positions without padding):
        block tables (padded with their first block), where each row's queries start, how many, keys held."""
        device = self.k[0].device
        return (padded_tables([self._tables[b] for b in rows], device),
                torch.tensor([self._offsets[b] for b in rows], device=device),
                torch.tensor([len(pos[b]) for b in rows], device=device),
                torch.tensor([pos[b][-1] + 1 for b in rows], device=device))

    def _plan_groups(self, pos: list[list[int]]) -> None:
        """The "bucketed" groups (``Group``), rows of one width together; rows of at most ``fused_max_queries`` go
        to the fused kernel."""
        device, G = self.k[0].device, self.group
        key_lens = [max(max(row) + 1, 1) for row in pos]  # causal: a row attends up to its last position
        by_width: dict[int, list[int]] = {}
        fused = []
        for b, row in enumerate(pos):
            if self._fused_ok and len(row) <= self.fused_max_queries and min(row) >= 0:
                fused.append(b)
            else:
                by_width.setdefault(len(row), []).append(b)
        self._fused = self._plan_fused(fused, pos) if fused else None
        for T, members in sorted(by_width.items()):
            for part in buckets([key_lens[b] for b in members], BUCKET_COST):
                rows = [members[i] for i in part]
                tables, lens = [self._tables[b] for b in rows], [key_lens[b] for b in rows]
                Sg = lens[-1]
                mask = None  # every row one query at the position of its last key: nothing to mask
                if T > 1 or any(n != Sg for n in lens):
                    qpos = torch.tensor([pos[b] for b in rows], dtype=torch.long, device=device)  # (Bg, T)
                    mask = attention_mask(qpos, torch.arange(Sg, device=device))  # (Bg, 1, T, Sg)
                    if T > 1:
                        mask = mask.repeat(1, 1, G, 1)  # (Bg, 1, G*T, Sg): query row g*T + t is position t
                tokens = [self._offsets[b] + t for b in rows for t in range(T)]
                contiguous = tokens == list(range(tokens[0], tokens[0] + len(tokens)))
                index = slice(tokens[0], tokens[-1] + 1) if contiguous else torch.tensor(tokens, device=device)
                slots = padded_slots(tables, lens, Sg, self.block_size, device)
                self._groups.append(Group(index, len(rows), T, slots, Sg, mask))
        stops = [0] + [g.index.stop for g in self._groups if isinstance(g.index, slice)]
        # groups that are slices, each starting where the previous one stops, tile the tokens in order
        self._groups_in_order = (not fused and len(stops) == len(self._groups) + 1
                                 and all(g.index.start == stops[i] for i, g in enumerate(self._groups)))

    def _buffers(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two (n, Hkv, D) views of the read buffers, grown (to twice the need) when too small."""
        if self._buf_k is None or self._buf_k.shape[0] < n:
            self._buf_k = like.new_empty((2 * n, self.n_kv_heads, self.head_dim))
            self._buf_v = like.new_empty((2 * n, self.n_kv_heads, self.head_dim))
        return self._buf_k[:n], self._buf_v[:n]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """"indexed": write k, v (B, Hkv, T, D), then every row's keys and values at positions 0..S-1 as views
        (B, Hkv, S, D) of a buffer that the next layer's ``update`` overwrites.

        Raises:
            ValueError: on a path that attends itself (``attend``).
        """
        if self.attention != "indexed":
            raise ValueError(f"attention: the {self.attention!r} cache attends itself; call attend(layer, q, k, v, "
                             "mask)")
        B, Hkv, T, D = k.shape
        self._write(layer, k, v)
        buf_k, buf_v = self._buffers(B * self._S, k)
        out = []
        for pool, buf in ((self.k[layer], buf_k), (self.v[layer], buf_v)):
            torch.index_select(pool.view(-1, Hkv, D), 0, self._read_slots, out=buf)
            out.append(buf.view(B, self._S, Hkv, D).transpose(1, 2))  # (B, Hkv, S, D)
        return out[0], out[1]

    def attend(self, layer, q, k, v, mask):
        if self.attention == "indexed":
            return attention(q, *self.update(layer, k, v), mask)
        if self.attention == "fused" and self._fused is None:
            return self._attend_blockwise(layer, q, k, v)  # planned as "blockwise"
        B, H, T, D = q.shape
        self._write(layer, k, v)
        qt = q.transpose(1, 2).reshape(B * T, H, D).contiguous()  # (B*T, H, D): a group's queries in one piece
        return self._attend_written(layer, qt).view(B, T, H, D).transpose(1, 2)

    @property
    def takes_qkv(self) -> bool:
        """Whether ``attend_qkv`` may take this forward: the kernels are built, the pool is float32 on the CPU,
        every token is written (no padding) and the read is the kernel's or the groups'."""
        return self._rope_write_ok and self._write_index is None and (self.attention != "fused" or
                                                                     self._fused is not None)

    def attend_qkv(self, layer: int, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``attend`` from the fused QKV product's output (B, T, (H + 2 Hkv) D), RoPE not yet applied: one kernel
        (``kernels.rope_write``) rotates q and k and writes k and v at the prepared slots. Returns (B, T, H D)."""
        B, T, _ = qkv.shape
        cos, sin = (t.expand(B, 1, T, self.head_dim).reshape(B * T, self.head_dim) for t in rope)
        qt = kernels.rope_write(qkv.reshape(B * T, -1), cos, sin, self.k[layer], self.v[layer], self._write_slots)
        return self._attend_written(layer, qt).reshape(B, T, -1)

    def _attend_written(self, layer: int, qt: torch.Tensor) -> torch.Tensor:
        """Attention of the queries qt (B*T, H, D), this layer's new keys and values already in the pool."""
        N, H, D = qt.shape
        y = None if self._fused is None else kernels.paged_attention(qt, self.k[layer], self.v[layer], *self._fused)
        if self._groups:
            k_pool, v_pool = self.k[layer].view(-1, self.n_kv_heads, D), self.v[layer].view(-1, self.n_kv_heads, D)
            outs = attend_groups(qt, k_pool, v_pool, self._groups, lambda n: self._buffers(n, qt))
            if self._groups_in_order:
                y = outs[0] if len(outs) == 1 else torch.cat(outs)
            else:
                y = qt.new_empty((N, H, D)) if y is None else y  # the fused kernel's rows are already there
                for group, out in zip(self._groups, outs):
                    y[group.index] = out
        return y


def register() -> None:
    """Make the speed layer's reads known to the engine (``minillm.paged.cache.BACKENDS``)."""
    for name in FastPagedKVCache.PATHS:
        BACKENDS[name] = FastPagedKVCache


register()  # loading the speed layer makes its reads known (accelerate registers them again, harmlessly)
