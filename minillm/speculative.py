"""Speculative decoding with rejection sampling (work in progress: the algorithm and its exactness
tests; the shipped draft model, notebook and benchmark are still to come).

A proposer drafts gamma tokens; the target scores all of them in one forward pass over its KV
cache; draft token x is accepted with probability ``min(1, target_probs(x) / draft_probs(x))``; at
the first rejection the replacement is drawn from the normalised residual
``max(0, target_probs - draft_probs)``; when all gamma are accepted a bonus token is drawn from the
target. The emitted tokens are distributed exactly as the target's own samples (Leviathan, Kalman,
Matias 2023, Algorithm 1 and Appendix A.1; Chen et al. 2023, Algorithm 2). We write
``target_probs`` / ``draft_probs`` because the two papers swap the letters p and q.

Rejected positions are rolled back with the cache's ``truncate``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .generation import GenerationResult, check_prompt, finish, stop_ids
from .kv_cache import KVCache
from .sampling import SamplingParams, logits_to_probs, make_generator


def acceptance_probability(target_probs: torch.Tensor, draft_probs: torch.Tensor, token: int) -> float:
    """min(1, target_probs[token] / draft_probs[token]); draft_probs[token] > 0 since it was drafted."""
    q = float(draft_probs[token])
    return 1.0 if q <= 0 else min(1.0, float(target_probs[token]) / q)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, target_probs - draft_probs)), (V,). If the residual is all zero (only when the
    two distributions are equal, where rejection has probability 0) the target distribution."""
    r = (target_probs - draft_probs).clamp_min(0)
    s = r.sum()
    return target_probs if s <= 0 else r / s


def rejection_sample(draft_tokens: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Verify drafted tokens against the target (Leviathan et al. 2023, Algorithm 1).

    Args:
        draft_tokens: the gamma drafted ids (gamma may be 0).
        draft_probs: (gamma, V) the distributions they were drawn from (one-hot for a deterministic
            proposer), after the same processing (temperature, top-k, top-p) as the target's.
        target_probs: (gamma + 1, V) the target's distributions at each drafted position and one past
            the last (for the bonus token).
        generator: the random source (seeded for reproducibility).

    Returns:
        (emitted tokens: the accepted drafts then one token from the residual or the bonus,
         number of drafts accepted).
    """
    device = target_probs.device
    for i, x in enumerate(draft_tokens):
        u = torch.rand((), generator=generator, device=device)
        if float(u) >= acceptance_probability(target_probs[i], draft_probs[i], x):
            replacement = torch.multinomial(residual_distribution(target_probs[i], draft_probs[i]), 1,
                                            generator=generator)
            return list(draft_tokens[:i]) + [int(replacement)], i
    bonus = torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)
    return list(draft_tokens) + [int(bonus)], len(draft_tokens)


# ---------------------------------------------------------------------------------------------
# Proposers: anything with ``propose(tokens, gamma, params, generator) -> (draft ids, draft_probs)``


class NgramProposer:
    """Prompt lookup decoding (Saxena 2023): find the latest earlier occurrence of the last n tokens
    (n = max_n .. min_n) and propose the tokens that followed it. Deterministic: one-hot draft_probs."""

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1):
        self.vocab_size, self.max_n, self.min_n = vocab_size, max_n, min_n

    def propose(self, tokens: list[int], gamma: int, params: SamplingParams, generator=None):
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    draft = tokens[start + n:start + n + gamma]
                    probs = torch.zeros(len(draft), self.vocab_size)
                    probs[torch.arange(len(draft)), torch.tensor(draft, dtype=torch.long)] = 1.0
                    return draft, probs
        return [], torch.zeros(0, self.vocab_size)


class DraftModelProposer:
    """A smaller model sharing the tokenizer drafts gamma tokens autoregressively, sampling from
    ``logits_to_probs(draft logits, params)`` (exactly the distribution reported as draft_probs).
    Its own KV cache is rolled back to the longest prefix it shares with the accepted text."""

    def __init__(self, draft_model, max_seq_len: int):
        self.model = draft_model
        self.cache = KVCache(draft_model.config, 1, max_seq_len, draft_model.dtype, draft_model.device)
        self.cached: list[int] = []

    @torch.inference_mode()
    def propose(self, tokens: list[int], gamma: int, params: SamplingParams, generator=None):
        keep = 0
        while keep < min(len(self.cached), len(tokens) - 1) and self.cached[keep] == tokens[keep]:
            keep += 1
        self.cache.truncate(keep)
        self.cached = self.cached[:keep]
        device = self.model.device
        feed = tokens[keep:]
        draft, probs = [], []
        for _ in range(gamma):
            pos = torch.arange(len(self.cached), len(self.cached) + len(feed), device=device)
            logits = self.model(torch.tensor([feed], device=device), pos, self.cache)[0, -1]
            self.cached += feed
            p = logits_to_probs(logits[None], params)[0].cpu()  # the generator lives on the CPU
            x = int(p.argmax()) if params.greedy else int(torch.multinomial(p, 1, generator=generator))
            draft.append(x)
            probs.append(p)
            feed = [x]
        return draft, torch.stack(probs) if probs else torch.zeros(0, self.model.config.vocab_size)


@dataclass
class SpeculativeStats:
    """Per-step counts: drafted and accepted tokens, target forwards."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return sum(self.accepted) / max(1, sum(self.drafted))

    @property
    def tokens_per_target_pass(self) -> float:
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))


