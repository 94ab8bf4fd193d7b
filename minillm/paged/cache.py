"""PagedKVCache: keys and values in a pool of fixed-size blocks behind ``minillm.kv_cache``'s interface
(``prepare``, ``attend``, ``truncate``), so ``Decoder.forward`` runs on it unchanged.

Kwon et al. 2023 (vLLM, arXiv 2309.06180), Sec. 4.1 and 4.3. Per layer one key and one value tensor
(num_blocks, block_size, Hkv, D), so slot = block * block_size + offset: the new tokens are written by one
``index_copy_`` at their slot_mapping, and ``attention.py`` reads them: "blockwise" (the default: block by
block with an online softmax, nothing gathered) or "gather" (the reference: each row's blocks concatenated,
then SDPA). Row b of a forward belongs to sequence ``rows[b]``, or the forward is one flat row cut into
segments (``set_rows``). Every row is written before any row attends, so several rows of one sequence (a
prefill in chunks, a verified draft) see what an earlier one wrote. The speed layer (``minillm.fast.paged``)
adds reads of its own to ``BACKENDS``.
"""

from __future__ import annotations

import itertools

import torch

from ..kv_cache import kv_cache_bytes
from ..config import ModelConfig
from ..model import attention
from .attention import attend_blockwise, gather_padded, padded_tables
from .block_manager import BlockManager


