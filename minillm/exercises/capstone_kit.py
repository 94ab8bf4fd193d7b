"""What the capstone hands the student's serving loop, none of it the lesson: a KV cache over one sequence's
blocks of the shared pool (``SequenceCache``, the decoder's cache interface), the pools themselves
(``new_pools``), RoPE swapped for the student's while a sequence runs (``rope_swapped``), the loop's result
(``ServeResult``), the capstone's prompts and settings, and a default ``schedule_step`` for a course that skipped
exercise 12.

The grader loads this file by itself into the process that runs the student's loop (``runner.py``), where no
other module of ``minillm.exercises`` may be imported: so it imports only the core (absolute imports) and holds
no reference solution of the lesson (the loop is ``capstone.serve``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

import minillm.model as model_module
from minillm.kv_cache import Cache

# the student's functions the loop calls, by name; the last two only with drafts (num_speculative_tokens > 0)
PIECES = ("cache_update", "rope_at_offset", "blocks_needed", "needs_new_block", "slot_mapping", "top_p_filter",
          "schedule_step", "speculative_verify", "ngram_propose")
SPECULATIVE_PIECES = PIECES[7:]

# the capstone's prompts (the notebook and the grader encode them with SmolLM2's tokenizer) and the two runs its
# row grades: a pool of 12 blocks of 4 that three sequences growing to 16 new tokens do not fit together (the
# scheduler must preempt and readmit), and prompt-lookup drafts verified by the student's rejection sampling
PROMPTS = ("The capital of France is",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
           "A block table maps each sequence's logical blocks to")
SETTINGS = {
    "a pool that preempts": dict(max_new_tokens=16, block_size=4, num_blocks=12, max_num_seqs=3),
    "with drafts": dict(max_new_tokens=16, block_size=4, num_blocks=24, max_num_seqs=4, num_speculative_tokens=3),
}


@dataclass
class ServeResult:
    """What a serving loop returns: each prompt's generated token ids, in the prompts' order, and what the loop
    did (steps, preemptions, drafted and accepted tokens)."""

    tokens: list[list[int]]
    steps: int = 0
    preemptions: int = 0
    drafted: int = 0
    accepted: int = 0


def check_pieces(pieces: dict, num_speculative_tokens: int = 0) -> None:
    """Raises ValueError naming the pieces a loop needs that ``pieces`` (name -> function) lacks."""
    wanted = PIECES if num_speculative_tokens else PIECES[:7]
    missing = [name for name in wanted if not callable(pieces.get(name))]
    if missing:
        raise ValueError(f"pieces: give your functions {', '.join(missing)} (a dict: name -> function)")


def new_pools(model, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_pool, v_pool) per layer, each (1, Hkv, num_blocks * block_size, D) zeros in the model's dtype:
    slot s of the pool is position s of one long cache, block b its slots b * block_size ... + block_size - 1."""
    c = model.config
    shape = (1, c.n_kv_heads, num_blocks * block_size, c.head_dim)
    return [(torch.zeros(shape, dtype=model.dtype, device=model.device),
             torch.zeros(shape, dtype=model.dtype, device=model.device)) for _ in range(c.n_layers)]


class SequenceCache(Cache):
    """The KV-cache interface the decoder calls (``prepare``, then ``attend`` per layer) for one sequence over
    the shared pools, through the student's pieces: ``slot_mapping`` says where each position lives,
    ``cache_update`` writes each new key and value there (the pool seen as one long cache, one slot at a time),
    and attention reads the sequence's positions 0..end-1 back from their slots, in position order.

    Args:
        pools: ``new_pools``'s list, one (k_pool, v_pool) per layer.
        block_table: the sequence's physical block ids (logical block i is ``block_table[i]``); it must hold
            every position the forward writes.
        block_size: slots per block.
        pieces: the student's functions by name (``slot_mapping``, ``cache_update``).
    """

    def __init__(self, pools, block_table: list[int], block_size: int, pieces: dict):
        self.pools, self.block_table, self.block_size, self.pieces = pools, block_table, block_size, pieces

    def prepare(self, input_pos: torch.Tensor) -> int:
        """The forward's (T,) positions start..end-1: their slots, and every slot of 0..end-1; returns end."""
        self.start, self.end = int(input_pos[0]), int(input_pos[-1]) + 1
        slots = self.pieces["slot_mapping"]
        self.new_slots = [int(s) for s in slots(self.block_table, input_pos.cpu(), self.block_size)]
        every = slots(self.block_table, torch.arange(self.end), self.block_size)
        self.all_slots = torch.as_tensor(every, dtype=torch.long, device=self.pools[0][0].device)
        return self.end

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (1, Hkv, T, D) at the new positions' slots; return (1, Hkv, end, D) keys and values."""
        k_pool, v_pool = self.pools[layer]
        for t, slot in enumerate(self.new_slots):  # (1, Hkv, 1, D) at pool position ``slot``, in place
            self.pieces["cache_update"](k_pool, v_pool, k[:, :, t:t + 1], v[:, :, t:t + 1], slot)
        return k_pool[:, :, self.all_slots], v_pool[:, :, self.all_slots]  # (1, Hkv, end, D) in position order


@contextmanager
def rope_swapped(rope_at_offset, start: int, base: float):
    """Within the block, the decoder rotates queries and keys with the student's ``rope_at_offset`` as tokens at
    positions start, start + 1, ... (the decoder takes no RoPE argument, so ``minillm.model.apply_rope`` is
    swapped and put back; one forward of one sequence at a time)."""
    original = model_module.apply_rope
    model_module.apply_rope = lambda x, cos, sin: rope_at_offset(x, start, base)
    try:
        yield
    finally:
        model_module.apply_rope = original


def default_schedule_step(running, waiting, num_free_blocks, block_size, max_num_seqs):
    """Exercise 12's step, for a course that skipped it: decodes oldest first (one that opens a block takes a
    free one; with none free the newest running sequence is preempted, stopping if it is the sequence itself);
    unless something was preempted, waiting prompts are admitted in order while a seat is free and the pool holds
    their blocks. Returns (decoded, preempted, admitted, num_free_blocks left), as ``schedule_step``."""
    free, pending = num_free_blocks, list(running)
    decoded, preempted, admitted = [], [], []
    i = 0
    while i < len(pending):
        seq_id, n = pending[i]
        if n % block_size == 0:  # the decode token opens a new block
            while free == 0:
                victim, victim_tokens = pending.pop()  # the newest
                preempted.append(victim)
                free += -(-victim_tokens // block_size)
                if victim == seq_id:
                    break
            if seq_id in preempted:
                break
            free -= 1
        decoded.append(seq_id)
        i += 1
    if not preempted:
        for seq_id, prompt_len in waiting:
            need = -(-prompt_len // block_size)
            if len(decoded) + len(admitted) >= max_num_seqs or need > free:
                break
            free -= need
            admitted.append(seq_id)
    return decoded, preempted, admitted, free


__all__ = ["PIECES", "PROMPTS", "SETTINGS", "SPECULATIVE_PIECES", "SequenceCache", "ServeResult", "check_pieces",
           "default_schedule_step", "new_pools", "rope_swapped"]
