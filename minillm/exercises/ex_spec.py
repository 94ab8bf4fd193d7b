"""Exercise 13: prompt lookup's n-gram proposer (Saxena 2023) and the arithmetic of a speculative pass's
rollback (Leviathan et al. 2023, Algorithm 1, with a KV cache). References: ``minillm.speculative.NgramProposer``
and ``minillm.paged.BlockManager`` (grow to every position the verify forward wrote, then truncate).
"""

from __future__ import annotations

import torch

from ..paged import BlockManager, blocks_for
from ..sampling import SamplingParams
from ..speculative import NgramProposer
from .checker import Case, Exercise, Failure, describe, first_match

# ---------------------------------------------------------------------------------------------
# 13. ngram_propose and rollback_after_verify


def reference_ngram(tokens, gamma, max_n, min_n):
    return NgramProposer(1 + max(tokens, default=0), max_n, min_n).propose(list(tokens), gamma, SamplingParams())[0]


def _ngram(tokens, gamma, max_n, min_n, *, latest=True, longest=True, include_self=False, cap=True, follow=True):
    ns = range(max_n, min_n - 1, -1) if longest else range(min_n, max_n + 1)
    for n in ns:
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        starts = range(len(tokens) - n - (0 if include_self else 1), -1, -1)
        for start in (starts if latest else reversed(starts)):
            if tokens[start:start + n] == suffix:
                first = start + n if follow else start
                return tokens[first:first + gamma] if cap else tokens[first:]
    return []


def ngram_cases() -> list[Case]:
    t = [5, 6, 7, 8, 5, 6, 9, 5, 6]
    return [
        Case("the latest earlier match of [5, 6] is followed by 9, 5, 6", (t, 3, 2, 1), [9, 5, 6]),
        Case("gamma 2 caps the draft", (t, 2, 2, 1), [9, 5]),
        Case("no 3-gram match: the longest n that matches wins (n = 2)", (t, 4, 3, 1), [9, 5, 6]),
        Case("nothing matches: no draft", ([1, 2, 3, 4], 4, 3, 1), []),
        Case("only a 1-gram matches, min_n 2: no draft", ([1, 2, 3, 1], 4, 3, 2), []),
        Case("a match near the end: the draft is shorter than gamma", ([3, 4, 3, 4], 5, 2, 1), [3, 4]),
    ]


def ngram_random(g) -> list[Case]:
    cases = []
    for i in range(4):
        n = int(torch.randint(8, 40, (), generator=g))
        tokens = torch.randint(0, 6, (n,), generator=g).tolist()
        gamma, max_n = int(torch.randint(1, 6, (), generator=g)), int(torch.randint(1, 4, (), generator=g))
        cases.append(Case(f"random {i + 1} ({n} tokens over 6 ids, gamma {gamma}, max_n {max_n})",
                          (tokens, gamma, max_n, 1)))
    return cases


def judge_ngram(case: Case, expected, got, args) -> Failure | None:
    if isinstance(got, torch.Tensor):
        got = got.tolist()
    if not isinstance(got, (list, tuple)) or not all(isinstance(x, int) for x in got):
        return Failure(describe(expected), describe(got), "return the draft as a list of token ids (ints)")
    if list(got) == list(expected):
        return None

    def wrong(**kw):
        return lambda: _ngram(*case.args, **kw)

    mutants = [
        (wrong(include_self=True), "the suffix matches itself at the end, which is followed by nothing: search the "
                                   "occurrences that start before it"),
        (wrong(latest=False), "take the latest earlier occurrence (search backwards from the end): recent text "
                              "predicts best"),
        (wrong(longest=False), "try the longest n first (max_n down to min_n): a longer match predicts better"),
        (wrong(cap=False), "at most gamma tokens: cap the draft"),
        (wrong(follow=False), "propose the tokens that followed the match, not the match itself"),
    ]
    hint = first_match(list(got), mutants, lambda a, b: list(a) == list(b))
    return Failure(describe(expected), describe(list(got)), hint or (
        "find the suffix by hand in this case: which n, which occurrence, which tokens follow it?"))


