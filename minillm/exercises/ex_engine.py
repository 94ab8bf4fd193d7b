"""Exercises 11 and 12: the engine's inner steps. Reading a sequence's keys from the pool of blocks (the
slot mapping inside attention) and attending block by block with an online softmax (Kwon et al. 2023,
Sec. 4.1; Milakov & Gimelshein 2018); one scheduler step, admit or preempt (Sec. 4.5).

References: ``minillm.paged.attention.gather_padded`` / ``paged_attention``, and the scheduler's rules written
out in ``reference_schedule`` (checked against ``minillm.paged.Scheduler`` step by step in the tests).
"""

from __future__ import annotations

import math

import torch

from ..paged import blocks_for, paged_attention
from ..paged.attention import gather_padded
from .checker import Case, Exercise, Failure, close, describe, first_match, kind, same_tensor, tensor_problem

# ---------------------------------------------------------------------------------------------
# 11. paged_gather and online_softmax_attention


def reference_gather(k_pool, block_table, seq_len):
    return gather_padded(k_pool, [list(block_table)], [seq_len], seq_len)[0]


def _pool(g, num_blocks, block_size, Hkv, D):
    return torch.randn(num_blocks, block_size, Hkv, D, generator=g)


def gather_cases() -> list[Case]:
    pool = torch.arange(6 * 2 * 1 * 1, dtype=torch.float32).reshape(6, 2, 1, 1)  # slot s holds the value s
    return [
        Case("blocks [4, 1] of size 2, 3 tokens: slots 8, 9, 2", (pool, [4, 1], 3), torch.tensor([[[8.], [9.], [2.]]])),
        Case("a sequence ending at a block boundary (4 tokens over [5, 0])", (pool, [5, 0], 4),
             torch.tensor([[[10.], [11.], [0.], [1.]]])),
        Case("one token in block 3", (pool, [3], 1), torch.tensor([[[6.]]])),
    ]


def gather_random(g) -> list[Case]:
    cases = []
    for i, (bs, Hkv, D) in enumerate(((4, 3, 8), (16, 3, 64), (8, 2, 16))):
        pool = _pool(g, 12, bs, Hkv, D)
        n = int(torch.randint(1, 5 * bs, (), generator=g))
        table = torch.randperm(12, generator=g)[:blocks_for(n, bs)].tolist()
        cases.append(Case(f"random {i + 1} ({n} tokens, block_size {bs}, Hkv {Hkv}, D {D})", (pool, table, n)))
    return cases


