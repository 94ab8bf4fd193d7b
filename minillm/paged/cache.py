"""PagedKVCache: keys and values in a pool of fixed-size blocks behind ``minillm.kv_cache``'s interface
(``prepare``, ``update`` or ``attend``, ``truncate``), so ``Decoder.forward`` runs on it unchanged.

Kwon et al. 2023 (vLLM, arXiv 2309.06180), Sec. 4.1 and 4.3. Per layer one key and one value tensor
(num_blocks, block_size, Hkv, D), so slot = block * block_size + offset: the new tokens are written by one
``index_copy_`` at their slot_mapping (or by ``kernels.rope_write``, which applies RoPE too), and
``attention.py`` reads them. Row b of a forward belongs to sequence ``rows[b]``, or the forward is one flat
row cut into segments (``set_rows``). Every row is written before any row attends, so several rows of one
sequence (a prefill in chunks, a verified draft) see what an earlier one wrote.
"""

from __future__ import annotations

import itertools

import torch

from .. import kernels
from ..kv_cache import kv_cache_bytes
from ..model import ModelConfig, attention_mask
from .attention import attend_blockwise, attend_groups, buckets, gather_padded, padded_slots, padded_tables
from .block_manager import BlockManager

ATTENTION_PATHS = ("bucketed", "blockwise", "indexed", "gather")
FLAT_PATHS = ("bucketed", "blockwise")  # the paths that attend themselves, over a flat row's segments too
#: what one more group costs the "bucketed" path (an index_select and an SDPA call per layer), in key positions
BUCKET_COST = 128
#: on the "bucketed" path, segments of at most this many queries (a decode row, a verification of up to 4 drafts)
#: go to minillm's fused PagedAttention kernel where it is built; longer ones gain more from SDPA (docs/paged.md)
FUSED_MAX_QUERIES = 5