NGRAM = Exercise(
    name="ngram_propose",
    signature="ngram_propose(tokens, gamma, max_n, min_n) -> draft token ids (at most gamma)",
    notebook="13_speculative_mechanics.ipynb",
    follows="minillm.speculative.NgramProposer (prompt lookup, Saxena 2023)",
    reference=reference_ngram,
    hand_cases=ngram_cases,
    random_cases=ngram_random,
    judge=judge_ngram,
    forbidden=("minillm.speculative.proposers.NgramProposer.propose",),
)


def reference_rollback(num_cached, num_drafts, num_accepted, block_size):
    """The block manager's own count: grow to every position the verify forward wrote, then truncate."""
    m = BlockManager(blocks_for(num_cached + 1 + num_drafts, block_size) + 1, block_size, enable_prefix_caching=False)
    m.allocate(0)
    m.grow(0, num_cached + 1 + num_drafts)
    used = m.num_used_blocks
    kept = num_cached + 1 + num_accepted
    m.truncate(0, kept)
    return kept, num_accepted + 1, num_drafts - num_accepted, used - m.num_used_blocks


def rollback_cases() -> list[Case]:
    return [
        Case("10 cached, 4 drafts, 2 accepted, block_size 16", (10, 4, 2, 16), (13, 3, 2, 0)),
        Case("every draft accepted: nothing rolled back, the bonus token emitted", (10, 4, 4, 16), (15, 5, 0, 0)),
        Case("all rejected: one token still emitted", (10, 4, 0, 16), (11, 1, 4, 0)),
        Case("the rejected drafts filled a block of their own: it is freed", (14, 5, 0, 16), (15, 1, 5, 1)),
        Case("block_size 4: drafts over two more blocks, 1 accepted", (7, 6, 1, 4), (9, 2, 5, 1)),
    ]


def rollback_random(g) -> list[Case]:
    out = []
    for i, bs in enumerate((2, 4, 16, 8)):
        c, k = int(torch.randint(0, 100, (), generator=g)), int(torch.randint(1, 9, (), generator=g))
        a = int(torch.randint(0, k + 1, (), generator=g))
        out.append(Case(f"random {i + 1} ({c} cached, {k} drafts, {a} accepted, block_size {bs})", (c, k, a, bs)))
    return out


def judge_rollback(case: Case, expected, got, args) -> Failure | None:
    if not isinstance(got, (tuple, list)) or len(got) != 4 or not all(isinstance(x, int) for x in got):
        return Failure(describe(expected), describe(got), "return four ints: (cache_len, num_emitted, "
                       "num_discarded, blocks_freed)")
    if tuple(got) == tuple(expected):
        return None
    c, k, a, bs = case.args
    kept, emitted, discarded, freed = expected
    if got[0] == c + a:
        hint = ("the verify forward also wrote the pending token (the last one emitted before the pass): the "
                "cache keeps it, then the accepted drafts")
    elif got[1] == a:
        hint = "a pass always emits one more token than it accepts: the replacement at the rejection, or the bonus"
    elif got[2] == k - a + 1:
        hint = "only the rejected drafts' positions are discarded; the replacement token is not in the cache yet"
    elif got[3] != freed and list(got[:3]) == [kept, emitted, discarded]:
        hint = ("blocks freed: the blocks held for every position the forward wrote, less the blocks the kept "
                "positions need (a partly filled block is held)")
    else:
        hint = "draw the positions of this pass on paper: cached, pending, drafts; which stay, which go?"
    return Failure(describe(expected), describe(list(got)), hint)


ROLLBACK = Exercise(
    name="rollback_after_verify",
    signature=("rollback_after_verify(num_cached, num_drafts, num_accepted, block_size) -> "
               "(cache_len, num_emitted, num_discarded, blocks_freed)"),
    notebook="13_speculative_mechanics.ipynb",
    follows="minillm.speculative.speculative_generate's cache.truncate, counted by minillm.paged.BlockManager",
    reference=reference_rollback,
    hand_cases=rollback_cases,
    random_cases=rollback_random,
    judge=judge_rollback,
    forbidden=("minillm.paged.block_manager.BlockManager.truncate", "minillm.kv_cache.KVCache.truncate"),
)

SPEC_EXERCISES = (NGRAM, ROLLBACK)
