"""PagedKVCache and block attention against the contiguous cache, on tiny random models (fast); the
embedded model's 64-step runs are in test_paged_model.py."""

import pytest
import torch
from helpers import paged_cache, random_decoder

from minillm.generation import generate_cached
from minillm.kv_cache import KVCache, kv_cache_bytes
from minillm.lab.engine_costs import measure_attention_paths
from minillm.config import ModelConfig
from minillm.model import attention, attention_mask
from minillm.paged import BlockManager, NoFreeBlocksError, PagedKVCache, generate_paged, paged_attention
from minillm.sampling_params import SamplingParams

CFG = ModelConfig(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=300,
                  max_seq_len=128)
PATHS = ["indexed", "gather"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # the same code on every device


def shuffled_pool(cache: PagedKVCache, seed: int = 0) -> None:
    """Leave the free queue in a random order, so that block tables come out of order."""
    order = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    for i in range(cache.num_blocks):
        cache.add_sequence(1000 + i)
        cache.manager.grow(1000 + i, 1)
    for i in order:
        cache.free(1000 + i)


@pytest.mark.parametrize("path", PATHS)
def test_paged_attention_equals_contiguous_with_nan_in_unowned_slots(path):
    """Ragged decode over sequences ending mid-block and exactly at block boundaries, GQA (4 heads,
    2 KV heads), out-of-order block tables, every slot not holding a sequence's token set to NaN."""
    torch.manual_seed(0)
    bs, lens = 4, [5, 8, 13, 16, 1]  # the new token lands after: mid-block, at a boundary, ...
    cache = paged_cache(CFG, 24, bs, attention=path)
    shuffled_pool(cache)
    B, Hkv, D, H = len(lens), CFG.n_kv_heads, CFG.head_dim, CFG.n_heads
    keys = [torch.randn(Hkv, n + 1, D) for n in lens]  # each sequence's keys, its new token's last
    values = [torch.randn(Hkv, n + 1, D) for n in lens]
    for s in range(B):
        cache.add_sequence(s)
    cache.set_rows(range(B))
    T = max(lens)
    pos = torch.tensor([list(range(n)) + [-1] * (T - n) for n in lens])  # (B, T), -1: padding
    k = torch.stack([torch.cat([x[:, :-1], torch.zeros(Hkv, T - n, D)], 1) for x, n in zip(keys, lens)])
    v = torch.stack([torch.cat([x[:, :-1], torch.zeros(Hkv, T - n, D)], 1) for x, n in zip(values, lens)])
    cache.prepare(pos)
    cache.update(0, k, v)  # the prompts: (B, Hkv, T, D) with padding
    tables = [cache.manager.block_table(s) for s in range(B)]
    assert any(t != sorted(t) for t in tables)
    S = cache.prepare(torch.tensor([[n] for n in lens]))  # one new token per row
    owned = {slot for s, n in enumerate(lens) for slot in cache.manager.slot_mapping(s, range(n))}
    for pool in (cache.k[0], cache.v[0]):
        flat = pool.view(-1, Hkv, D)
        flat[[i for i in range(len(flat)) if i not in owned]] = float("nan")
    q = torch.randn(B, H, 1, D)
    k_all, v_all = cache.update(0, torch.stack([x[:, -1:] for x in keys]), torch.stack([x[:, -1:] for x in values]))
    mask = attention_mask(torch.tensor([[n] for n in lens]), torch.arange(S))
    out = attention(q, k_all, v_all, mask)  # (B, H, 1, D)
    for b in range(B):  # the contiguous cache's attention, one sequence at a time
        want = attention(q[b:b + 1], keys[b][None], values[b][None], None)
        torch.testing.assert_close(out[b:b + 1], want, rtol=1e-5, atol=1e-5)
    width = max(len(cache.manager.block_table(s)) for s in range(B))
    tables = [cache.manager.block_table(s) for s in range(B)]
    block_tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])  # padded with an own block
    blockwise = paged_attention(q, cache.k[0], cache.v[0], block_tables, torch.tensor(lens) + 1,
                                torch.tensor([[n] for n in lens]))
    torch.testing.assert_close(blockwise, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_block_attention_prefill_queries_and_padding(device):
    torch.manual_seed(1)
    bs, N, Hkv, D, H = 4, 10, 2, 16, 4
    k_pool, v_pool = torch.randn(N, bs, Hkv, D, device=device), torch.randn(N, bs, Hkv, D, device=device)
    table = torch.tensor([[7, 2, 9], [4, 4, 4]], device=device)  # row 1 holds one block, padded with its own
    lens = torch.tensor([11, 3], device=device)
    qpos = torch.tensor([[8, 9, 10], [1, 2, -1]], device=device)
    q = torch.randn(2, H, 3, D, device=device)
    out = paged_attention(q, k_pool, v_pool, table, lens, qpos)
    for b in range(2):
        slots = torch.cat([torch.arange(blk * bs, (blk + 1) * bs, device=device) for blk in table[b].tolist()])
        slots = slots[: lens[b]]
        k = k_pool.view(-1, Hkv, D)[slots].transpose(0, 1)[None]  # (1, Hkv, S, D)
        v = v_pool.view(-1, Hkv, D)[slots].transpose(0, 1)[None]
        real = qpos[b] >= 0
        mask = torch.arange(int(lens[b]), device=device)[None, :] <= qpos[b][real][:, None]
        want = attention(q[b:b + 1, :, real], k, v, mask)
        torch.testing.assert_close(out[b:b + 1, :, real], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1, :, 2].cpu(), torch.zeros(H, D))  # a padding query's output


