"""The embedded model through PagedKVCache against the contiguous KVCache: logits at every step of a
64-token greedy run, for one sequence and for a ragged batch (the real-model half of test_paged.py)."""

import pytest
import torch

from helpers import paged_cache

from minillm.kv_cache import KVCache
from minillm.paged import PagedKVCache, generate_paged
from minillm.sampling_params import SamplingParams

STEPS = 64
PROMPTS = ("Hi", "The three witches met on the heath and spoke of Macbeth",
           "Fair is foul, and foul is fair: hover through the fog and filthy air, said the witches, and")


def greedy_contiguous(model, ids):
    """(tokens, logits (STEPS, V)) of a greedy run through KVCache: logits after the prompt and after
    each new token but the last."""
    cache = KVCache(model.config, 1, len(ids) + STEPS)
    logits = [model(torch.tensor([ids]), torch.arange(len(ids)), cache)[0, -1]]
    tokens = [int(logits[-1].argmax())]
    for i in range(STEPS - 1):
        logits.append(model(torch.tensor([[tokens[-1]]]), torch.tensor([len(ids) + i]), cache)[0, -1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("path", ["indexed", "gather"])
def test_single_sequence_logits_every_step(model, tokenizer, path):
    ids = tokenizer.encode(PROMPTS[1])
    tokens, want = greedy_contiguous(model, ids)
    cache = paged_cache(model.config, 8, 16, attention=path)
    cache.add_sequence(0, ids)
    cache.set_rows([0])
    got = [model(torch.tensor([ids]), torch.arange(len(ids)), cache)[0, -1]]
    for i, t in enumerate(tokens[:-1]):
        got.append(model(torch.tensor([[t]]), torch.tensor([len(ids) + i]), cache)[0, -1])
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-4, atol=2e-4)
    params = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    assert generate_paged(model, ids, params, attention=path).tokens == tokens


def test_ragged_batch_logits_every_step(model, tokenizer):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    runs = [greedy_contiguous(model, ids) for ids in prompts]
    cache = paged_cache(model.config, 24, 16)
    for s, ids in enumerate(prompts):
        cache.add_sequence(s, ids)
    cache.set_rows(range(len(prompts)))
    T = max(len(p) for p in prompts)
    toks = torch.tensor([p + [0] * (T - len(p)) for p in prompts])
    pos = torch.tensor([list(range(len(p))) + [-1] * (T - len(p)) for p in prompts])
    logits = model(toks, pos, cache)
    got = [[logits[b, len(p) - 1]] for b, p in enumerate(prompts)]
    for i in range(STEPS - 1):
        toks = torch.tensor([[tokens[i]] for tokens, _ in runs])
        logits = model(toks, torch.tensor([[len(p) + i] for p in prompts]), cache)
        for b in range(len(prompts)):
            got[b].append(logits[b, 0])
    for b, (tokens, want) in enumerate(runs):
        torch.testing.assert_close(torch.stack(got[b]), want, rtol=1e-4, atol=2e-4)
        assert [int(x.argmax()) for x in got[b]] == tokens
