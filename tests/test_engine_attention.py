"""The engine's attention path ("bucketed": rows grouped by length, the cache attends) against the
"indexed" and "gather" references, the bucketing's partition, and logits at chosen positions only;
tiny random models (fast)."""

import pytest
import torch
from helpers import paged_cache, random_decoder

from minillm.fast import kernels
from minillm import SamplingParams
from minillm.config import ModelConfig
from minillm.model import attention, attention_mask
from minillm.paged import LLMEngine, PagedKVCache, pack_flat, pack_rows, pack_rows_naive
from minillm.fast.paged import buckets

CFG = ModelConfig(n_layers=1, dim=96, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=300,
                  max_seq_len=128)  # G = 3 query heads per KV head


#: the paths that attend themselves, with the fused kernel's share varied (where it is not built, every
#: variant runs without it): "bucketed" with no row and with every row fused, "fused" falling back to torch's online softmax
FUSED_VARIANTS = {"bucketed/no-fused": ("bucketed", 0, None), "bucketed/all-fused": ("bucketed", 10 ** 6, None),
                  "fused/torch": ("fused", None, False)}


def cache_holding(held: list[int], path: str):
    """A pool of 40 blocks of 4 with sequence s holding held[s] random keys and values (and 8 more known,
    for its new tokens); returns (cache, keys, values), keys[s] and values[s] (Hkv, held[s] + 8, D).
    ``path``: an attention path or one of ``FUSED_VARIANTS``."""
    Hkv, D = CFG.n_kv_heads, CFG.head_dim
    path, max_queries, fused_ok = FUSED_VARIANTS.get(path, (path, None, None))
    cache = paged_cache(CFG, 40, 4, attention=path)
    if max_queries is not None:
        cache.fused_max_queries = max_queries
    if fused_ok is False:
        cache._fused_ok = False
    keys = [torch.randn(Hkv, n + 8, D) for n in held]
    values = [torch.randn(Hkv, n + 8, D) for n in held]
    for s, n in enumerate(held):
        cache.add_sequence(s)
        if n:
            cache.manager.grow(s, n)
            slots = cache.manager.slot_mapping(s, range(n))
            for pool, x in ((cache.k[0], keys[s]), (cache.v[0], values[s])):
                pool.view(-1, Hkv, D)[slots] = x[:, :n].transpose(0, 1)
    return cache, keys, values


def nan_in_unowned_slots(cache) -> None:
    """NaN in every slot of layer 0 that no sequence holds (a read outside a sequence shows up)."""
    Hkv, D = CFG.n_kv_heads, CFG.head_dim
    owned = {slot for s in cache.manager.seq_ids() for slot in cache.manager.slot_mapping(s, range(cache.manager.num_tokens(s)))}
    for pool in (cache.k[0], cache.v[0]):
        flat = pool.view(-1, Hkv, D)
        flat[[i for i in range(len(flat)) if i not in owned]] = float("nan")


def test_buckets_partition_the_rows_and_follow_the_cost():
    lens = [40, 3, 41, 3, 100, 4, 39]
    groups = buckets(lens, bucket_cost=10)
    assert sorted(b for g in groups for b in g) == list(range(len(lens)))
    assert [sorted(lens[b] for b in g) for g in groups] == [[3, 3, 4], [39, 40, 41], [100]]
    assert buckets(lens, bucket_cost=10 ** 6) == [sorted(range(len(lens)), key=lens.__getitem__)]  # one group
    assert buckets(lens, bucket_cost=0) == [[1, 3], [5], [6], [0], [2], [4]]  # equal lengths only share


