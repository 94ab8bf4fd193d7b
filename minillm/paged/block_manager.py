"""The block manager of PagedAttention: one block table per sequence, copy-on-write after a fork.

Kwon et al. 2023 (vLLM, arXiv 2309.06180), Sec. 4.1-4.2 (logical blocks map to physical ones through
the block table) and Sec. 4.4 (samples and beams share blocks by reference; the first write into a shared
block copies it), over a ``BlockPool`` (free queue, reference counts) and a ``PrefixCache``.

One rule: ``blocks_for(n) = ceil(n / block_size)``. ``grow(n)`` takes blocks until the sequence holds
``blocks_for(n)``; ``truncate(n)`` and ``free`` give back the rest. No tensors: it returns the copies for the
KV pool to make, and reads each sequence's known tokens from the sequence's own list (one ledger).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

from .block_pool import BlockPool, NoFreeBlocksError
from .prefix_cache import PrefixCache, hash_block_tokens

__all__ = ["BlockManager", "DoubleFreeError", "NoFreeBlocksError", "UnknownSequenceError", "blocks_for"]

# freed sequence ids remembered for ``DoubleFreeError``: the latest ones only, so that an engine serving for days
# holds nothing for the millions of sequences it ended
RECENTLY_FREED = 1024


class UnknownSequenceError(ValueError):
    """A sequence id the manager does not hold."""


class DoubleFreeError(ValueError):
    """``free`` called again on a sequence that was already freed."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


@dataclass
class _SeqBlocks:
    """What the manager holds for one sequence (``BlockManager._seqs[seq_id]``)."""

    table: list[int]  # its block_table: logical block i -> physical block
    num_tokens: int  # positions that have slots
    token_ids: list[int]  # its known tokens (the sequence's own list): they name its full blocks in the prefix cache
    block_hashes: list[int]  # prefix-cache keys of the leading full blocks with known tokens


