"""Exercises 5 and 6: the block table of PagedAttention (how many blocks L tokens need, which slot
each token's keys and values go to, when an append takes a new block) and copy-on-write when a
sequence appends to a block it shares (Kwon et al. 2023, "PagedAttention", Sec. 4.2-4.4).

The hand-made cases have known answers worked from the rules (``blocks_for(n) = ceil(n / block_size)``,
``slot = block_table[pos // block_size] * block_size + pos % block_size``, copy a shared partly filled
block before writing); the random cases take their answers from ``minillm.paged.BlockManager``
(``blocks_for``, ``slot_mapping``, ``blocks_needed``, ``grow`` after ``fork``). ``reference_append``
writes the copy-on-write rule out, with a switch per typical mistake, for the hints.
"""

from __future__ import annotations

import torch

from ..paged import BlockManager, blocks_for
from .checker import Case, Exercise, Failure, describe, first_match, kind, number_problem, tensor_problem

# ---------------------------------------------------------------------------------------------
# 5. blocks_needed, slot_mapping, needs_new_block


def reference_blocks_needed(num_tokens, block_size):
    return blocks_for(num_tokens, block_size)


def reference_slot_mapping(block_table, positions, block_size):
    table = torch.as_tensor(block_table, dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size


def reference_needs_new_block(num_tokens, block_size):
    return num_tokens % block_size == 0  # the new token lands at a multiple of block_size


def _manager(g: torch.Generator, block_size: int, lengths: list[int], num_blocks: int = 64):
    """A ``BlockManager`` holding sequences 0, 1, ... grown to ``lengths`` in random interleaved steps,
    so that their block tables are scattered over the pool as in a real batch."""
    m = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    now = [0] * len(lengths)
    for s in range(len(lengths)):
        m.allocate(s)
    while now != lengths:
        s = int(torch.randint(0, len(lengths), (), generator=g))
        if now[s] < lengths[s]:
            now[s] = min(lengths[s], now[s] + int(torch.randint(1, 2 * block_size, (), generator=g)))
            m.grow(s, now[s])
    return m


def _ints(g, n, lo, hi):
    return torch.randint(lo, hi, (n,), generator=g).tolist()


def judge_blocks_needed(case: Case, expected, got, args) -> Failure | None:
    problem = number_problem(got, "the number of blocks")
    if problem:
        return Failure(describe(expected), describe(got), problem)
    if got == expected:
        return None
    n, bs = case.args
    if n % bs == 0 and got == n // bs + 1:
        hint = ("an extra, empty block when num_tokens is a multiple of block_size: the last block is full, "
                "not empty; use ceil(num_tokens / block_size) = (num_tokens + block_size - 1) // block_size")
    elif got == n // bs:
        hint = "a partly filled last block still takes a whole block: round up, not down"
    else:
        hint = (f"work it out by hand: {n} tokens, {bs} slots per block; how many blocks do the full ones take, "
                "and does a partly filled last block count?")
    return Failure(describe(expected), describe(got), hint)


BLOCKS_NEEDED = Exercise(
    name="blocks_needed",
    signature="blocks_needed(num_tokens, block_size) -> int",
    notebook="05_block_table.ipynb",
    follows="PagedAttention's rule: ceil(num_tokens / block_size) (minillm.paged.blocks_for)",
    reference=reference_blocks_needed,
    forbidden=("minillm.paged.block_manager.blocks_for", "minillm.paged.block_manager.BlockManager.blocks_needed"),
    hand_cases=lambda: [
        Case("an empty sequence holds no block", (0, 16), 0),
        Case("one token takes one block", (1, 16), 1),
        Case("15 tokens: one block, partly filled", (15, 16), 1),
        Case("16 tokens end exactly at a block boundary: one full block", (16, 16), 1),
        Case("17 tokens: a second block", (17, 16), 2),
        Case("32 tokens, block_size 16: two full blocks", (32, 16), 2),
        Case("block_size 1: one block per token", (100, 1), 100),
    ],
    random_cases=lambda g: [Case(f"random {i + 1} ({n} tokens, block_size {bs})", (n, bs))
                            for i, (n, bs) in enumerate(zip(_ints(g, 4, 0, 2000), (8, 16, 32, 64)))],
    judge=judge_blocks_needed,
)


def slot_cases() -> list[Case]:
    table = [7, 2, 9]
    return [
        # block_size 4: positions 0-3 in block 7 (slots 28-31), 4-7 in block 2 (8-11), 8-11 in block 9 (36-39)
        Case("a prefill of 10 tokens over the blocks [7, 2, 9], block_size 4",
             (table, torch.arange(10), 4), torch.tensor([28, 29, 30, 31, 8, 9, 10, 11, 36, 37])),
        Case("decode: one token at position 6", (table, torch.tensor([6]), 4), torch.tensor([10])),
        Case("block_size 1: the slot is the block", ([5, 3], torch.tensor([0, 1]), 1), torch.tensor([5, 3])),
        Case("block tables out of order: [3, 0], block_size 16, positions 15 and 16",
             ([3, 0], torch.tensor([15, 16]), 16), torch.tensor([63, 0])),
    ]


def slot_random(g: torch.Generator) -> list[Case]:
    cases = []
    for i, bs in enumerate((4, 16, 32)):
        lengths = _ints(g, 3, 1, 6 * bs)
        m = _manager(g, bs, lengths)
        L = lengths[0]
        start = int(torch.randint(0, L, (), generator=g))
        positions = torch.arange(start, L)
        cases.append(Case(f"random {i + 1} (positions {start}..{L - 1} of 3 sequences, block_size {bs})",
                          (m.block_table(0), positions, bs), torch.tensor(m.slot_mapping(0, positions.tolist()))))
    return cases


def judge_slot_mapping(case: Case, expected, got, args) -> Failure | None:
    table, positions, bs = case.args
    problem = tensor_problem(got, positions.shape, floating=False, what="slot_mapping")
    if problem:
        return Failure(describe(expected), describe(got), problem)
    if torch.equal(got.long(), expected):
        return None
    t = torch.tensor(table)
    mutants = [
        (lambda: positions, "the block table is not used: the logical block pos // block_size lives in physical block "
                            "block_table[pos // block_size]"),
        (lambda: t[positions // bs] + positions % bs, "a block holds block_size slots: multiply the physical block "
                                                     "by block_size before adding the offset"),
        (lambda: t[positions % bs] * bs + positions // bs, "block index and offset are swapped: the block is "
                                                          "pos // block_size, the offset pos % block_size"),
    ]
    hint = first_match(got, mutants, lambda a, b: torch.equal(a.long(), b.long()))
    if hint is None:
        i = int((got.long() != expected).nonzero()[0])
        p = int(positions[i])
        hint = (f"position {p} goes to slot {int(expected[i])}, yours is {int(got[i])}: which logical block holds "
                f"position {p}, which physical block is that in block_table, and which slot of the pool does that "
                "block start at?")
    return Failure(describe(expected), describe(got), hint)


SLOT_MAPPING = Exercise(
    name="slot_mapping",
    signature="slot_mapping(block_table, positions (T,) int64, block_size) -> (T,) int64 slots",
    notebook="05_block_table.ipynb",
    follows=("PagedAttention's slot_mapping (vLLM's name): "
             "block_table[pos // block_size] * block_size + pos % block_size"),
    reference=reference_slot_mapping,
    forbidden=("minillm.paged.block_manager.BlockManager.slot_mapping", "minillm.paged.attention.padded_slots"),
    hand_cases=slot_cases,
    random_cases=slot_random,
    judge=judge_slot_mapping,
)


def judge_needs_new_block(case: Case, expected, got, args) -> Failure | None:
    if not isinstance(got, bool) and not (isinstance(got, torch.Tensor) and got.numel() == 1):
        return Failure(describe(expected), describe(got), f"return True or False, got {kind(got)}")
    if bool(got) == expected:
        return None
    n, bs = case.args
    if n == 0:
        hint = "the first token of an empty sequence needs the first block too"
    elif (n + 1) % bs == 0 or n % bs == 0:
        hint = ("off by one: a sequence of num_tokens tokens writes the new token at position num_tokens; "
                "it needs a new block exactly when that position is a multiple of block_size")
    else:
        hint = "a new block is taken only when the new token's position is a multiple of block_size"
    return Failure(describe(expected), describe(got), hint)


def _needs_new_block_case(g: torch.Generator, i: int, block_size: int) -> Case:
    n = int(torch.randint(1, 8 * block_size, (), generator=g))
    if i % 2:
        n -= n % block_size  # every other case at a block boundary
    m = _manager(g, block_size, [n])
    expected = m.blocks_needed(0, n, n + 1) == 1  # the package: free blocks that writing position n takes
    return Case(f"random {i + 1} ({n} tokens, block_size {block_size})", (n, block_size), expected)


NEEDS_NEW_BLOCK = Exercise(
    name="needs_new_block",
    signature="needs_new_block(num_tokens, block_size) -> bool (appending one token takes a new block)",
    notebook="05_block_table.ipynb",
    follows="PagedAttention's append rule: a new block when the token lands at a multiple of block_size",
    reference=reference_needs_new_block,
    forbidden=("minillm.paged.block_manager.BlockManager.blocks_needed",),
    hand_cases=lambda: [
        Case("the first token of an empty sequence", (0, 16), True),
        Case("the 6th token goes into the first block", (5, 16), False),
        Case("the 16th token fills the first block (no new block yet)", (15, 16), False),
        Case("the 17th token lands at position 16: a new block", (16, 16), True),
        Case("block_size 1: every token takes a block", (7, 1), True),
    ],
    random_cases=lambda g: [_needs_new_block_case(g, i, bs) for i, bs in enumerate((4, 8, 16, 2))],
    judge=judge_needs_new_block,
)

BLOCK_EXERCISES = (BLOCKS_NEEDED, SLOT_MAPPING, NEEDS_NEW_BLOCK)


# ---------------------------------------------------------------------------------------------
# 6. append_token_cow


def reference_append(block_table, num_tokens, ref_counts, free_blocks, block_size, *, copy_shared=True,
                     decrement=True, copy_sole=False, shared_first=False, new_ref=1):
    """Append one token with copy-on-write (the switches give the typical mistakes; off: the answer)."""
    table, refs, free = list(block_table), list(ref_counts), list(free_blocks)
    last = table[-1] if table else None
    at_boundary = num_tokens % block_size == 0
    if shared_first and last is not None and refs[last] > 1:
        at_boundary = False  # the mistake: copy the shared last block even when it is full
    if at_boundary:  # the token opens a new block; full blocks are never written again, shared or not
        b = free.pop(0)
        refs[b] = new_ref
        return table + [b], refs, free, None
    if refs[last] == 1 and not copy_sole or refs[last] > 1 and not copy_shared:
        return table, refs, free, None  # written in place
    b = free.pop(0)  # copy the last block into a fresh one, then write there
    refs[b] = new_ref
    if decrement:
        refs[last] -= 1
    table[-1] = b
    return table, refs, free, (last, b)


def _cow_case(name, table, num_tokens, refs, free, block_size, expected=None):
    return Case(name, (table, num_tokens, refs, free, block_size), expected)


def cow_cases() -> list[Case]:
    # a pool of 8 blocks, block_size 4. A 6-token sequence holds blocks [0, 1] (block 1 half full).
    return [
        _cow_case("sole owner, mid-block: written in place, nothing copied",
                  [0, 1], 6, [1, 1, 0, 0, 0, 0, 0, 0], [2, 3, 4, 5, 6, 7], 4,
                  ([0, 1], [1, 1, 0, 0, 0, 0, 0, 0], [2, 3, 4, 5, 6, 7], None)),
        _cow_case("after a fork (parallel sampling), mid-block: copy block 1 into block 2 first",
                  [0, 1], 6, [2, 2, 0, 0, 0, 0, 0, 0], [2, 3, 4, 5, 6, 7], 4,
                  ([0, 2], [2, 1, 1, 0, 0, 0, 0, 0], [3, 4, 5, 6, 7], (1, 2))),
        _cow_case("after a fork, the sequence ends exactly at a block boundary: a new block, no copy",
                  [0, 1], 8, [2, 2, 0, 0, 0, 0, 0, 0], [2, 3, 4, 5, 6, 7], 4,
                  ([0, 1, 2], [2, 2, 1, 0, 0, 0, 0, 0], [3, 4, 5, 6, 7], None)),
        _cow_case("shared by three beams, mid-block: the copy leaves 2 owners of block 1",
                  [0, 1], 5, [3, 3, 0, 0, 0, 0, 0, 0], [5, 2, 3, 4, 6, 7], 4,
                  ([0, 5], [3, 2, 0, 0, 0, 1, 0, 0], [2, 3, 4, 6, 7], (1, 5))),
        _cow_case("the first token of an empty sequence takes the first free block",
                  [], 0, [0, 0, 0, 1], [2, 0, 1], 4, ([2], [0, 0, 1, 1], [0, 1], None)),
    ]


def cow_random(g: torch.Generator) -> list[Case]:
    cases = []
    for i, bs in enumerate((2, 4, 8, 16)):
        lengths = _ints(g, 2, 1, 6 * bs)
        if i == 3:  # the last case at a block boundary, the others mid-block
            lengths[0] = max(bs, lengths[0] - lengths[0] % bs)
        elif lengths[0] % bs == 0:
            lengths[0] += 1
        m = _manager(g, bs, lengths)
        forks = (0, 1, 2, 1)[i]  # other owners of sequence 0's blocks (parallel sampling, beam search)
        for child in range(forks):
            m.fork(0, 10 + child)
        L = lengths[0]
        args = (m.block_table(0), L, list(m.ref_counts), m.free_block_ids(), bs)
        copies = m.grow(0, L + 1)  # the package's append: grow by one token
        expected = (m.block_table(0), list(m.ref_counts), m.free_block_ids(), copies[0] if copies else None)
        cases.append(_cow_case(f"random {i + 1} ({L} tokens, block_size {bs}, {forks} fork(s))", *args, expected))
    return cases


def judge_cow(case: Case, expected, got, args) -> Failure | None:
    if not isinstance(got, (tuple, list)) or len(got) != 4:
        return Failure(describe(expected), describe(got), "return (block_table, ref_counts, free_blocks, copy)")
    table, refs, free, cp = got
    try:
        answer = (list(table), list(refs), list(free), None if cp is None else tuple(cp))
    except TypeError:
        return Failure(describe(expected), describe(got), "block_table, ref_counts and free_blocks are lists of "
                       "ints; copy is (src, dst) or None")
    if answer == tuple(expected):
        return None

    def wrong(**kw):
        return lambda: reference_append(*case.args, **kw)

    mutants = [
        (wrong(copy_shared=False), "the other owners would see this token: copy a shared, partly filled block before "
                                   "writing (copy-on-write) and point this sequence's table at the copy"),
        (wrong(decrement=False), "the old block has one owner fewer after the copy: decrement its reference count, "
                                 "or it never returns to the free list"),
        (wrong(copy_sole=True), "only shared blocks are copied: a block with reference count 1 is written in place"),
        (wrong(shared_first=True), "a full block is never written again: at a block boundary take a new block; "
                                   "nothing is copied, even when the last block is shared"),
        (wrong(new_ref=0), "the block just taken has one owner: set its reference count to 1"),
    ]
    hint = first_match(answer, mutants, lambda a, b: a == tuple(b))
    same_blocks = sorted(answer[2]) == sorted(expected[2])
    if hint is None and answer[3] == expected[3] and same_blocks and answer[2] != expected[2]:
        hint = "take the first free block (free_blocks[0]) and keep the others in order"
    parts = [what for what, a, b in zip(("block_table", "ref_counts", "free_blocks", "copy"), answer, expected)
             if a != (None if b is None else tuple(b) if what == "copy" else list(b))]
    return Failure(describe(expected), describe(answer), hint or (
        f"your {' and '.join(parts)} differ: does the new token open a new block here, is the last block shared, "
        "and what must each list say afterwards?"))


COPY_ON_WRITE = Exercise(
    name="append_token_cow",
    signature=("append_token_cow(block_table, num_tokens, ref_counts, free_blocks, block_size) -> "
               "(block_table, ref_counts, free_blocks, copy (src, dst) or None)"),
    notebook="06_copy_on_write.ipynb",
    follows="PagedAttention's copy-on-write (Kwon et al. 2023, Sec. 4.4), written out in reference_append",
    reference=reference_append,
    forbidden=("minillm.paged.block_manager.BlockManager.grow", "minillm.paged.block_manager.BlockManager.fork"),
    hand_cases=cow_cases,
    random_cases=cow_random,
    judge=judge_cow,
)