@pytest.mark.parametrize("path", ["indexed", "gather", "bucketed", "blockwise", "fused", *FUSED_VARIANTS])
def test_mixed_prefill_and_decode_rows_with_nan_in_unowned_slots(path):
    """Decode rows of several lengths, a prefill chunk cut into two rows of one sequence (the later row
    sees the earlier one's keys) and a padding position, rows out of length order, GQA with G = 3, and
    NaN in every slot no sequence holds: each path gives, per row, attention over that sequence's keys
    alone (the contiguous computation)."""
    torch.manual_seed(0)
    H, D = CFG.n_heads, CFG.head_dim
    held = [9, 2, 17, 0]  # tokens already cached per sequence; sequence 3 is new (its prompt: two rows)
    cache, keys, values = cache_holding(held, path)
    rows = [2, 3, 0, 3, 1]  # sequence 3's rows in position order, the others between them
    T = 4
    pos = torch.tensor([[17, -1, -1, -1], [0, 1, 2, 3], [9, -1, -1, -1], [4, 5, 6, -1], [2, -1, -1, -1]])
    cache.set_rows(rows)
    S = cache.prepare(pos)
    nan_in_unowned_slots(cache)
    k_new = torch.stack([keys[s][:, p.clamp_min(0)] for s, p in zip(rows, pos)])  # (B, Hkv, T, D)
    v_new = torch.stack([values[s][:, p.clamp_min(0)] for s, p in zip(rows, pos)])
    q = torch.randn(len(rows), H, T, D)
    out = cache.attend(0, q, k_new, v_new, attention_mask(pos, torch.arange(S)))
    for b, (s, p) in enumerate(zip(rows, pos)):
        real = p >= 0
        n = int(p[real].max()) + 1
        mask = torch.arange(n)[None, :] <= p[real][:, None]
        want = attention(q[b:b + 1, :, real], keys[s][None, :, :n], values[s][None, :, :n], mask)
        torch.testing.assert_close(out[b:b + 1, :, real], want, rtol=1e-5, atol=1e-5)
    assert not out.isnan().any()


@pytest.mark.parametrize("path", ["bucketed", "fused"])
def test_a_head_dim_the_fused_kernel_cannot_take_runs_without_it(path):
    """head_dim 12 (not a multiple of 8): both flat paths run on gather + SDPA / torch's online softmax, with the
    tokens of the "indexed" reference."""
    model = random_decoder(100, head_dim=12)
    outs = []
    for read in ("indexed", path):
        engine = LLMEngine(model, block_size=4, num_blocks=16, attention=read)
        engine.add_request("a", {"prompt_token_ids": [1, 2, 3, 4, 5]}, SamplingParams(max_tokens=5, ignore_eos=True))
        while engine.has_unfinished_requests():
            done = [o for o in engine.step() if o.finished]
        assert engine.cache._fused_ok is False
        outs.append(done[0].outputs[0].token_ids)
    assert outs[0] == outs[1]


def test_bucketed_cache_refuses_update():
    cache = paged_cache(CFG, 4, 4, attention="bucketed")
    cache.add_sequence(0)
    cache.set_rows([0])
    cache.prepare(torch.tensor([0]))
    with pytest.raises(ValueError, match="attends itself"):
        cache.update(0, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))


def test_logits_indices_give_those_positions_logits():
    model = random_decoder(300)
    toks = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = model(toks, torch.arange(5))
        some = model(toks, torch.arange(5), logits_indices=torch.tensor([4, 9, 2]))
    torch.testing.assert_close(some, torch.stack([full[0, 4], full[1, 4], full[0, 2]]), rtol=1e-5, atol=1e-5)


def test_packer_orders_rows_by_their_end_and_keeps_the_naive_logits():
    """pack_rows sorts rows by where they end (a sequence's rows stay in position order); the bucketed
    engine's logits at each sequence's last token equal the naive one-row-per-sequence packing's."""
    model = random_decoder(300)
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 17, 1, 8, 12)]
    rows = pack_rows([(i, 0, p) for i, p in enumerate(ps)], 17, width=4)
    ends = [int(r.max()) + 1 for r in rows.input_pos]
    assert ends == sorted(ends)
    outs = []
    for pack, path in ((pack_rows_naive, "indexed"), (lambda spans, S: pack_rows(spans, S, width=4), "bucketed")):
        engine = LLMEngine(model, block_size=4, num_blocks=32, attention=path)
        for i, p in enumerate(ps):
            engine.manager.allocate(i, p)
        rows = pack([(i, 0, p) for i, p in enumerate(ps)], 17)
        engine.cache.set_rows(rows.seq_ids)
        with torch.inference_mode():
            outs.append(model(rows.tokens, rows.input_pos, engine.cache,
                              logits_indices=rows.logits_indices(range(len(ps)))))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("path", ["bucketed", "blockwise", "fused", *FUSED_VARIANTS])