class PagedKVCache:
    """A pool of KV blocks with a ``BlockManager``; a cache for ``Decoder.forward``.

    Args:
        config: the model's config (layers, Hkv, D).
        num_blocks: physical blocks, or None to size the pool by ``kv_bytes`` (bytes of keys and values for
            the whole pool, rounded down to whole blocks). block_size: tokens per block.
        dtype, device: of the pool (normally the model's). enable_prefix_caching: the ``BlockManager``'s.
        attention: how the forward reads the pool (``attention.py``): "indexed" (default here), "gather"
            (the reference), "bucketed" or "blockwise" (these two attend themselves, take a flat row and run
            minillm's fused kernel where it is built: "blockwise" for every row, "bucketed" for short ones).

    Raises:
        ValueError: neither or both of num_blocks / kv_bytes, a pool smaller than one block, an
            unknown attention path.
    """

    serves_ragged_batch = True  # Decoder.forward accepts (B, T) input_pos with this cache

    def __init__(self, config: ModelConfig, num_blocks: int | None = None, block_size: int = 16, *,
                 kv_bytes: float | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", enable_prefix_caching: bool = True,
                 attention: str = "indexed"):
        if (num_blocks is None) == (kv_bytes is None):
            raise ValueError("num_blocks / kv_bytes: give exactly one of them to size the pool")
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention: {attention!r} is not one of {ATTENTION_PATHS}")
        block_bytes = kv_cache_bytes(config, 1, block_size, dtype.itemsize)
        if kv_bytes is not None:
            num_blocks = int(kv_bytes // block_bytes)
            if num_blocks < 1:
                raise ValueError(f"kv_bytes: {kv_bytes:.0f} bytes hold no block; one block of {block_size} tokens "
                                 f"takes {block_bytes:.0f} bytes over {config.n_layers} layers, give at least that")
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.block_size, self.attention = block_size, attention
        self.fused_max_queries = FUSED_MAX_QUERIES  # 0: the "bucketed" path never takes the fused kernel
        # the fused kernel reads float32 pools in host memory, 8 floats of a head at a time; asked here, so that
        # its first build (once per machine) happens when the engine is made, not in a request
        self._fused_ok = (attention in FLAT_PATHS and dtype == torch.float32 and torch.device(device).type == "cpu"
                          and config.head_dim % 8 == 0 and kernels.available())
        self._rope_write_ok = self._fused_ok and config.head_dim % 16 == 0  # rope_write: each half in 8-float lanes
        self.n_kv_heads, self.head_dim = config.n_kv_heads, config.head_dim
        self.group = config.n_heads // config.n_kv_heads  # query heads per KV head (GQA)
        shape = (num_blocks, block_size, config.n_kv_heads, config.head_dim)
        # one tensor per layer (as KVCache): a layer's write never touches another layer's memory
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.rows: list[int] = []
        self.widths: list[int] | None = None  # set_rows: segment widths of a flat row, or None for (B, T)
        self.reserved = False  # set_rows: whether the rows' slots were reserved before the forward (the engine)
        self._buf_k = self._buf_v = None  # the "indexed" path's (B * S, Hkv, D) buffers, grown as needed

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def attends(self) -> bool:
        """Whether ``Attention.forward`` hands this cache its queries (``attend``) rather than asking for keys
        and values (``update``)."""
        return self.attention in FLAT_PATHS

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (every block, used or not)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def seq_len(self) -> int:
        """The longest sequence among the rows (what the next forward attends over)."""
        return max((self.manager.num_tokens(s) for s in self.rows), default=0)

    # ---- sequences (the block manager, with copy-on-write performed on the pool) -------------------
    def add_sequence(self, seq_id: int, token_ids=()) -> int:
        """``BlockManager.allocate``: returns num_computed_tokens (served from the prefix cache). The forwards must
        then write these tokens at these positions: full blocks are named in the prefix cache by them."""
        return self.manager.allocate(seq_id, token_ids)

    def fork(self, parent_id: int, child_id: int) -> None:
        self.manager.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        self.manager.free(seq_id)
        if self.widths is not None:  # a flat row's segments go with their sequences
            self.widths = [w for s, w in zip(self.rows, self.widths) if s != seq_id]
        self.rows = [s for s in self.rows if s != seq_id]

    def set_rows(self, seq_ids, widths=None, reserved: bool = False) -> None:
        """Row b of the next forwards belongs to sequence ``seq_ids[b]`` (ids may repeat).

        Args:
            seq_ids: the sequence of each row (or of each segment of a flat row).
            widths: None for rectangular (B, T) forwards; else the forwards are one flat row (1, N) of sum(widths)
                tokens, its first widths[0] tokens "row" 0, and so on ("bucketed" and "blockwise" only).
            reserved: the rows' positions already have slots (``BlockManager.grow``), so ``prepare`` takes
                no block and truncates nothing.

        Raises:
            UnknownSequenceError: an id the manager does not hold.
            ValueError: widths of another length than seq_ids, a width below 1, or widths on a path that does
                not attend itself.
        """
        seq_ids = list(seq_ids)
        for s in seq_ids:
            self.manager.num_tokens(s)
        if widths is not None:
            widths = list(widths)
            if self.attention not in FLAT_PATHS:
                raise ValueError(f"widths: a flat row of segments needs attention='bucketed' or 'blockwise', not "
                                 f"{self.attention!r}")
            if len(widths) != len(seq_ids) or min(widths, default=1) < 1:
                raise ValueError(f"widths: need one width >= 1 per sequence ({len(seq_ids)}), got {widths}")
        self.rows, self.widths, self.reserved = seq_ids, widths, reserved

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block in every layer (copy-on-write)."""
        for src, dst in copies:
            for t in self.k + self.v:
                t[dst] = t[src]

    # ---- the cache interface -------------------------------------------------------------------
    def prepare(self, input_pos: torch.Tensor) -> int:
        """Take slots for the positions about to be written and plan this forward's reads; returns S, the key
        positions the forward attends over. input_pos: (T,) shared by every row, or (B, T), -1 for padding.
        Writing below a sequence's length first truncates it there (as ``KVCache.prepare``).

        Raises:
            ValueError: no rows set, a row count different from B, positions that are not consecutive, leave a
                gap, or overlap an earlier row of the same sequence.
            NoFreeBlocksError: too few free blocks for all rows; nothing is changed.
        """
        if not self.rows:
            raise ValueError("rows: no sequences set; call set_rows(seq_ids) before the forward")
        B = len(self.rows)
        pos = input_pos.tolist()
        if self.widths is not None:  # one flat row: cut it into the segments set_rows gave
            N = sum(self.widths)
            if input_pos.dim() != 2 or input_pos.shape != (1, N):
                raise ValueError(f"input_pos: a flat row of {B} segments ({N} tokens) needs shape (1, {N}), got "
                                 f"{tuple(input_pos.shape)}")
            ends = list(itertools.accumulate(self.widths))
            pos = [pos[0][e - w:e] for e, w in zip(ends, self.widths)]
        pos = [pos] * B if input_pos.dim() == 1 else pos
        if len(pos) != B:
            raise ValueError(f"input_pos: {len(pos)} rows of positions for {B} rows set by set_rows")
        spans: dict[int, tuple[int, int]] = {}  # sequence -> (start, end) written in this forward
        for b, (seq, row) in enumerate(zip(self.rows, pos)):
            real = [p for p in row if p >= 0]
            if not real:
                continue
            start, end = real[0], real[-1] + 1
            if end - start != len(real):
                raise ValueError(f"input_pos: row {b}'s positions must be consecutive, got {start}..{end - 1} for "
                                 f"{len(real)} tokens")
            if seq in spans:
                if start != spans[seq][1]:
                    raise ValueError(f"input_pos: row {b} of sequence {seq} starts at {start}, not where its previous "
                                     f"row ends ({spans[seq][1]}); give one sequence's rows in position order")
                spans[seq] = (spans[seq][0], end)
            else:
                if start > self.manager.num_tokens(seq):
                    raise ValueError(f"input_pos: row {b} starts at {start} but sequence {seq} holds only "
                                     f"{self.manager.num_tokens(seq)} positions; write the positions in between first")
                spans[seq] = (start, end)
        if self.reserved:
            short = [s for s, (_, e) in spans.items() if e > self.manager.num_tokens(s)]
            if short:
                raise ValueError(f"input_pos: sequence {short[0]} writes past the slots reserved for it "
                                 f"({self.manager.num_tokens(short[0])}); reserve them with BlockManager.grow")
            spans = {}
        self.manager.pool.check_free(sum(self.manager.blocks_needed(s, a, e) for s, (a, e) in spans.items()))
        for seq, (start, end) in spans.items():
            if start < self.manager.num_tokens(seq):
                self.manager.truncate(seq, start)
            self.copy_blocks(self.manager.grow(seq, end))
        self._plan(pos)
        return self._S

    def _plan(self, pos: list[list[int]]) -> None:
        """This forward's write slots and, per row, the slot of every key position 0..S-1 ("indexed"), or
        the groups of rows with their read slots and masks ("bucketed")."""
        device = self.k[0].device
        lens = [self.manager.num_tokens(s) for s in self.rows]
        if min(lens) == 0:
            raise ValueError(f"rows: sequence {self.rows[lens.index(0)]} holds no tokens; give each row at least one")
        self._offsets = [0, *itertools.accumulate(len(row) for row in pos)][:-1]  # where each row starts in B * T
        write_slots, write_index = [], []
        for seq, row, offset in zip(self.rows, pos, self._offsets):
            real = [(t, p) for t, p in enumerate(row) if p >= 0]
            write_slots += self.manager.slot_mapping(seq, [p for _, p in real])
            write_index += [offset + t for t, _ in real]
        self._write_slots = torch.tensor(write_slots, dtype=torch.long, device=device)
        n_entries = sum(len(row) for row in pos)
        self._write_index = (None if len(write_index) == n_entries
                             else torch.tensor(write_index, dtype=torch.long, device=device))
        self._S = S = max(lens)
        self._tables = [self.manager.block_table(s) for s in self.rows]
        self._lens = lens
        if self.attention == "indexed":
            self._read_slots = padded_slots(self._tables, lens, S, self.block_size, device)
        elif self.attention == "blockwise":
            self._plan_blockwise(pos)
        elif self.attention == "bucketed":
            self._plan_groups(pos)

    def _plan_fused(self, rows: list[int], pos: list[list[int]]):
        """The fused kernel's inputs for these rows (each a segment of consecutive positions without padding):
        block tables (padded with their first block), where each row's queries start, how many, keys held."""
        device = self.k[0].device
        return (padded_tables([self._tables[b] for b in rows], device),
                torch.tensor([self._offsets[b] for b in rows], device=device),
                torch.tensor([len(pos[b]) for b in rows], device=device),
                torch.tensor([pos[b][-1] + 1 for b in rows], device=device))

    def _plan_blockwise(self, pos: list[list[int]]) -> None:
        """The "blockwise" inputs: every row through the fused kernel where it is built and no row is padded;
        else, for the online softmax in torch, per row its block table (padded with its first block), its
        length, its queries' positions padded to the longest row (-1) and their tokens in the forward."""
        device, self._groups = self.k[0].device, []
        self._fused = self._plan_fused(range(len(pos)), pos) if self._fused_ok and min(map(min, pos)) >= 0 else None
        if self._fused is not None:
            return
        T, N = max(len(row) for row in pos), sum(len(row) for row in pos)
        self._bw_tables = padded_tables(self._tables, device)
        self._bw_lens = torch.tensor(self._lens, device=device)
        self._bw_pos = torch.tensor([row + [-1] * (T - len(row)) for row in pos], device=device)
        self._bw_index = torch.tensor([[o + t if t < len(row) and row[t] >= 0 else N for t in range(T)]
                                       for row, o in zip(pos, self._offsets)], device=device)

    def _plan_groups(self, pos: list[list[int]]) -> None:
        """The "bucketed" groups, rows of one width together: (the rows' tokens, as a slice or an index tensor;
        rows Bg; width T_g; read slots; S_g; mask); rows of at most ``fused_max_queries`` go to the fused kernel."""
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
        self._groups = []
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
                self._groups.append((index, len(rows), T, slots, Sg, mask))
        stops = [0] + [g[0].stop for g in self._groups if isinstance(g[0], slice)]
        # groups that are slices, each starting where the previous one stops, tile the tokens in order
        self._groups_in_order = (not fused and len(stops) == len(self._groups) + 1
                                 and all(g[0].start == stops[i] for i, g in enumerate(self._groups)))

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this layer's new k, v (B, Hkv, T, D) at the prepared slots (padding is not written)."""
        B, Hkv, T, D = k.shape
        for pool, new in ((self.k[layer], k), (self.v[layer], v)):
            new = new.transpose(1, 2).reshape(B * T, Hkv, D)  # (B*T, Hkv, D): one entry per token
            if self._write_index is not None:
                new = new[self._write_index]
            pool.view(-1, Hkv, D).index_copy_(0, self._write_slots, new)

    def _buffers(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two (n, Hkv, D) views of the read buffers, grown (to twice the need) when too small."""
        if self._buf_k is None or self._buf_k.shape[0] < n:
            self._buf_k = like.new_empty((2 * n, self.n_kv_heads, self.head_dim))
            self._buf_v = like.new_empty((2 * n, self.n_kv_heads, self.head_dim))
        return self._buf_k[:n], self._buf_v[:n]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new k, v (B, Hkv, T, D) at the prepared slots; return every row's keys and values
        at positions 0..S-1, (B, Hkv, S, D) (past a row's length, its last repeated). On "indexed" these are
        views of a buffer that the next layer's ``update`` overwrites.

        Raises:
            ValueError: on a path that attends itself (``attend``).
        """
        if self.attends:
            raise ValueError(f"attention: the {self.attention!r} cache attends itself; call attend(layer, q, k, v)")
        B, Hkv, T, D = k.shape
        self._write(layer, k, v)
        if self.attention == "gather":
            return (gather_padded(self.k[layer], self._tables, self._lens, self._S),
                    gather_padded(self.v[layer], self._tables, self._lens, self._S))
        n = B * self._S
        buf_k, buf_v = self._buffers(n, k)
        out = []
        for pool, buf in ((self.k[layer], buf_k), (self.v[layer], buf_v)):
            torch.index_select(pool.view(-1, Hkv, D), 0, self._read_slots, out=buf)
            out.append(buf.view(B, self._S, Hkv, D).transpose(1, 2))  # (B, Hkv, S, D)
        return out[0], out[1]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this layer's new k, v (B, Hkv, T, D), then attend: q (B, H, T, D) -> (B, H, T, D), what
        ``minillm.model.attention(q, *update(layer, k, v), mask)`` gives. For a flat row (B = 1) each segment
        attends over its own sequence's keys."""
        B, H, T, D = q.shape
        self._write(layer, k, v)
        qt = q.transpose(1, 2).reshape(B * T, H, D).contiguous()  # (B*T, H, D): a group's queries in one piece
        return self._attend_written(layer, qt).view(B, T, H, D).transpose(1, 2)

    @property
    def takes_qkv(self) -> bool:
        """Whether ``Attention.forward`` may hand this forward's fused QKV product to ``attend_qkv``: minillm's
        kernels are built, the pool is float32 on the CPU, and every token is written (no padding)."""
        return self._rope_write_ok and self._write_index is None

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
        if self.attention == "blockwise" and self._fused is None:
            return attend_blockwise(qt, self.k[layer], self.v[layer], self._bw_tables, self._bw_lens, self._bw_pos,
                                    self._bw_index)
        y = None if self._fused is None else kernels.paged_attention(qt, self.k[layer], self.v[layer], *self._fused)
        if self._groups:
            k_pool, v_pool = self.k[layer].view(-1, self.n_kv_heads, D), self.v[layer].view(-1, self.n_kv_heads, D)
            outs = attend_groups(qt, k_pool, v_pool, self._groups, lambda n: self._buffers(n, qt))
            if self._groups_in_order:
                y = outs[0] if len(outs) == 1 else torch.cat(outs)
            else:
                y = qt.new_empty((N, H, D)) if y is None else y  # the fused kernel's rows are already there
                for group, out in zip(self._groups, outs):
                    y[group[0]] = out
        return y

    def truncate(self, n: int) -> None:
        """Cut every row's sequence to its first n positions (rolling back rejected tokens).

        Raises:
            ValueError: n negative or larger than a row's sequence.
        """
        for seq in dict.fromkeys(self.rows):
            self.manager.truncate(seq, n)
