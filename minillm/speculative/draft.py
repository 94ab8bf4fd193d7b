"""A draft model for speculative decoding of the embedded model, built by minillm itself.

``self_draft``: the target's first n layers, its final norm and its (tied) output layer: an early
exit, sharing the target's tensors (cf. Elhoushi et al. 2024, "LayerSkip", Sec. 4, which trains
the target for it). Untrained, its next-token distribution is far from the target's (acceptance
~0.02 on the chat workloads).

``distill_draft``: the same draft, its layers and final norm copied and then trained to match the
target's next-token distributions (knowledge distillation, Hinton et al. 2015; the draft-model
alignment of Zhou et al. 2024, "DistillSpec", Sec. 3, with forward KL on the target's own
distributions) over the calibration play. The output layer (the tied embedding, 28 M of the
draft's parameters) stays frozen and shared. ``python -m minillm distill-draft --out PATH``
runs it and writes a Hugging Face folder (``save_llama_checkpoint``) that ``--draft PATH`` loads.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..files import atomic_write


def self_draft(target, n_layers: int):
    """A draft made of the target's first ``n_layers`` blocks, its final norm and its output layer.
    Shares the target's tensors: no copy, no file.

    Raises:
        ValueError: n_layers outside 1..target layers.
    """
    if not 1 <= n_layers <= target.config.n_layers:
        raise ValueError(f"n_layers: must be in 1..{target.config.n_layers}, got {n_layers}")
    draft = copy.copy(target)  # shallow: the modules (and their weights) are shared
    draft._modules = dict(target._modules)
    draft.layers = torch.nn.ModuleList(list(target.layers)[:n_layers])
    draft.config = replace(target.config, n_layers=n_layers)
    return draft


@torch.no_grad()
def target_top_k(target, windows: torch.Tensor, k: int = 64, progress: bool = False):
    """The target's top-k next-token probabilities at every position of each window.

    Args:
        windows: (N, T) int64 token ids; each window is scored from position 0.
        k: kept probabilities per position (the rest of the mass is dropped and the k renormalised).

    Returns:
        (ids (N, T, k) int64, probs (N, T, k) float32).
    """


    ids, probs = [], []
    for w in tqdm(windows, desc="target distributions", disable=not progress, leave=False):
        logits = target(w[None].to(target.device), torch.arange(w.shape[0], device=target.device))[0]  # (T, V)
        top = torch.softmax(logits, -1).topk(k, dim=-1)
        ids.append(top.indices.cpu())
        probs.append((top.values / top.values.sum(-1, keepdim=True)).cpu())
    return torch.stack(ids), torch.stack(probs)


def distill_draft(target, tokens: list[int], *, n_layers: int = 4, seq_len: int = 128, n_windows: int = 48,
                  steps: int = 150, lr: float = 3e-4, top_k: int = 64, seed: int = 0, progress: bool = True):
    """Train a self-draft of the target's first ``n_layers`` layers to imitate the target.

    The target scores ``n_windows`` windows of ``seq_len`` tokens of ``tokens`` once (its top-k
    probabilities are kept); then ``steps`` Adam steps, one window each, minimise the cross-entropy
    of the draft's next-token distribution to the target's (forward KL up to a constant, over the
    target's top-k). Only the draft's copied layers and final norm are trained.

    Args:
        target: the ``Decoder`` to imitate (left unchanged).
        tokens: training text as token ids (at least seq_len + 1).
        n_layers: layers of the draft (its cost per token grows with them: the output layer alone
            is 28 M parameters of the target's 135 M).

    Returns:
        (draft ``Decoder``, log: dict with the loss per step, seconds, and the settings).

    Raises:
        ValueError: too little text for one window, or n_layers outside 1..target layers.
    """


    if len(tokens) < seq_len + 1:
        raise ValueError(f"tokens: need at least seq_len + 1 = {seq_len + 1} tokens, got {len(tokens)}")
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    n_windows = min(n_windows, len(tokens) // seq_len)
    windows = torch.tensor(tokens[:n_windows * seq_len]).view(n_windows, seq_len)  # (N, T)
    ids, probs = target_top_k(target, windows, top_k, progress)
    draft = self_draft(target, n_layers)
    draft.layers = copy.deepcopy(draft.layers)  # own copies: training must not touch the target
    draft.norm = copy.deepcopy(target.norm)
    trained = [p for m in (draft.layers, draft.norm) for p in m.parameters()]
    for p in trained:
        p.requires_grad_(True)
    opt = torch.optim.Adam(trained, lr=lr)
    losses = []
    order = torch.randperm(n_windows)
    device = target.device
    bar = tqdm(range(steps), desc="distilling the draft", disable=not progress)
    for step in bar:
        i = int(order[step % n_windows])
        logits = draft(windows[i][None].to(device), torch.arange(seq_len, device=device))[0]  # (T, V)
        logq = F.log_softmax(logits, -1).gather(-1, ids[i].to(device))  # (T, k)
        loss = -(probs[i].to(device) * logq).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    for p in trained:
        p.requires_grad_(False)
    return draft.eval(), {"n_layers": n_layers, "seq_len": seq_len, "n_windows": n_windows, "steps": steps,
                          "lr": lr, "top_k": top_k, "seed": seed, "losses": losses,
                          "seconds": time.perf_counter() - t0}


def save_llama_checkpoint(model, folder) -> None:
    """Write a Llama ``Decoder`` as a Hugging Face LlamaForCausalLM folder (config.json +
    model.safetensors, no pickle), which ``load_model(folder)`` and transformers read back. Each file is
    written beside itself and renamed into place when complete (``minillm.files``)."""

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
    with atomic_write(folder / "model.safetensors") as tmp:
        save_file({k: v.detach().float().contiguous() for k, v in state.items()}, str(tmp))
    with atomic_write(folder / "config.json") as tmp:
        tmp.write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.dim,
            "intermediate_size": c.ffn_dim, "num_hidden_layers": c.n_layers, "num_attention_heads": H,
            "num_key_value_heads": Hkv, "head_dim": D, "vocab_size": c.vocab_size, "max_position_embeddings": c.max_seq_len,
            "rope_theta": c.rope_base, "rms_norm_eps": c.norm_eps, "tie_word_embeddings": c.tie_embeddings,
            "hidden_act": "silu", "torch_dtype": "float32"}, indent=2))
