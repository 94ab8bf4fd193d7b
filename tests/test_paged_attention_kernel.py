"""minillm's fused PagedAttention kernel (minillm.fast.kernels.paged_attention) against its naive baseline, the
baseline against dense causal attention, and the kernel's refusals."""

import pytest
import torch
import torch.nn.functional as F

from minillm.fast import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.why_unavailable()}")


def scattered(seqs, block_size, Hkv, D, num_blocks, g, fill=0.0):
    """Each sequence's keys and values ((L, Hkv, D) each) written into a pool at random blocks; returns the
    pools (the slots no sequence holds set to ``fill``) and the (R, W) block tables."""
    k_pool = torch.full((num_blocks, block_size, Hkv, D), fill)
    v_pool = torch.full_like(k_pool, fill)
    order = torch.randperm(num_blocks, generator=g).tolist()
    W = max(-(-len(k) // block_size) for k, _ in seqs)
    tables = []
    for k, v in seqs:
        n = -(-len(k) // block_size)
        table = [order.pop() for _ in range(n)]
        for pos in range(len(k)):
            k_pool[table[pos // block_size], pos % block_size] = k[pos]
            v_pool[table[pos // block_size], pos % block_size] = v[pos]
        tables.append(table + [table[0]] * (W - n))
    return k_pool, v_pool, torch.tensor(tables)


def segments(query_lens, gap=0):
    """query_start for segments side by side (``gap`` unused queries before each)."""
    starts, at = [], 0
    for T in query_lens:
        starts.append(at + gap)
        at += gap + T
    return torch.tensor(starts), at


@pytest.mark.parametrize("block_size,Hkv,G,D", [(16, 3, 3, 64), (4, 2, 4, 16), (7, 1, 1, 8), (32, 2, 2, 32)])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [3, 1, 5], [1, 17], [40]])
def test_kernel_equals_naive_and_dense_causal_attention(block_size, Hkv, G, D, query_lens):
    g = torch.Generator().manual_seed(block_size * 100 + sum(query_lens))
    H = Hkv * G
    seq_lens = [T + int(torch.randint(0, 50, (), generator=g)) for T in query_lens]
    seqs = [(torch.randn(L, Hkv, D, generator=g), torch.randn(L, Hkv, D, generator=g)) for L in seq_lens]
    k_pool, v_pool, tables = scattered(seqs, block_size, Hkv, D, num_blocks=64, g=g)
    starts, N = segments(query_lens, gap=1)
    q = torch.randn(N, H, D, generator=g) * 2
    args = (tables, starts, torch.tensor(query_lens), torch.tensor(seq_lens))
    out = kernels.paged_attention(q, k_pool, v_pool, *args)
    naive = kernels.paged_attention_naive(q, k_pool, v_pool, *args)
    assert out.shape == (N, H, D)
    assert torch.allclose(out, naive, atol=2e-6, rtol=1e-5)
    covered = torch.zeros(N, dtype=torch.bool)
    for (k, v), start, T, L in zip(seqs, starts.tolist(), query_lens, seq_lens):
        covered[start:start + T] = True
        qs = q[start:start + T].transpose(0, 1)  # (H, T, D)
        kh, vh = (x.transpose(0, 1).repeat_interleave(G, dim=0) for x in (k, v))  # (H, L, D)
        mask = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]  # query t at position L - T + t
        dense = F.scaled_dot_product_attention(qs, kh, vh, attn_mask=mask).transpose(0, 1)
        assert torch.allclose(naive[start:start + T], dense, atol=1e-5, rtol=1e-5)
    assert (out[~covered] == 0).all()  # queries in no segment


def test_slots_a_sequence_does_not_hold_are_never_read():
    """Unused slots (the rest of a last block, other blocks) full of NaN leave the output finite and unchanged."""
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randn(L, 2, 16, generator=g), torch.randn(L, 2, 16, generator=g)) for L in (5, 21, 16)]
    q = torch.randn(3, 4, 16, generator=g)
    args = (torch.arange(3), torch.ones(3, dtype=torch.long), torch.tensor([5, 21, 16]))
    outs = []
    for fill in (0.0, float("nan")):
        k_pool, v_pool, tables = scattered(seqs, 8, 2, 16, num_blocks=12, g=torch.Generator().manual_seed(2), fill=fill)
        outs.append(kernels.paged_attention(q, k_pool, v_pool, tables, *args))
    assert torch.isfinite(outs[1]).all() and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(tables=a["tables"].clone().fill_(99)), "block 99"),
    (lambda a: a.update(query_start=torch.tensor([0, 3])), "outside the"),
    (lambda a: a.update(seq_lens=torch.tensor([1, 4])), "at least its 2 queries"),
    (lambda a: a.update(seq_lens=torch.tensor([100, 4])), "at most its table's"),
    (lambda a: a.update(q=a["q"].double()), "float32"),
    (lambda a: a.update(query_len=torch.tensor([2], dtype=torch.long)), "one per row"),
    (lambda a: a.update(query_start=torch.tensor([2 ** 63 - 1, 2])), "outside the"),  # start + len would overflow
    (lambda a: a.update(query_start=torch.tensor([0, 1])), "segments overlap at query 1"),
])
def test_kernel_refuses_what_would_read_outside_its_tensors(change, message):
    a = dict(q=torch.randn(4, 2, 8), k_pool=torch.zeros(4, 4, 1, 8), v_pool=torch.zeros(4, 4, 1, 8),
             tables=torch.tensor([[0, 1], [2, 3]]), query_start=torch.tensor([0, 2]),
             query_len=torch.tensor([2, 2]), seq_lens=torch.tensor([5, 4]))
    kernels.paged_attention(*a.values())  # valid as given
    change(a)
    with pytest.raises(RuntimeError, match=message):
        kernels.paged_attention(*a.values())
    if "overlap" in message:  # the baseline refuses the same
        with pytest.raises(RuntimeError, match=message):
            kernels.paged_attention_naive(*a.values())


@pytest.mark.parametrize("position", [0, 3, 8, 15])
def test_a_nan_key_gives_nan_as_the_naive_path_does(position):
    """A NaN among a sequence's keys makes its queries' output NaN wherever the key sits in its block (a
    clamp inside the vectorised exp must not turn the NaN into a weight of 0)."""
    g = torch.Generator().manual_seed(position)
    k, v = torch.randn(16, 1, 8, generator=g), torch.randn(16, 1, 8, generator=g)
    k[position] = float("nan")
    k_pool, v_pool, tables = scattered([(k, v)], 8, 1, 8, num_blocks=4, g=g)
    args = (tables, torch.tensor([0]), torch.tensor([1]), torch.tensor([16]))
    q = torch.randn(1, 2, 8, generator=g)
    assert kernels.paged_attention(q, k_pool, v_pool, *args).isnan().all()
    assert kernels.paged_attention_naive(q, k_pool, v_pool, *args).isnan().all()
