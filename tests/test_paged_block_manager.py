"""The block manager without a model: the blocks_for rule, fork and copy-on-write, prefix caching, the
errors, and (hypothesis) the invariants after random allocate / grow / fork / truncate / free / lookups."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minillm.paged import BlockManager, BlockPool, DoubleFreeError, NoFreeBlocksError, UnknownSequenceError, blocks_for


def test_block_pool_takes_plain_blocks_first_and_reusable_ones_last():
    pool = BlockPool(4)
    a, b, c = pool.take(), pool.take(), pool.take()
    assert (a, b, c) == (0, 1, 2) and pool.free_block_ids() == [3] and pool.ref_counts == [1, 1, 1, 0]
    pool.incref(a)  # a second table holds a
    pool.release(a, reusable=True)
    assert pool.ref_counts[a] == 1 and pool.num_free_blocks == 1  # still held: not queued
    pool.release(a, reusable=True)  # a cached prefix block: evicted last
    pool.release(b)  # holds nothing reusable: taken first
    pool.release(c, reusable=True)
    assert pool.free_block_ids() == [b, 3, a, c] and pool.ref_counts == [0, 0, 0, 0]
    pool.incref(a)  # a prefix hit on a free block takes it out of the queue, wherever it is
    assert pool.free_block_ids() == [b, 3, c] and pool.ref_counts[a] == 1
    assert [pool.take() for _ in range(3)] == [b, 3, c]
    with pytest.raises(NoFreeBlocksError, match="need 1 free blocks but 0 of 4 are free"):
        pool.check_free(1)
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_blocks_for_rule_one_block_per_block_size_tokens():
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate(0)
    taken_at = []
    for n in range(1, 17):
        before = m.num_used_blocks
        m.grow(0, n)
        assert len(m.block_table(0)) == blocks_for(n, 4) == -(-n // 4)
        if m.num_used_blocks > before:
            taken_at.append(n - 1)  # the position of the token that took a block
    assert taken_at == [0, 4, 8, 12]  # exactly when a token lands at a multiple of block_size
    m.truncate(0, 8)  # a multiple of block_size: the last block is full, not empty
    assert len(m.block_table(0)) == 2 and m.num_free_blocks == 6
    m.truncate(0, 5)
    assert len(m.block_table(0)) == 2
    m.truncate(0, 0)
    assert m.block_table(0) == [] and m.num_free_blocks == 8


def test_fork_shares_blocks_and_copy_on_write_only_the_partly_filled_one():
    m = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    m.allocate(0)
    m.grow(0, 6)  # blocks [a, b], b holds 2 tokens
    a, b = m.block_table(0)
    m.fork(0, 1)
    m.fork(0, 2)
    assert m.ref_counts[a] == m.ref_counts[b] == 3 and m.num_used_blocks == 2
    copies = m.grow(1, 7)  # the first write into the shared, partly filled block copies it
    (src, dst), = copies
    assert src == b and m.block_table(1) == [a, dst] and m.block_table(0) == [a, b]
    assert m.ref_counts[b] == 2 and m.ref_counts[dst] == 1
    assert m.grow(1, 8) == []  # now its own: written in place
    assert m.grow(0, 9)[0][0] == b  # the parent's block is still shared with child 2: copied too
    assert m.grow(2, 7) == []  # child 2 is the last owner of b: no copy
    for s in (0, 1, 2):
        m.free(s)
    assert m.num_free_blocks == 8 and sorted(m.free_block_ids()) == list(range(8))  # each block once


def test_fork_at_a_block_boundary_copies_nothing():
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate(0)
    m.grow(0, 8)
    m.fork(0, 1)
    assert m.grow(1, 9) == [] and m.block_table(1)[:2] == m.block_table(0)


def test_prefix_cache_hit_keeps_last_token_and_counts():
    m = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(12))  # three full blocks
    assert m.allocate(0, prompt) == 0
    m.grow(0, 12)
    assert m.stats.queries == 2 and m.stats.hits == 0  # (12 - 1) // 4 blocks are looked up
    assert m.allocate(1, prompt) == 8  # the third block holds the last token: computed again
    assert m.block_table(1) == m.block_table(0)[:2]
    assert m.stats.hits == 2 and m.stats.misses == 2 and m.stats.hit_rate == 0.5
    assert m.allocate(2, prompt + [99]) == 12  # one more token: all three blocks hit
    assert m.allocate(3, [7] + prompt[1:]) == 0  # first block differs: nothing after it matches
    assert m.allocate(4, prompt[4:8] + prompt[4:8] + [1]) == 0  # same block tokens, other prefix: a miss


def test_prefix_cache_survives_free_and_is_evicted_lru():
    m = BlockManager(num_blocks=6, block_size=2)
    for s, prompt in enumerate(([1, 2, 3, 4, 9], [5, 6, 7, 8, 9])):
        m.allocate(s, prompt)
        m.grow(s, 5)
    (a0, a1, a2), (b0, b1, b2) = m.block_table(0), m.block_table(1)
    m.free(0)
    m.free(1)
    # partly filled (uncached) blocks are taken first, then the cached ones least recently freed
    # first, each sequence's last block before its first
    assert m.free_block_ids() == [b2, a2, a1, a0, b1, b0]
    assert [m.is_cached(b) for b in m.free_block_ids()] == [False, False, True, True, True, True]
    assert m.allocate(2, [1, 2, 3, 4, 0]) == 4  # freed blocks are still found
    m.free(2)
    m.allocate(3, [0] * 11)  # takes every block: evicts everything
    m.grow(3, 11)
    m.free(3)
    assert m.allocate(4, [1, 2, 3, 4, 0]) == 0  # reallocated blocks are no longer found under old hashes


def test_freed_block_reused_for_other_tokens_is_not_found():
    m = BlockManager(num_blocks=2, block_size=2)
    m.allocate(0, [1, 2, 3])
    m.grow(0, 3)
    m.free(0)
    m.allocate(1, [5, 6, 7])  # takes the cached block [1, 2] for other tokens
    m.grow(1, 3)
    m.free(1)
    assert m.allocate(2, [1, 2, 0]) == 0


def test_hash_collision_costs_a_miss_not_wrong_blocks():
    m = BlockManager(num_blocks=8, block_size=2, hash_fn=lambda parent, tokens: 0)  # everything collides
    m.allocate(0, [1, 2, 3, 4, 5])
    m.grow(0, 5)
    assert m.allocate(1, [3, 4, 3, 4, 5]) == 0  # same key, other tokens: refused
    assert m.allocate(2, [1, 2, 3, 4, 5]) == 2  # the block registered under the key still serves


def test_truncated_cached_block_is_copied_or_uncached_before_rewrite():
    m = BlockManager(num_blocks=8, block_size=2)
    m.allocate(0, [1, 2, 3, 4, 5])
    m.grow(0, 5)
    b = m.block_table(0)[1]
    assert m.is_cached(b)
    m.truncate(0, 3)  # cuts into the full cached block [3, 4]
    m.add_token_ids(0, [8])
    m.grow(0, 4)  # rewrites it: no longer findable under [3, 4]
    assert m.block_table(0)[1] == b
    assert m.allocate(1, [1, 2, 3, 4, 5]) == 2  # no longer found under [3, 4] ...
    assert m.allocate(2, [1, 2, 3, 8, 0]) == 4  # ... but under what it holds now


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(num_blocks=0)
    m = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="pool too small: 9 tokens need 3 blocks"):
        m.allocate(0, list(range(9)))
    m.allocate(0)
    with pytest.raises(ValueError, match="already allocated"):
        m.allocate(0)
    m.grow(0, 3)
    with pytest.raises(ValueError, match="position 3 is past sequence 0's 3 tokens"):
        m.slot_mapping(0, [3])
    with pytest.raises(UnknownSequenceError, match="sequence 7 was never allocated"):
        m.grow(7, 1)
    m.allocate(1)
    with pytest.raises(NoFreeBlocksError, match="need 2 free blocks but 1 of 2 are free"):
        m.grow(1, 5)
    assert m.block_table(1) == [] and m.num_free_blocks == 1  # nothing changed
    m.free(1)
    with pytest.raises(DoubleFreeError, match="sequence 1 was already freed"):
        m.free(1)
    with pytest.raises(UnknownSequenceError, match="sequence 1 was freed"):
        m.fork(1, 2)
    with pytest.raises(ValueError, match="use truncate"):
        m.grow(0, 2)
    with pytest.raises(ValueError, match="cannot truncate sequence 0 of 3 tokens to 4"):
        m.truncate(0, 4)


def test_slot_mapping_formula():
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate(9)
    m.allocate(0)
    m.grow(9, 4)  # sequence 9 takes block 0, so sequence 0's table starts elsewhere
    m.grow(0, 10)
    table = m.block_table(0)
    assert m.slot_mapping(0, range(10)) == [table[p // 4] * 4 + p % 4 for p in range(10)]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / fork / grow-after-fork / truncate / free / prefix lookups, with a shadow
    pool: each slot holds the prefix its keys and values would depend on (the tokens up to and including
    its own), and every slot a sequence reads must hold that sequence's prefix, so copy-on-write and
    prefix hits are checked for content, not only for counts."""

    @initialize(num_blocks=st.integers(3, 12), block_size=st.sampled_from([1, 2, 3, 4]), collide=st.booleans())
    def setup(self, num_blocks, block_size, collide):
        hash_fn = (lambda parent, tokens: 0) if collide else (lambda parent, tokens: hash((parent, tokens)))
        self.m = BlockManager(num_blocks, block_size, hash_fn=hash_fn)
        self.pool = [None] * (num_blocks * block_size)  # token id "stored" in each slot
        self.truth: dict[int, list[int]] = {}  # each sequence's tokens
        self.next_id = 0

    def _write(self, seq, start, end):
        for p, slot in zip(range(start, end), self.m.slot_mapping(seq, range(start, end))):
            self.pool[slot] = tuple(self.truth[seq][:p + 1])

    @rule(prompt=st.lists(st.integers(0, 1), max_size=10))
    def allocate(self, prompt):
        if blocks_for(len(prompt), self.m.block_size) > self.m.num_blocks:
            with pytest.raises(ValueError, match="pool too small"):
                self.m.allocate(self.next_id, prompt)
            return
        seq, self.next_id = self.next_id, self.next_id + 1
        computed = self.m.allocate(seq, prompt)
        assert computed < max(len(prompt), 1) and computed % self.m.block_size == 0
        self.truth[seq] = list(prompt)

    @precondition(lambda self: self.truth)
    @rule(data=st.data(), new=st.lists(st.integers(0, 1), max_size=5))
    def grow(self, data, new):
        seq = data.draw(st.sampled_from(sorted(self.truth)))
        self.m.add_token_ids(seq, new)
        self.truth[seq] += new
        start, end = self.m.num_tokens(seq), len(self.truth[seq])
        before = (self.m.block_table(seq), self.m.free_block_ids(), list(self.m.ref_counts))
        try:
            copies = self.m.grow(seq, end)
        except NoFreeBlocksError:
            assert before == (self.m.block_table(seq), self.m.free_block_ids(), list(self.m.ref_counts))
            self.m.truncate(seq, start)  # forget the tokens that found no room
            del self.truth[seq][start:]
            return
        bs = self.m.block_size
        for src, dst in copies:
            self.pool[dst * bs:(dst + 1) * bs] = self.pool[src * bs:(src + 1) * bs]
        self._write(seq, start, end)

    @precondition(lambda self: self.truth)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.truth)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.m.fork(parent, child)
        self.truth[child] = list(self.truth[parent])

    @precondition(lambda self: self.truth)
    @rule(data=st.data())
    def truncate(self, data):
        seq = data.draw(st.sampled_from(sorted(self.truth)))
        n = data.draw(st.integers(0, self.m.num_tokens(seq)))
        self.m.truncate(seq, n)
        del self.truth[seq][n:]

    @precondition(lambda self: self.truth)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.truth)))
        self.m.free(seq)
        del self.truth[seq]
        with pytest.raises(DoubleFreeError):
            self.m.free(seq)

    @invariant()
    def counts_and_content(self):
        if not hasattr(self, "m"):
            return
        m, owners = self.m, {}
        for seq in m.seq_ids():
            table = m.block_table(seq)
            assert len(table) == blocks_for(m.num_tokens(seq), m.block_size) and len(set(table)) == len(table)
            for b in table:
                owners[b] = owners.get(b, 0) + 1
            n = m.num_tokens(seq)
            assert m.token_ids(seq) == self.truth[seq]
            truth = self.truth[seq]
            assert [self.pool[s] for s in m.slot_mapping(seq, range(n))] == [tuple(truth[:p + 1]) for p in range(n)]
        free = m.free_block_ids()
        assert all(m.ref_counts[b] == owners.get(b, 0) for b in range(m.num_blocks))
        assert len(free) + len(owners) == m.num_blocks and not set(free) & set(owners)
        assert len(set(free)) == len(free)

    def teardown(self):
        if hasattr(self, "m"):
            for seq in list(self.truth):
                self.m.free(seq)
            assert self.m.num_free_blocks == self.m.num_blocks
            assert all(r == 0 for r in self.m.ref_counts)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
test_block_manager_invariants = BlockManagerMachine.TestCase


@settings(max_examples=50, deadline=None)
@given(block_size=st.integers(1, 8), lengths=st.lists(st.integers(0, 40), min_size=1, max_size=6))
def test_grow_and_truncate_hold_exactly_blocks_for(block_size, lengths):
    m = BlockManager(num_blocks=64, block_size=block_size)
    m.allocate(0)
    for n in lengths:
        if n >= m.num_tokens(0):
            m.grow(0, n)
        else:
            m.truncate(0, n)
        assert len(m.block_table(0)) == blocks_for(n, block_size)
        assert m.num_used_blocks == blocks_for(n, block_size)