class BlockManager:
    """Each sequence's block table over a ``BlockPool`` of physical KV blocks.

    Args:
        num_blocks: physical blocks in the pool (at least 1). block_size: tokens per block (at least 1).
        enable_prefix_caching: keep full blocks findable by their tokens, also after their sequence ends.
        hash_fn: the prefix cache's key of a full block (``hash_block_tokens``).

    Raises:
        ValueError: num_blocks or block_size below 1.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 hash_fn: Callable[[int | None, tuple[int, ...]], int] = hash_block_tokens):
        if block_size < 1:
            raise ValueError(f"block_size: must be at least 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache = PrefixCache(num_blocks, block_size, hash_fn)
        self.stats = self.prefix_cache.stats  # a PrefixCacheStats
        self.ref_counts = self.pool.ref_counts  # the pool's own list (it never rebinds it), read by index
        self._seqs: dict[int, _SeqBlocks] = {}
        self._freed: OrderedDict[int, None] = OrderedDict()  # the last RECENTLY_FREED freed ids, oldest first
        self.step_copies: list[tuple[int, int]] = []  # copy-on-write made since begin (a rollback makes them again)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (free cached blocks included: taking one evicts it)."""
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free_blocks

    def free_block_ids(self) -> list[int]:
        """The free blocks in eviction order (the first is taken next)."""
        return self.pool.free_block_ids()

    def holds(self, seq_id: int) -> bool:
        """Whether the sequence is allocated (holds a block table)."""
        return seq_id in self._seqs

    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def block_table(self, seq_id: int) -> list[int]:
        """Physical block of each logical block of the sequence (a copy)."""
        return list(self._seq(seq_id).table)

    def num_tokens(self, seq_id: int) -> int:
        """Positions of the sequence that have slots (written, or about to be in this forward)."""
        return self._seq(seq_id).num_tokens

    def token_ids(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).token_ids)

    def is_cached(self, block: int) -> bool:
        """Whether a prefix lookup can find this block."""
        return block in self.prefix_cache

    def slot_mapping(self, seq_id: int, positions: Iterable[int]) -> list[int]:
        """The pool slot of each position: ``block_table[pos // block_size] * block_size + pos % block_size``.

        Raises:
            ValueError: a position outside ``0..num_tokens-1`` (past the sequence's blocks: ``grow`` first).
        """
        seq, bs = self._seq(seq_id), self.block_size
        table, n = seq.table, seq.num_tokens
        slots = []
        for p in positions:
            if not 0 <= p < n:
                raise ValueError(f"position {p} is past sequence {seq_id}'s {n} tokens ({len(table)} blocks of "
                                 f"{bs}); grow the sequence before writing there")
            slots.append(table[p // bs] * bs + p % bs)
        return slots

    def blocks_needed(self, seq_id: int, start: int, end: int) -> int:
        """Free blocks that writing positions ``start..end-1`` takes after truncating to ``start`` (one more
        when the first write lands in a shared, partly filled block: copy-on-write)."""
        seq, bs = self._seq(seq_id), self.block_size
        n = min(start, seq.num_tokens)
        needed = max(0, blocks_for(end, bs) - blocks_for(n, bs))
        if end > n and n % bs and self.ref_counts[seq.table[n // bs]] > 1:
            needed += 1
        return needed

    # ---- sequence lifecycle --------------------------------------------------------------------
    def allocate(self, seq_id: int, token_ids: Iterable[int] = ()) -> int:
        """Start a sequence whose known tokens are ``token_ids``, reusing the longest cached prefix of full
        blocks (the last token is left to compute, for logits); returns num_computed_tokens. A list is read
        in place, as the sequence's one ledger (the engine appends to it); anything else is copied.

        Raises:
            ValueError: the id is in use, or the prompt needs more blocks than the whole pool has.
        """
        token_ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        if seq_id in self._seqs:
            raise ValueError(f"seq_id: {seq_id} is already allocated; free it first or use another id")
        needed = blocks_for(len(token_ids), self.block_size)
        if needed > self.num_blocks:
            raise ValueError(f"pool too small: {len(token_ids)} tokens need {needed} blocks of {self.block_size} "
                             f"but the pool has {self.num_blocks}; make the pool larger")
        hits = self.prefix_cache.lookup(token_ids) if self.enable_prefix_caching else []
        for block, _ in hits:
            self.pool.incref(block)
        self._freed.pop(seq_id, None)
        self._seqs[seq_id] = _SeqBlocks(table=[b for b, _ in hits], num_tokens=len(hits) * self.block_size,
                                        token_ids=token_ids, block_hashes=[h for _, h in hits])
        return len(hits) * self.block_size

    def add_token_ids(self, seq_id: int, token_ids: Iterable[int]) -> None:
        """Record more known tokens (a sampled token, before the forward that writes its KV)."""
        seq = self._seq(seq_id)
        seq.token_ids.extend(token_ids)
        self._cache_full_blocks(seq)

    def grow(self, seq_id: int, n: int) -> list[tuple[int, int]]:
        """Give the sequence slots for n tokens (``blocks_for(n)`` blocks); returns the (source,
        destination) copies to make before writing (copy-on-write of a shared, partly filled last block).

        Raises:
            ValueError: n below the sequence's ``num_tokens`` (use ``truncate``).
            NoFreeBlocksError: too few free blocks; nothing is changed.
        """
        seq, bs = self._seq(seq_id), self.block_size
        table, cur = seq.table, seq.num_tokens
        if n < cur:
            raise ValueError(f"n: sequence {seq_id} holds {cur} tokens; grow to {n} would shrink it, use truncate")
        self.pool.check_free(self.blocks_needed(seq_id, cur, n))
        copies = []
        if n > cur and cur % bs:
            old = table[cur // bs]
            if self.ref_counts[old] > 1:  # shared: the first write copies it
                new = self._take()
                if self.prefix_cache.in_step:  # between begin and commit: a rollback makes this copy again
                    self.step_copies.append((old, new))
                table[cur // bs] = new
                self.pool.release(old)  # still held by the other tables
                copies.append((old, new))
            else:  # its own: if it is a full cached block cut by truncate, its content changes now
                self.prefix_cache.forget(old)
        while len(table) < blocks_for(n, bs):
            table.append(self._take())
        seq.num_tokens = n
        self._cache_full_blocks(seq)
        return copies

    def truncate(self, seq_id: int, n: int, keep_token_ids: bool = False) -> None:
        """Keep positions ``0..n-1`` (and only the known tokens before n, unless ``keep_token_ids``); the blocks
        past ``blocks_for(n)`` go back to the free queue. Raises ValueError for n outside 0..num_tokens."""
        seq = self._seq(seq_id)
        if not 0 <= n <= seq.num_tokens:
            raise ValueError(f"n: cannot truncate sequence {seq_id} of {seq.num_tokens} tokens to {n}")
        keep = blocks_for(n, self.block_size)
        for block in reversed(seq.table[keep:]):  # last block first
            self._release(block)
        del seq.table[keep:]
        seq.num_tokens = n
        if not keep_token_ids:
            del seq.token_ids[n:]
        del seq.block_hashes[n // self.block_size:]

    def begin(self) -> None:
        """A step starts: the blocks it names wait for ``commit`` (``PrefixCache.begin``); its copies are kept."""
        self.prefix_cache.begin()
        self.step_copies = []

    def commit(self) -> None:
        """The step's forward wrote its blocks: their names hold (``PrefixCache.commit``)."""
        self.prefix_cache.commit()
        self.step_copies = []

    def rollback(self) -> None:
        """The step's forward failed: the blocks it named are no longer findable (``PrefixCache.rollback``)."""
        self.prefix_cache.rollback()
        self.step_copies = []

    def fork(self, parent_id: int, child_id: int, token_ids: list[int] | None = None) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (one more reference each); ``token_ids``:
        the child's own ledger (a list equal to the parent's), or None for a copy.

        Raises:
            UnknownSequenceError: no such parent. ValueError: child_id already in use.
        """
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"child_id: {child_id} is already allocated; fork into a new id")
        for block in parent.table:
            self.pool.incref(block)
        self._freed.pop(child_id, None)
        ledger = list(parent.token_ids) if token_ids is None else token_ids
        self._seqs[child_id] = _SeqBlocks(list(parent.table), parent.num_tokens, ledger, list(parent.block_hashes))

    def free(self, seq_id: int) -> None:
        """End a sequence: each block loses a reference; those left with none return to the free queue.

        Raises:
            DoubleFreeError: the sequence was freed (among the last ``RECENTLY_FREED``). UnknownSequenceError: not
                allocated (never, or freed before those).
        """
        if seq_id in self._freed:
            raise DoubleFreeError(f"seq_id: sequence {seq_id} was already freed; free each sequence once")
        self.truncate(seq_id, 0, keep_token_ids=True)  # the token ids are the sequence's own list: left as they are
        del self._seqs[seq_id]
        self._freed[seq_id] = None
        if len(self._freed) > RECENTLY_FREED:
            self._freed.popitem(last=False)

    # ---- internals -----------------------------------------------------------------------------
    def _seq(self, seq_id: int) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            state = ("was freed" if seq_id in self._freed
                     else f"was never allocated (or was freed before the last {RECENTLY_FREED} frees)")
            raise UnknownSequenceError(f"seq_id: sequence {seq_id} {state}; allocate it first")
        return seq

    def _take(self) -> int:
        """Take the block at the front of the free queue, evicting it from the prefix cache."""
        block = self.pool.take()
        self.prefix_cache.taken(block)
        return block

    def _release(self, block: int) -> None:
        last = self.ref_counts[block] == 1  # only the last reference asks the cache: a step's new name goes then
        self.pool.release(block, reusable=last and self.prefix_cache.released(block))

    def _cache_full_blocks(self, seq: _SeqBlocks) -> None:
        """Name the sequence's newly full blocks whose tokens are known (``PrefixCache.name_full_blocks``)."""
        if self.enable_prefix_caching:
            self.prefix_cache.name_full_blocks(seq.table, seq.block_hashes, seq.token_ids, seq.num_tokens)