def judge_gather(case: Case, expected, got, args) -> Failure | None:
    pool, table, n = case.args
    nb, bs, Hkv, D = pool.shape
    if isinstance(got, torch.Tensor) and got.shape == expected.shape and torch.equal(got, expected):
        return None
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (n, Hkv, D) != tuple(expected.shape):
        return Failure(describe(expected), describe(got), "the keys come back as (seq_len, Hkv, D): attention wants "
                       "(Hkv, seq_len, D), one row of keys per head; transpose")
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (Hkv, len(table) * bs, D) != tuple(expected.shape):
        return Failure(describe(expected), describe(got), "every slot of the last block came back: cut the keys to "
                       "seq_len, the slots past it hold another sequence's keys or garbage")
    problem = tensor_problem(got, expected.shape, pool.dtype, "the keys")
    if problem:
        return Failure(describe(expected), describe(got), problem)
    if torch.equal(got, expected):
        return None
    flat = pool.reshape(nb * bs, Hkv, D)
    pos = torch.arange(n)
    t = torch.tensor(table)
    mutants = [
        (lambda: flat[:n].transpose(0, 1), "the block table is not used: position p lives in physical block "
                                            "block_table[p // block_size], not in block p // block_size of the pool"),
        (lambda: flat[t[pos % bs] * bs + pos // bs].transpose(0, 1),
         "block index and offset are swapped: the block is p // block_size, the offset p % block_size"),
        (lambda: flat[t[pos // bs] + pos % bs].transpose(0, 1), "a block holds block_size slots: the block's first "
                                                                 "slot is block_table[...] * block_size"),
    ]
    hint = first_match(got, mutants, torch.equal)
    return Failure(describe(expected), describe(got), hint or (
        "compare position by position: for each position, which logical block, which physical block, which slot?"))


GATHER = Exercise(
    name="paged_gather",
    signature="paged_gather(k_pool (num_blocks, block_size, Hkv, D), block_table, seq_len) -> (Hkv, seq_len, D)",
    notebook="11_paged_attention.ipynb",
    follows="minillm.paged.attention.gather_padded (the engine's reference read of the pool)",
    reference=reference_gather,
    hand_cases=gather_cases,
    random_cases=gather_random,
    judge=judge_gather,
    forbidden=("minillm.paged.attention.gather_padded", "minillm.paged.attention.padded_slots",
               "minillm.paged.block_manager.BlockManager.slot_mapping"),
)


def reference_online(q, k_blocks, v_blocks):
    """The package's block-wise attention (``paged_attention``) for one query over the blocks, and the
    softmax's max and sum over every score."""
    D, bs = q.shape[0], max(k.shape[0] for k in k_blocks)
    n = sum(k.shape[0] for k in k_blocks)
    pad = lambda b: torch.cat([b, b.new_zeros(bs - b.shape[0], D)])[:, None]  # (bs, 1, D)
    k_pool = torch.stack([pad(k) for k in k_blocks])  # (nb, bs, 1, D)
    v_pool = torch.stack([pad(v) for v in v_blocks])
    if any(k.shape[0] != bs for k in k_blocks[:-1]):
        raise ValueError("k_blocks: every block but the last is full")
    out = paged_attention(q[None, None, None], k_pool, v_pool, torch.arange(len(k_blocks))[None],
                          torch.tensor([n]), torch.tensor([[n - 1]]))[0, 0, 0]
    s = torch.cat(k_blocks) @ q / math.sqrt(D)
    m = s.max()
    return out, float(m), float(torch.exp(s - m).sum())


def _online(q, k_blocks, v_blocks, *, rescale_acc=True, rescale_sum=True, divide=True, scaled=True):
    """The online softmax written out, with the switches of the typical mistakes."""
    D = q.shape[0]
    m, l, acc = float("-inf"), 0.0, torch.zeros(D)
    for k, v in zip(k_blocks, v_blocks):
        s = k @ q / (math.sqrt(D) if scaled else 1.0)
        m_new = max(m, float(s.max()))
        p = torch.exp(s - m_new)
        c = math.exp(m - m_new) if m > float("-inf") else 0.0
        l = (l * c if rescale_sum else l) + float(p.sum())
        acc = (acc * c if rescale_acc else acc) + p @ v
        m = m_new
    return (acc / l if divide else acc), m, l


def online_cases() -> list[Case]:
    q = torch.tensor([1.0, 0.0, 0.0, 0.0])
    k = [torch.tensor([[2.0, 0, 0, 0], [0.0, 0, 0, 0]]), torch.tensor([[4.0, 0, 0, 0]])]  # scores 1, 0, 2
    v = [torch.tensor([[1.0, 0, 0, 0], [0.0, 1, 0, 0]]), torch.tensor([[0.0, 0, 1, 0]])]
    e = torch.tensor([math.e, 1.0, math.e ** 2])
    return [
        Case("scores 1, 0 | 2 over two blocks: the max moves in the second block", (q, k, v),
             (torch.cat([e / e.sum(), torch.zeros(1)]), 2.0, float((e / math.e ** 2).sum()))),
        Case("one block: the plain softmax", (q, k[:1], v[:1]),
             (torch.tensor([math.e, 1.0, 0, 0]) / (math.e + 1), 1.0, 1 + math.exp(-1))),
        Case("scores near 400 (exp overflows without the running max)", (q * 400, k, v),
             ((torch.exp(400 * torch.tensor([1.0, 0.0, 2.0]) - 800) / torch.exp(
                 400 * torch.tensor([1.0, 0.0, 2.0]) - 800).sum()).tolist() + [0.0], 800.0, 1.0)),
    ]


def online_random(g) -> list[Case]:
    cases = []
    for i, (bs, n, D) in enumerate(((4, 10, 8), (16, 33, 64), (8, 8, 16))):
        q = 2 * torch.randn(D, generator=g)
        k, v = torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)
        cases.append(Case(f"random {i + 1} ({n} keys in blocks of {bs}, D {D})",
                          (q, list(k.split(bs)), list(v.split(bs)))))
    return cases


def judge_online(case: Case, expected, got, args) -> Failure | None:
    out_exp, m_exp, l_exp = expected
    out_exp = torch.as_tensor(out_exp, dtype=torch.float32)
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return Failure(describe(expected), describe(got), "return (out (D,), m, l): the output, the running max "
                       "and the running sum after the last block")
    out, m, l = got
    problem = tensor_problem(out, out_exp.shape, what="out")
    if problem:
        return Failure(describe(expected), describe(got), problem)
    try:
        m, l = float(m), float(l)
    except (TypeError, ValueError):
        return Failure(describe(expected), describe(got), f"m and l are numbers, got {kind(m)} and {kind(l)}")
    if same_tensor(out.float(), out_exp, atol=1e-5) and close(m, m_exp, 1e-5) and close(l, l_exp, 1e-4):
        return None
    q, kb, vb = case.args

    def wrong(**kw):
        return lambda: _online(q, kb, vb, **kw)

    mutants = [
        (wrong(rescale_acc=False, rescale_sum=False), "when the max grows, what was summed before was weighted by "
                                                      "exp(s - old max): multiply the running sum and the accumulated "
                                                      "output by exp(old max - new max) before adding the block"),
        (wrong(rescale_acc=False), "when the max grows, what was accumulated was weighted by exp(s - old max): "
                                   "multiply the accumulated output by exp(old max - new max) before adding the block"),
        (wrong(rescale_sum=False), "the running sum must be rescaled by exp(old max - new max) too, like the output"),
        (wrong(divide=False), "the accumulated output is a weighted sum: divide it by the running sum l at the end"),
        (wrong(scaled=False), "scores are q . k / sqrt(D), as in every attention"),
    ]
    hint = first_match(got, mutants, lambda a, b: same_tensor(a[0].float(), b[0], atol=1e-5)
                       and close(float(a[1]), b[1], 1e-5) and close(float(a[2]), b[2], 1e-4))
    if hint is None and not torch.isfinite(out).all():
        hint = "exp overflowed: subtract the running max from the scores before exp"
    return Failure(describe(expected), describe(got), hint or (
        "keep three things per query across blocks (a max, a sum, an output); write what each must be after "
        "one block, then after two, and compare with the plain softmax"))


ONLINE = Exercise(
    name="online_softmax_attention",
    signature="online_softmax_attention(q (D,), k_blocks [(n_j, D)], v_blocks [(n_j, D)]) -> (out (D,), m, l)",
    notebook="11_paged_attention.ipynb",
    follows="minillm.paged.attention.paged_attention (block by block, online softmax)",
    reference=reference_online,
    hand_cases=online_cases,
    random_cases=online_random,
    judge=judge_online,
    forbidden=("minillm.paged.attention.paged_attention", "minillm.paged.attention.attend_blockwise"),
)


# ---------------------------------------------------------------------------------------------
# 12. schedule_step


def reference_schedule(running, waiting, num_free_blocks, block_size, max_num_seqs, *, victim="newest",
                       admit_after_preempt=False, skip_unfit=False, seats_slack=0, free_victim=True, boundary=0):
    """One step of the scheduler's rules (the switches give the typical mistakes; off: the answer)."""
    free, pending = num_free_blocks, [list(r) for r in running]
    decoded, preempted, admitted = [], [], []
    i = 0
    while i < len(pending):
        seq_id, n = pending[i]
        if (n + boundary) % block_size == 0:  # the decode token opens a new block
            while free == 0:
                j = len(pending) - 1 if victim == "newest" else (i + 1 if i + 1 < len(pending) else i)
                vid, vn = pending.pop(j)
                preempted.append(vid)
                free += blocks_for(vn, block_size) if free_victim else 0
                if vid == seq_id:
                    break
                if not free_victim and free == 0 and not pending[i:]:
                    break
            if seq_id in preempted:
                break
            if free == 0:  # a mistake that frees nothing: stop here
                break
            free -= 1
        decoded.append(seq_id)
        i += 1
    if not preempted or admit_after_preempt:
        seats = len(decoded)
        for seq_id, prompt_len in waiting:
            need = blocks_for(prompt_len, block_size)
            if seats + len(admitted) >= max_num_seqs + seats_slack or need > free:
                if skip_unfit and need > free:
                    continue
                break
            free -= need
            admitted.append(seq_id)
    return decoded, preempted, admitted, free


def schedule_cases() -> list[Case]:
    return [
        Case("room for every decode and both prompts", ([(0, 5), (1, 9)], [(2, 6), (3, 3)], 4, 4, 8),
             ([0, 1], [], [2, 3], 1)),
        Case("sequence 1 ends at a block boundary: its decode takes a block", ([(0, 5), (1, 8)], [], 1, 4, 8),
             ([0, 1], [], [], 0)),
        Case("no free block for sequence 0's new block: the newest (2) is preempted and nobody is admitted",
             ([(0, 8), (1, 5), (2, 3)], [(3, 2)], 0, 4, 8), ([0, 1], [2], [], 0)),
        Case("the newest needs a block and none is left: it preempts itself",
             ([(0, 5), (1, 8)], [(2, 1)], 0, 4, 8), ([0], [1], [], 2)),
        Case("first come, first served: a prompt that does not fit stops admission",
             ([(0, 5)], [(1, 20), (2, 1)], 3, 4, 8), ([0], [], [], 3)),
        Case("max_num_seqs 2 seats: one running, one admitted, the third waits",
             ([(0, 5)], [(1, 1), (2, 1)], 5, 4, 2), ([0], [], [1], 4)),
    ]


def schedule_random(g) -> list[Case]:
    cases = []
    for i, bs in enumerate((2, 4, 8, 4)):
        n_running = int(torch.randint(1, 6, (), generator=g))
        running = [(k, int(torch.randint(1, 6 * bs, (), generator=g))) for k in range(n_running)]
        if i % 2:  # every other case with decodes at block boundaries and few free blocks
            running = [(k, n - n % bs + bs) for k, n in running]
        waiting = [(10 + k, int(torch.randint(1, 4 * bs, (), generator=g))) for k in range(3)]
        free = int(torch.randint(0, 2 if i % 2 else 8, (), generator=g))
        cases.append(Case(f"random {i + 1} ({len(running)} running, 3 waiting, {free} free, block_size {bs})",
                          (running, waiting, free, bs, 4)))
    return cases


def judge_schedule(case: Case, expected, got, args) -> Failure | None:
    if not isinstance(got, (tuple, list)) or len(got) != 4:
        return Failure(describe(expected), describe(got), "return (decoded, preempted, admitted, num_free_blocks)")
    try:
        answer = (list(got[0]), list(got[1]), list(got[2]), int(got[3]))
    except (TypeError, ValueError):
        return Failure(describe(expected), describe(got), "decoded, preempted and admitted are lists of seq_ids; "
                       "num_free_blocks an int")
    if answer == tuple(expected):
        return None

    def wrong(**kw):
        return lambda: reference_schedule(*case.args, **kw)

    mutants = [
        (wrong(victim="oldest"), "preempt the newest running sequence (the last in the list): it has waited least "
                                 "and recomputing it costs least (Kwon et al., Sec. 4.5)"),
        (wrong(admit_after_preempt=True), "a step that preempted is short of blocks: admit no one in it"),
        (wrong(skip_unfit=True), "first come, first served: when the first waiting prompt does not fit, the ones "
                                 "behind it wait too"),
        (wrong(seats_slack=1), "max_num_seqs counts every sequence in the batch: the running ones and those "
                               "admitted; stop when they fill it"),
        (wrong(free_victim=False), "a preempted sequence gives all its blocks back to the free pool"),
        (wrong(boundary=1), "off by one: the decode token lands at position num_tokens, which opens a new block "
                            "when num_tokens is a multiple of block_size"),
    ]
    hint = first_match(answer, mutants, lambda a, b: a == tuple(b))
    parts = [name for name, a, b in zip(("decoded", "preempted", "admitted", "num_free_blocks"), answer, expected)
             if a != b]
    return Failure(describe(expected), describe(answer), hint or (
        f"your {' and '.join(parts)} differ: walk the running sequences oldest first; which need a block, what "
        "happens when none is free, and may anyone be admitted afterwards?"))


SCHEDULE = Exercise(
    name="schedule_step",
    signature=("schedule_step(running [(seq_id, num_tokens)], waiting [(seq_id, prompt_len)], num_free_blocks, "
               "block_size, max_num_seqs) -> (decoded, preempted, admitted, num_free_blocks)"),
    notebook="12_scheduler_step.ipynb",
    follows="minillm.paged.Scheduler.schedule (decodes first, preempt the newest, then admit in order)",
    reference=reference_schedule,
    hand_cases=schedule_cases,
    random_cases=schedule_random,
    judge=judge_schedule,
    # the capstone's kit hands a default step to a course that skipped this exercise: no answer here
    forbidden=("minillm.paged.scheduler.Scheduler.schedule", "minillm.exercises.capstone_kit.default_schedule_step"),
)

ENGINE_EXERCISES = (GATHER, ONLINE, SCHEDULE)
