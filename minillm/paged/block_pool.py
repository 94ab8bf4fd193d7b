"""The pool of physical KV blocks: a free queue in eviction order and a reference count per block.

Kwon et al. 2023 (vLLM, arXiv 2309.06180), Sec. 4.2 and 4.4; vLLM's ``BlockPool`` has this shape. A freed
block that a prompt can still find goes to the back of the queue (evicted last), one that holds nothing
reusable to the front. The pool knows no sequences or tokens: the ``BlockManager`` says what is reusable.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["BlockPool", "NoFreeBlocksError"]


class NoFreeBlocksError(RuntimeError):
    """Too few free blocks; nothing was changed (a scheduler preempts a sequence and tries again)."""

    def __init__(self, needed: int, free: int, total: int):
        super().__init__(f"out of KV blocks: need {needed} free blocks but {free} of {total} are free; "
                         "preempt a sequence (free its blocks) or make the pool larger")
        self.needed, self.free, self.total = needed, free, total


class BlockPool:
    """``num_blocks`` physical blocks, each free (in the queue, count 0) or held (count >= 1).

    Raises:
        ValueError: num_blocks below 1.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks: the pool needs at least one block, got {num_blocks}; give more blocks "
                             "or more KV bytes")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks  # block tables holding each block; the list is never rebound
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front is taken first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free blocks in eviction order (the first is taken next)."""
        return list(self._free)

    def check_free(self, needed: int) -> None:
        """Raises NoFreeBlocksError when fewer than ``needed`` blocks are free."""
        if needed > len(self._free):
            raise NoFreeBlocksError(needed, len(self._free), self.num_blocks)

    def take(self) -> int:
        """Pop the block at the front of the free queue; it is held once."""
        block, _ = self._free.popitem(last=False)
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more table holds the block; a free one (a prefix-cache hit) leaves the queue."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def release(self, block: int, reusable: bool = False) -> None:
        """One table lets go of the block; with no reference left it joins the queue, at the back when
        ``reusable`` (a prompt can still find it), else at the front."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None
            self._free.move_to_end(block, last=reusable)
