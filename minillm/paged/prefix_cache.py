"""Prefix caching: a full block of keys and values is found again by the tokens it holds, so a prompt that
starts like an earlier one reuses its blocks.

vLLM's automatic prefix caching: a full block's key is a hash chained over its parent's key and its own
token ids. Our choices (docs/paged.md): a hit is verified (its token ids and its parent block, by id and
allocation count), so a hash collision costs a miss, never wrong keys and values; a block's name holds only
once the forward that writes it has run (``begin`` / ``commit`` / ``rollback``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .stats import PrefixCacheStats

__all__ = ["PrefixCache", "hash_block_tokens"]


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """A full block's prefix-cache key: a hash of its parent block's key and its own token ids."""
    return hash((parent_hash, token_ids))


@dataclass(frozen=True)
class _CachedBlock:
    block_hash: int
    token_ids: tuple[int, ...]
    parent: tuple[int, int] | None  # (block id, allocation count) of the block before it; None for a first block


class PrefixCache:
    """Which physical blocks a prompt can find by its tokens, and under which key (held by the ``BlockManager``,
    which decides when blocks are taken and freed). hash_fn: ``(parent_hash, token_ids) -> int``."""

    def __init__(self, num_blocks: int, block_size: int,
                 hash_fn: Callable[[int | None, tuple[int, ...]], int] = hash_block_tokens):
        self.block_size, self.hash_fn = block_size, hash_fn
        self.stats = PrefixCacheStats()
        self.times_taken = [0] * num_blocks  # with its id, a block's identity for verifying a cached prefix
        self._cached: dict[int, _CachedBlock] = {}  # block id -> what it holds
        self._hash_to_block: dict[int, int] = {}
        self._uncommitted: set[int] = set()  # named since ``begin``: their K/V is not written yet
        self.in_step = False  # between begin and commit / rollback

    def __contains__(self, block: int) -> bool:
        return block in self._cached

    def cached_blocks(self) -> set[int]:
        """The blocks a prefix lookup can find, held or free (a copy: reading it changes nothing)."""
        return set(self._cached)

    def lookup(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """(block, hash) of the longest verified cached prefix of full blocks, the last token left uncached (it is
        computed again, for logits)."""
        bs, hits = self.block_size, []
        n_full = (len(token_ids) - 1) // bs if token_ids else 0
        self.stats.queries += n_full
        parent_hash, parent = None, None
        for i in range(n_full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.hash_fn(parent_hash, tokens)
            block = self._hash_to_block.get(h)
            entry = self._cached.get(block)
            if entry is None or entry.token_ids != tokens or entry.parent != parent:
                break  # a miss, or a collision that verification catches
            hits.append((block, h))
            parent_hash, parent = h, (block, self.times_taken[block])
        self.stats.hits += len(hits)
        return hits

    def name_full_blocks(self, table: list[int], hashes: list[int], token_ids: list[int], num_tokens: int) -> None:
        """Name each newly full block whose tokens are known by its chained hash. table: the sequence's block
        table; hashes: the keys of its leading full blocks (extended here); num_tokens: its positions with slots."""
        bs = self.block_size
        for i in range(len(hashes), min(num_tokens, len(token_ids)) // bs):
            block_tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.hash_fn(hashes[-1] if i else None, block_tokens)
            hashes.append(h)
            block = table[i]
            if block not in self._cached and h not in self._hash_to_block:
                parent = (table[i - 1], self.times_taken[table[i - 1]]) if i else None
                if self.in_step:  # first: a name given halfway is still forgotten by a rollback
                    self._uncommitted.add(block)
                self._cached[block] = _CachedBlock(h, block_tokens, parent)
                self._hash_to_block[h] = block

    def forget(self, block: int) -> None:
        """The block is no longer findable (its content changes); nothing if it was not."""
        entry = self._cached.pop(block, None)
        if entry is not None and self._hash_to_block.get(entry.block_hash) == block:
            del self._hash_to_block[entry.block_hash]

    def taken(self, block: int) -> None:
        """The pool hands the block out for new content: it is evicted, and its identity changes."""
        self.forget(block)
        self.times_taken[block] += 1

    def released(self, block: int) -> bool:
        """The block's last reference went; returns whether it stays findable (a name given in this step
        goes: the forward that was to write it will not)."""
        if block in self._uncommitted:
            self._uncommitted.discard(block)
            self.forget(block)
        return block in self._cached

    def begin(self) -> None:
        """A step starts: blocks named from now on wait for ``commit`` (outside a step, a name holds at once)."""
        self._uncommitted.clear()
        self.in_step = True

    def commit(self) -> None:
        """The forward that writes the blocks named since ``begin`` succeeded: they stay findable."""
        self._uncommitted.clear()
        self.in_step = False

    def rollback(self) -> None:
        """The forward failed: the blocks named since ``begin`` hold no keys and values, so they are forgotten."""
        for block in self._uncommitted:
            self.forget(block)
        self._uncommitted.clear()
        self.in_step = False