def test_flat_row_of_segments_attends_each_over_its_own_sequence(path):
    """One flat row (1, N) of segments (set_rows with widths): decode tokens at several lengths, a new
    sequence's 6-token prompt, a 3-token chunk of a sequence holding 9, segments out of order, GQA with
    G = 3, NaN in every slot no sequence holds: each segment's output is attention over its own
    sequence's keys alone, and every new key lands in its sequence's slots."""
    torch.manual_seed(1)
    H, Hkv, D = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    cache, keys, values = cache_holding([9, 2, 17, 0, 5], path)
    segments = [(2, 17, 1), (3, 0, 6), (1, 2, 1), (0, 9, 3), (4, 5, 1)]  # (sequence, first position, tokens)
    pos = torch.tensor([[p for _, a, n in segments for p in range(a, a + n)]])  # (1, N)
    cache.set_rows([s for s, _, _ in segments], [n for _, _, n in segments])
    cache.prepare(pos)
    nan_in_unowned_slots(cache)
    k_new = torch.cat([keys[s][:, a:a + n] for s, a, n in segments], dim=1)[None]  # (1, Hkv, N, D)
    v_new = torch.cat([values[s][:, a:a + n] for s, a, n in segments], dim=1)[None]
    q = torch.randn(1, H, pos.shape[1], D)
    out = cache.attend(0, q, k_new, v_new, None)  # (1, H, N, D)
    assert out.shape == q.shape and not out.isnan().any()
    if kernels.available():  # the segments the fused kernel attended (its query counts): all, or the short ones
        fused = {"bucketed": [1, 1, 3, 1], "fused": [1, 6, 1, 3, 1], "bucketed/all-fused": [1, 6, 1, 3, 1]}
        held = getattr(cache, "_fused", None)  # the library's "blockwise" has no fused kernel
        assert (held[2].tolist() if held is not None else []) == fused.get(path, [])
    t = 0
    for s, a, n in segments:
        mask = torch.arange(a + n)[None, :] <= torch.arange(a, a + n)[:, None]  # (n, a + n)
        want = attention(q[:, :, t:t + n], keys[s][None, :, :a + n], values[s][None, :, :a + n], mask)
        torch.testing.assert_close(out[:, :, t:t + n], want, rtol=1e-5, atol=1e-5)
        got_k = cache.k[0].view(-1, Hkv, D)[cache.manager.slot_mapping(s, range(a, a + n))].transpose(0, 1)
        torch.testing.assert_close(got_k, keys[s][:, a:a + n])
        t += n


def test_flat_row_refusals_name_the_problem():
    cache = paged_cache(CFG, 8, 4, attention="indexed")
    cache.add_sequence(0)
    with pytest.raises(ValueError, match="widths: a flat row of segments needs attention in"):
        cache.set_rows([0], [1])
    cache = paged_cache(CFG, 8, 4, attention="bucketed")
    cache.add_sequence(0)
    with pytest.raises(ValueError, match="one width >= 1 per sequence"):
        cache.set_rows([0], [1, 2])
    cache.set_rows([0], [3])
    with pytest.raises(ValueError, match=r"needs shape \(1, 3\)"):
        cache.prepare(torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="one span per sequence"):
        pack_flat([(0, 0, [1, 2]), (0, 2, [3])])
    with pytest.raises(ValueError, match="row_width: attention='bucketed' packs one flat row"):
        LLMEngine(random_decoder(300), attention="bucketed", row_width=4)
    with pytest.raises(ValueError, match="attention: 'paged' is not one of"):
        LLMEngine(random_decoder(300), attention="paged")


def test_flat_packing_keeps_the_naive_logits():
    """pack_flat (one (1, N) row, segments ordered by width then end) gives, at each sequence's last
    token, the logits of the naive one-row-per-sequence packing on the "indexed" path; and the
    sequences' later decode tokens (a flat row of single tokens) too."""
    model = random_decoder(300)
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 17, 1, 8, 12)]
    nxt = [int(t) for t in torch.randint(0, 300, (5,), generator=g)]
    rows = pack_flat([(i, 0, p) for i, p in enumerate(ps)])
    assert rows.shape == (1, sum(map(len, ps))) and rows.widths == sorted(map(len, ps))
    outs = []
    for pack, path in ((pack_rows_naive, "indexed"), (lambda spans, S: pack_flat(spans), "bucketed")):
        engine = LLMEngine(model, block_size=4, num_blocks=32, attention=path)
        for i, p in enumerate(ps):
            engine.manager.allocate(i, p)
        step = []
        for spans in ([(i, 0, p) for i, p in enumerate(ps)], [(i, len(p), [nxt[i]]) for i, p in enumerate(ps)]):
            rows = pack(spans, 18)
            engine.cache.set_rows(rows.seq_ids, rows.widths)
            with torch.inference_mode():
                step.append(model(rows.tokens, rows.input_pos, engine.cache,
                                  logits_indices=rows.logits_indices(range(len(ps)))))
        outs.append(torch.cat(step))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)