class PagedKVCache:
    """A pool of KV blocks with a ``BlockManager``; a cache for ``Decoder.forward``.

    Args:
        config: the model's config (layers, Hkv, D).
        num_blocks: physical blocks, or None to size the pool by ``kv_bytes`` (bytes of keys and values for
            the whole pool, rounded down to whole blocks). block_size: tokens per block.
        dtype, device: of the pool (normally the model's). enable_prefix_caching: the ``BlockManager``'s.
        attention: how the forward reads the pool (``attention.py``): "blockwise" (block by block with an
            online softmax; takes a flat row of segments) or "gather" (the reference: rectangular rows only).

    Raises:
        ValueError: neither or both of num_blocks / kv_bytes, a pool smaller than one block, an
            unknown attention path.
    """

    PATHS = ("blockwise", "gather")  # the reads this class implements
    FLAT_PATHS = ("blockwise",)  # those that take a flat row cut into segments (set_rows' widths)

    def __init__(self, config: ModelConfig, num_blocks: int | None = None, block_size: int = 16, *,
                 kv_bytes: float | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", enable_prefix_caching: bool = True,
                 attention: str = "blockwise"):
        if (num_blocks is None) == (kv_bytes is None):
            raise ValueError("num_blocks / kv_bytes: give exactly one of them to size the pool")
        if attention not in self.PATHS:
            raise ValueError(f"attention: {attention!r} is not one of {self.PATHS}")
        block_bytes = kv_cache_bytes(config, 1, block_size, dtype.itemsize)
        if kv_bytes is not None:
            num_blocks = int(kv_bytes // block_bytes)
            if num_blocks < 1:
                raise ValueError(f"kv_bytes: {kv_bytes:.0f} bytes hold no block; one block of {block_size} tokens "
                                 f"takes {block_bytes:.0f} bytes over {config.n_layers} layers, give at least that")
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.block_size, self.attention = block_size, attention
        self.n_kv_heads, self.head_dim = config.n_kv_heads, config.head_dim
        self.group = config.n_heads // config.n_kv_heads  # query heads per KV head (GQA)
        shape = (num_blocks, block_size, config.n_kv_heads, config.head_dim)
        # one tensor per layer (as KVCache): a layer's write never touches another layer's memory
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.rows: list[int] = []
        self.widths: list[int] | None = None  # set_rows: segment widths of a flat row, or None for (B, T)
        self.reserved = False  # set_rows: whether the rows' slots were reserved before the forward (the engine)

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

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
                tokens, its first widths[0] tokens "row" 0, and so on (the ``FLAT_PATHS`` only).
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
            if self.attention not in self.FLAT_PATHS:
                raise ValueError(f"widths: a flat row of segments needs attention in {self.FLAT_PATHS}, not "
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
        """This forward's write slots, each row's block table and length, and the read's inputs
        (``_plan_read``)."""
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
        self._S = max(lens)
        self._tables = [self.manager.block_table(s) for s in self.rows]
        self._lens = lens
        self._plan_read(pos)

    def _plan_read(self, pos: list[list[int]]) -> None:
        """The read's inputs ("gather" needs none)."""
        if self.attention == "blockwise":
            self._plan_blockwise(pos)

    def _plan_blockwise(self, pos: list[list[int]]) -> None:
        """The "blockwise" read's inputs: per row its block table (padded with its first block), its length, its
        queries' positions padded to the longest row (-1) and their tokens in the forward."""
        device = self.k[0].device
        T, N = max(len(row) for row in pos), sum(len(row) for row in pos)
        self._bw_tables = padded_tables(self._tables, device)
        self._bw_lens = torch.tensor(self._lens, device=device)
        self._bw_pos = torch.tensor([row + [-1] * (T - len(row)) for row in pos], device=device)
        self._bw_index = torch.tensor([[o + t if t < len(row) and row[t] >= 0 else N for t in range(T)]
                                       for row, o in zip(pos, self._offsets)], device=device)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this layer's new k, v (B, Hkv, T, D) at the prepared slots (padding is not written)."""
        B, Hkv, T, D = k.shape
        for pool, new in ((self.k[layer], k), (self.v[layer], v)):
            new = new.transpose(1, 2).reshape(B * T, Hkv, D)  # (B*T, Hkv, D): one entry per token
            if self._write_index is not None:
                new = new[self._write_index]
            pool.view(-1, Hkv, D).index_copy_(0, self._write_slots, new)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new k, v (B, Hkv, T, D) at the prepared slots; return every row's keys and values
        at positions 0..S-1, (B, Hkv, S, D), gathered through the block tables (past a row's length, its last
        repeated): the "gather" read."""
        self._write(layer, k, v)
        return (gather_padded(self.k[layer], self._tables, self._lens, self._S),
                gather_padded(self.v[layer], self._tables, self._lens, self._S))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Write this layer's new k, v (B, Hkv, T, D), then attend: q (B, H, T, D) -> (B, H, T, D). "gather" is
        ``minillm.model.attention(q, *update(layer, k, v), mask)``; "blockwise" reads the pool block by block
        (``attention.paged_attention``), each row (or segment of a flat row, B = 1) over its own sequence's keys,
        and needs no mask."""
        if self.attention == "gather":
            return attention(q, *self.update(layer, k, v), mask)
        return self._attend_blockwise(layer, q, k, v)

    def _attend_blockwise(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, T, D = q.shape
        self._write(layer, k, v)
        qt = q.transpose(1, 2).reshape(B * T, H, D)  # (B*T, H, D): the forward's queries, token-major
        y = attend_blockwise(qt, self.k[layer], self.v[layer], self._bw_tables, self._bw_lens, self._bw_pos,
                             self._bw_index)
        return y.view(B, T, H, D).transpose(1, 2)

    def truncate(self, n: int) -> None:
        """Cut every row's sequence to its first n positions (rolling back rejected tokens).

        Raises:
            ValueError: n negative or larger than a row's sequence.
        """
        for seq in dict.fromkeys(self.rows):
            self.manager.truncate(seq, n)


#: the engine's reads of the pool, by name: the cache class that implements each (``minillm.fast.paged`` adds its own)
BACKENDS: dict[str, type[PagedKVCache]] = {"blockwise": PagedKVCache, "gather": PagedKVCache}


def backend(name: str) -> type[PagedKVCache]:
    """The cache class of the read ``name``.

    Raises:
        ValueError: a name no loaded layer registers, saying which are known.
    """
    if name not in BACKENDS:
        raise ValueError(f"attention: {name!r} is not one of {sorted(BACKENDS)}; the speed layer's reads "
                         "(\"bucketed\", \"indexed\", \"fused\") register when minillm.fast is loaded "
                         "(load_model(fast=True))")
    return BACKENDS[name]