def contiguous_logits(model, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Logits (len - prompt_len + 1, V) after the prompt and after each later token, through KVCache."""
    dev = model.device
    cache = KVCache(model.config, 1, len(tokens) + 1, device=dev)
    out = [model(torch.tensor([tokens[:prompt_len]], device=dev), torch.arange(prompt_len, device=dev), cache)[0, -1]]
    for i in range(prompt_len, len(tokens)):
        out.append(model(torch.tensor([[tokens[i]]], device=dev), torch.tensor([i], device=dev), cache)[0, -1])
    return torch.stack(out)


def ragged_run(model, cache, seqs, prompt_lens):
    """Prefill all prompts in one (B, T) forward with padding, then decode every row together."""
    B, T, dev = len(seqs), max(prompt_lens), model.device
    cache.set_rows(range(B))
    toks = torch.tensor([s[:n] + [0] * (T - n) for s, n in zip(seqs, prompt_lens)], device=dev)
    pos = torch.tensor([list(range(n)) + [-1] * (T - n) for n in prompt_lens], device=dev)
    logits = model(toks, pos, cache)
    outs = [[logits[b, n - 1]] for b, n in enumerate(prompt_lens)]
    for step in range(len(seqs[0]) - prompt_lens[0]):
        toks = torch.tensor([[s[n + step]] for s, n in zip(seqs, prompt_lens)], device=dev)
        logits = model(toks, torch.tensor([[n + step] for n in prompt_lens], device=dev), cache)
        for b in range(B):
            outs[b].append(logits[b, 0])
    return [torch.stack(o) for o in outs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_tiny_model_ragged_batch_equals_contiguous(path, device):
    model = random_decoder(300).to(device)
    torch.manual_seed(2)
    prompt_lens, steps = [3, 8, 13, 4], 10
    seqs = [torch.randint(0, 300, (n + steps,)).tolist() for n in prompt_lens]
    cache = paged_cache(model.config, 40, 4, device=device, attention=path)
    shuffled_pool(cache)
    for s in range(len(seqs)):
        cache.add_sequence(s)
    got = ragged_run(model, cache, seqs, prompt_lens)
    for s, n, g in zip(seqs, prompt_lens, got):
        torch.testing.assert_close(g[:-1], contiguous_logits(model, s, n)[:-1], rtol=1e-4, atol=1e-4)


def test_rows_of_one_sequence_in_one_forward_equal_one_prefill():
    """A prompt split into chunks given as consecutive rows of one forward (each layer writes every
    row before any row attends), beside another sequence's decode token."""
    model = random_decoder(300)
    prompt = torch.randint(0, 300, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    want = contiguous_logits(model, prompt, 14)[0]
    cache = paged_cache(model.config, 16, 4)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.set_rows([1])
    model(torch.tensor([[5, 6]]), torch.tensor([[0, 1]]), cache)
    cache.set_rows([0, 0, 1])  # rows 0 and 1: two chunks of sequence 0; row 2: sequence 1's next token
    toks = torch.tensor([prompt[:6], prompt[6:12], [7, 0, 0, 0, 0, 0]])
    pos = torch.tensor([list(range(6)), list(range(6, 12)), [2, -1, -1, -1, -1, -1]])
    model(toks, pos, cache)
    cache.set_rows([0])
    got = model(torch.tensor([prompt[12:]]), torch.tensor([12, 13]), cache)[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="give one sequence's rows in position order"):
        cache.set_rows([1, 1])
        model(torch.tensor([[1], [2]]), torch.tensor([[3], [5]]), cache)


def test_fork_copy_on_write_keeps_each_branch_equal_to_its_contiguous_run():
    model = random_decoder(300)
    prompt = [11, 12, 13, 14, 15, 16]  # 1.5 blocks of 4: the fork shares a partly filled block
    cache = paged_cache(model.config, 12, 4)
    cache.add_sequence(0)
    cache.set_rows([0])
    model(torch.tensor([prompt]), torch.arange(6), cache)
    cache.fork(0, 1)
    shared = cache.manager.block_table(0)
    branches = {0: [20, 21, 22], 1: [30, 31, 32]}
    got = {0: [], 1: []}
    for step in range(3):
        cache.set_rows([0, 1])
        logits = model(torch.tensor([[branches[0][step]], [branches[1][step]]]), torch.tensor([6 + step]), cache)
        for s in (0, 1):
            got[s].append(logits[s, 0])
    assert cache.manager.block_table(0)[0] == cache.manager.block_table(1)[0] == shared[0]  # full block: shared
    assert len({cache.manager.block_table(0)[1], cache.manager.block_table(1)[1], shared[1]}) == 2  # one copy
    for s in (0, 1):
        want = contiguous_logits(model, prompt + branches[s], 6)[1:]
        torch.testing.assert_close(torch.stack(got[s]), want, rtol=1e-4, atol=1e-4)
    cache.free(0)
    cache.free(1)
    assert cache.manager.num_free_blocks == 12


def test_truncate_rolls_back_and_rewrites():
    model = random_decoder(300)
    ids = list(range(1, 12))
    cache = paged_cache(model.config, 8, 4)
    cache.add_sequence(0)
    cache.set_rows([0])
    model(torch.tensor([ids + [99, 98]]), torch.arange(13), cache)
    cache.truncate(11)  # reject the two speculative tokens
    assert cache.seq_len == 11 and len(cache.manager.block_table(0)) == 3
    got = model(torch.tensor([[50]]), torch.tensor([11]), cache)[0, -1]
    torch.testing.assert_close(got, contiguous_logits(model, ids + [50], 11)[1], rtol=1e-4, atol=1e-4)
    again = model(torch.tensor([[50]]), torch.tensor([11]), cache)[0, -1]  # writing below seq_len overwrites
    torch.testing.assert_close(again, got)


def test_prepare_errors_and_no_free_blocks_changes_nothing():
    model = random_decoder(300)
    cache = paged_cache(model.config, 3, 4)
    with pytest.raises(ValueError, match="call set_rows"):
        model(torch.tensor([[1]]), torch.tensor([0]), cache)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.set_rows([0, 1])
    model(torch.tensor([[1] * 8, [2] * 8]), torch.tensor([list(range(8)), [0, 1, 2] + [-1] * 5]), cache)
    assert cache.manager.num_free_blocks == 0
    before = (cache.manager.block_table(0), cache.manager.block_table(1), cache.manager.free_block_ids())
    with pytest.raises(NoFreeBlocksError, match="need 1 free blocks but 0 of 3 are free"):
        model(torch.tensor([[3], [3]]), torch.tensor([[8], [3]]), cache)  # row 0's token 8 needs a new block
    assert before == (cache.manager.block_table(0), cache.manager.block_table(1), cache.manager.free_block_ids())
    assert cache.manager.num_tokens(0) == 8 and cache.manager.num_tokens(1) == 3
    with pytest.raises(ValueError, match="starts at 5 but sequence 1 holds only 3 positions"):
        model(torch.tensor([[3], [3]]), torch.tensor([[7], [5]]), cache)
    with pytest.raises(ValueError, match="must be consecutive"):
        model(torch.tensor([[3, 3], [3, 3]]), torch.tensor([[6, 8], [3, 4]]), cache)
    with pytest.raises(ValueError, match="per-row"):
        model(torch.tensor([[3]]), torch.tensor([[0]]), KVCache(model.config, 1, 8))


def test_pool_sized_by_bytes():
    bytes_per_block = kv_cache_bytes(CFG, 1, 16, 4)
    assert paged_cache(CFG, kv_bytes=3.5 * bytes_per_block).num_blocks == 3
    assert paged_cache(CFG, 5).nbytes == 5 * bytes_per_block
    with pytest.raises(ValueError, match="hold no block; one block of 16 tokens takes 4096 bytes"):
        paged_cache(CFG, kv_bytes=100)
    with pytest.raises(ValueError, match="exactly one of them"):
        paged_cache(CFG, 4, kv_bytes=1e6)


@pytest.mark.parametrize("path", PATHS)
def test_generate_paged_equals_generate_cached_tiny(path):
    model = random_decoder(300)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for prompt in ([5], list(range(1, 17)), list(range(3, 22))):
        want = generate_cached(model, prompt, params)
        got = generate_paged(model, prompt, params, block_size=4, attention=path)
        assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
    with pytest.raises(NoFreeBlocksError):
        generate_paged(model, [5], params, block_size=4, num_blocks=2)


@pytest.mark.parametrize("collide", [False, True])
def test_prefix_cache_hit_gives_the_logits_of_a_full_prefill(collide):
    """A second request with the same prompt starts from cached blocks (num_computed_tokens) and
    computes only the rest; with every hash colliding, verification still serves only matching blocks."""
    model = random_decoder(300)
    prompt = list(range(40, 51))  # 11 tokens: two full blocks of 4, then 3
    want = contiguous_logits(model, prompt, 11)[0]
    cache = paged_cache(model.config, 8, 4)
    if collide:
        cache.manager = BlockManager(8, 4, hash_fn=lambda parent, tokens: 0)
    other = [7, 7, 7, 7] + prompt[4:]  # same second block, other prefix: must not be served
    for s, ids in enumerate((prompt, other)):
        assert cache.add_sequence(s, ids) == 0
        cache.set_rows([s])
        model(torch.tensor([ids]), torch.arange(11), cache)
        cache.free(s)
    computed = cache.add_sequence(2, prompt)
    assert computed == (4 if collide else 8)  # colliding keys: only the block registered first is found
    cache.set_rows([2])
    got = model(torch.tensor([prompt[computed:]]), torch.arange(computed, 11), cache)[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert cache.manager.stats.hits == computed // 4


def test_measure_attention_paths_reports_each_path():
    timings = measure_attention_paths(seq_lens=(8, 20), block_size=4, repeats=1)
    assert list(timings) == [8, 20]
    assert all(set(t) == {"contiguous", "indexed", "blockwise"} and min(t.values()) > 0 for t in timings.values())