@torch.inference_mode()
def speculative_generate(target, proposer, prompt_tokens: list[int], params: SamplingParams = SamplingParams(), *,
                         num_speculative_tokens: int = 4, max_seq_len: int | None = None, tokenizer=None,
                         eos_ids: set[int] | None = None) -> tuple[GenerationResult, SpeculativeStats]:
    """Generate with speculative decoding (batch 1). At temperature 0 the tokens equal the target's
    greedy tokens for any proposer; when sampling they follow the target's distribution.

    Args:
        target: the ``Decoder`` whose distribution is reproduced.
        proposer: a ``NgramProposer``, ``DraftModelProposer`` or any object with ``propose``.
        num_speculative_tokens: gamma, drafts per target pass (>= 1).
        Other arguments as ``minillm.generation.generate_cached``.

    Returns:
        (GenerationResult, SpeculativeStats).

    Raises:
        ValueError: gamma < 1, or the prompt errors of ``generate_cached``.
    """
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens: must be >= 1, got {num_speculative_tokens}")
    ctx = check_prompt(target, prompt_tokens, max_seq_len)
    device = target.device
    eos = stop_ids(tokenizer, eos_ids)
    gen = make_generator(params, "cpu")
    cache = KVCache(target.config, 1, ctx, target.dtype, device)
    result, stats = GenerationResult(prompt_tokens=list(prompt_tokens)), SpeculativeStats()
    tokens = list(prompt_tokens)
    # invariant: the target cache holds every token but the last one, which is "pending"
    if len(tokens) > 1:
        target(torch.tensor([tokens[:-1]], device=device), torch.arange(len(tokens) - 1, device=device), cache)
    t0 = time.perf_counter()
    while len(result.tokens) < params.max_new_tokens and len(tokens) < ctx:
        room = min(num_speculative_tokens, ctx - len(tokens) - 1, params.max_new_tokens - len(result.tokens) - 1)
        draft, draft_probs = proposer.propose(tokens, room, params, gen) if room > 0 else ([], None)
        draft = draft[:room]
        start = len(tokens) - 1
        feed = torch.tensor([[tokens[-1]] + draft], device=device)  # (1, 1 + gamma)
        logits = target(feed, torch.arange(start, start + feed.shape[1], device=device), cache)[0]
        target_probs = logits_to_probs(logits, params).cpu()  # (1 + gamma, V)
        # greedy: target and draft probabilities are one-hot, so acceptance is an exact comparison
        emitted, n_ok = rejection_sample(draft, draft_probs, target_probs, gen)
        cache.truncate(start + 1 + n_ok)  # roll back the rejected drafts' keys and values
        stats.drafted.append(len(draft))
        stats.accepted.append(n_ok)
        now = time.perf_counter()
        for x in emitted:
            result.tokens.append(x)
            result.step_s.append((now - t0) / len(emitted))
            tokens.append(x)
            if (x in eos and not params.ignore_eos) or len(result.tokens) >= params.max_new_tokens:
                break
        t0 = now
        if result.tokens and result.tokens[-1] in eos and not params.ignore_eos:
            result.finish_reason = "eos"
            break
    result.prefill_s = result.step_s[0] if result.step_s else 0.0
    result.decode_s = sum(result.step_s[1:])
    return finish(result, tokenizer), stats


# ---------------------------------------------------------------------------------------------
# A draft for the embedded model: the target's own first layers (a self-draft, no training)


def self_draft(target, n_layers: int):
    """A draft made of the target's first ``n_layers`` blocks, its final norm and its output layer
    (early exit; cf. Elhoushi et al. 2024, "LayerSkip", which also trains for it; untrained here).
    Shares the target's tensors: no copy, no file.

    Raises:
        ValueError: n_layers outside 1..target layers.
    """
    import copy

    if not 1 <= n_layers <= target.config.n_layers:
        raise ValueError(f"n_layers: must be in 1..{target.config.n_layers}, got {n_layers}")
    draft = copy.copy(target)  # shallow: the modules (and their weights) are shared
    draft._modules = dict(target._modules)
    draft.layers = torch.nn.ModuleList(list(target.layers)[:n_layers])
    from dataclasses import replace

    draft.config = replace(target.config, n_layers=n_layers)
    return draft


def save_llama_checkpoint(model, folder) -> None:
    """Write a Llama ``Decoder`` as a Hugging Face LlamaForCausalLM folder (config.json +
    model.safetensors, no pickle), which ``load_model(folder)`` and transformers read back."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    c = model.config
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    H, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim
    state = {"model.embed_tokens.weight": model.embedding_weight(), "model.norm.weight": model.norm.weight}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        q, k, v = layer.attn.wqkv.weight.split([H * D, Hkv * D, Hkv * D])
        gate, up = layer.mlp.w_gate_up.weight.chunk(2)
        state.update({f"{p}.input_layernorm.weight": layer.attn_norm.weight,
                      f"{p}.post_attention_layernorm.weight": layer.ffn_norm.weight,
                      f"{p}.self_attn.q_proj.weight": q, f"{p}.self_attn.k_proj.weight": k,
                      f"{p}.self_attn.v_proj.weight": v, f"{p}.self_attn.o_proj.weight": layer.attn.wo.weight,
                      f"{p}.mlp.gate_proj.weight": gate, f"{p}.mlp.up_proj.weight": up,
                      f"{p}.mlp.down_proj.weight": layer.mlp.w_down.weight})
    save_file({k: v.detach().float().contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.dim,
        "intermediate_size": c.ffn_dim, "num_hidden_layers": c.n_layers, "num_attention_heads": H,
        "num_key_value_heads": Hkv, "head_dim": D, "vocab_size": c.vocab_size, "max_position_embeddings": c.max_seq_len,
        "rope_theta": c.rope_base, "rms_norm_eps": c.norm_eps, "tie_word_embeddings": c.tie_embeddings,
        "hidden_act": "silu", "torch_dtype": "float32"}, indent=2))
