"""The lab's FlexAttention read of the block pool gives the engine's indexed read + SDPA, and so does the
lab's one-layer "bucketed" step it is timed against."""

import pytest
import torch

from minillm.lab.flex_paged import bucketed_step, flex_decode, head_major, indexed_decode, paged_block_mask, random_step


@pytest.mark.slow  # one inductor compile of flex_attention (about 10 s)
@pytest.mark.parametrize("batch, lo, hi", [(3, 1, 40), (5, 16, 48)])
def test_flex_read_of_the_pool_equals_the_indexed_read(batch, lo, hi):
    q, k, v, tables, lens = random_step(batch, lo, hi, num_blocks=32, block_size=16, seed=batch)
    mask = paged_block_mask(tables, lens, 16, 32)
    with torch.inference_mode():
        got = flex_decode(q, head_major(k), head_major(v), mask)
        want = indexed_decode(q, k, v, tables, lens, 16)
    assert got.shape == want.shape == (batch, 9, 64)
    assert (got - want).abs().max() < 1e-5
    # a row that attends one block less would differ: the mask keeps every position below each length
    short = [n - 1 if n > 1 else n for n in lens]
    assert (flex_decode(q, head_major(k), head_major(v), paged_block_mask(tables, short, 16, 32)) - want).abs().max() > 1e-4
    # blocks reserved past a row's length (the engine grows tables before a step) are never read
    grown = [t + [b for b in range(32) if all(b not in u for u in tables)][:1] for t in tables]
    again = flex_decode(q, head_major(k), head_major(v), paged_block_mask(grown, lens, 16, 32))
    assert (again - want).abs().max() < 1e-5


def test_the_bucketed_step_it_is_timed_against_is_the_engines_attention():
    q, k, v, _, lens = random_step(4, 10, 60, num_blocks=64, seed=1)
    cache, tables, attend = bucketed_step(lens, 64, 16)
    cache.k[0].copy_(k)
    cache.v[0].copy_(v)
    with torch.inference_mode():
        got = attend(q)  # writes the step's (zero) keys and values at each row's last position, then attends
        want = indexed_decode(q, cache.k[0], cache.v[0], tables, lens, 16)
    assert [len(t) for t in tables] == [-(-n // 16) for n in lens]
    assert (got - want).abs().max() < 1e-5
