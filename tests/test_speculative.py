"""Speculative decoding: the emitted distribution is exactly the target's; greedy output equals the
target's greedy output for any draft."""

import pytest
import torch

from minillm import SamplingParams, generate_cached
from minillm.model import Decoder, ModelConfig
from minillm.sampling import logits_to_probs
from minillm.speculative import (
    DraftModelProposer, NgramProposer, acceptance_probability, rejection_sample, residual_distribution,
    speculative_generate,
)


def emitted_first_token_distribution(target_probs, draft_probs):
    """Enumerate Algorithm 1's branches for one drafted token: draft x with probability q(x); accepted
    with probability a(x), else a token from the residual."""
    V = target_probs.shape[0]
    out = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        q = float(draft_probs[x])
        if q == 0:
            continue
        a = acceptance_probability(target_probs, draft_probs, x)
        out[x] += q * a
        out += q * (1 - a) * residual_distribution(target_probs, draft_probs).double()
    return out


CASES = {
    "overlapping": ([0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]),
    "draft mass where the target has none": ([0.0, 0.6, 0.4, 0.0], [0.5, 0.1, 0.1, 0.3]),
    "target mass where the draft has none": ([0.2, 0.2, 0.2, 0.4], [0.0, 0.5, 0.5, 0.0]),
    "one-hot draft": ([0.1, 0.7, 0.1, 0.1], [1.0, 0.0, 0.0, 0.0]),
    "identical": ([0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]),
}


@pytest.mark.parametrize("name", CASES)
def test_one_step_emits_exactly_the_target_distribution(name):
    target, draft = (torch.tensor(v, dtype=torch.float64) for v in CASES[name])
    torch.testing.assert_close(emitted_first_token_distribution(target, draft), target)


def test_exact_with_top_k_processed_draft():
    logits_t = torch.tensor([[2.0, 1.5, 0.3, -1.0, 0.0]])
    logits_d = torch.tensor([[0.0, 2.5, 2.0, 1.0, -3.0]])
    params = SamplingParams(temperature=0.7, top_k=3)
    target = logits_to_probs(logits_t, params)[0].double()
    draft = logits_to_probs(logits_d, params)[0].double()
    assert (draft == 0).sum() == 2 and (target == 0).sum() == 2  # top-k left different supports
    torch.testing.assert_close(emitted_first_token_distribution(target, draft), target)


def test_sampled_tokens_follow_the_target_distribution():
    """Many seeded draws of rejection_sample with gamma = 2: the first emitted token's frequencies
    match the target; total variation < 0.02 (its standard deviation here is ~0.004)."""
    g = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[0.1, 0.1, 0.2, 0.6], [0.7, 0.1, 0.1, 0.1]])
    counts = torch.zeros(4)
    n = 20000
    for _ in range(n):
        d = [int(torch.multinomial(draft[i], 1, generator=g)) for i in range(2)]
        emitted, _ = rejection_sample(d, draft, target, g)
        counts[emitted[0]] += 1
    tv = 0.5 * (counts / n - target[0]).abs().sum()
    assert tv < 0.02


def random_draft(vocab_size):
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=vocab_size,
                      max_seq_len=512)
    state = {"tok_embeddings.weight": torch.randn(vocab_size, 64), "norm.weight": torch.ones(64)}
    for i in range(2):
        p = f"layers.{i}"
        state.update({f"{p}.attn_norm.weight": torch.ones(64), f"{p}.ffn_norm.weight": torch.ones(64),
                      f"{p}.attn.wq.weight": torch.randn(64, 64) / 8, f"{p}.attn.wk.weight": torch.randn(32, 64) / 8,
                      f"{p}.attn.wv.weight": torch.randn(32, 64) / 8, f"{p}.attn.wo.weight": torch.randn(64, 64) / 8,
                      f"{p}.mlp.w_gate.weight": torch.randn(128, 64) / 8, f"{p}.mlp.w_up.weight": torch.randn(128, 64) / 8,
                      f"{p}.mlp.w_down.weight": torch.randn(64, 128) / 8})
    return Decoder(cfg, state).eval()


@pytest.mark.parametrize("proposer_kind", ["ngram", "random draft model"])
def test_greedy_speculative_equals_target_greedy(model, tokenizer, proposer_kind):
    prompt = tokenizer.encode("The cat sat on the mat. The dog sat on the log. The cat sat on the")
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ref = generate_cached(model, prompt, params)
    proposer = (NgramProposer(model.config.vocab_size) if proposer_kind == "ngram"
                else DraftModelProposer(random_draft(model.config.vocab_size), 256))
    out, stats = speculative_generate(model, proposer, prompt, params, num_speculative_tokens=4)
    assert out.tokens == ref.tokens
    assert len(stats.accepted) <= 32 and 0 <= stats.acceptance_rate <= 1
    if proposer_kind == "ngram":
        assert stats.acceptance_rate > 0.2  # the text repeats itself, so lookups hit


def test_gamma_must_be_positive(model):
    with pytest.raises(ValueError, match="num_speculative_tokens: must be >= 1"):
        speculative_generate(model, NgramProposer(10), [1, 2], num_speculative_tokens=0)


def test_self_draft_shares_weights_and_round_trips_through_a_checkpoint(model, tmp_path):
    from minillm import load_model
    from minillm.speculative import save_llama_checkpoint, self_draft

    draft = self_draft(model, 3)
    assert draft.config.n_layers == 3 and len(model.layers) == 30
    assert draft.layers[2] is model.layers[2] and draft.output is model.output
    save_llama_checkpoint(draft, tmp_path)
    loaded, _ = load_model(tmp_path)
    x = torch.tensor([[5, 17, 300, 4000]])
    torch.testing.assert_close(loaded(x, torch.arange(4)), draft(x, torch.arange(4)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="n_layers: must be in 1..30"):
        self_draft(model, 31)
