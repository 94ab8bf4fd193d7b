"""One decoder-only transformer: Llama (RMSNorm, RoPE, GQA, SwiGLU) and GPT-2 (LayerNorm, learned
positions, GELU), with the KV cache handed in rather than built in.

``Decoder.forward(tokens (B, T), input_pos (T,) or (B, T), cache) -> logits (B, T, V)`` is the only forward.
``cache=None`` attends over the tokens passed in (the naive path: recompute the whole sequence);
a cache object (``minillm.kv_cache.KVCache``) stores keys/values so that each step passes only
the new tokens. Later techniques plug in other caches and other linear layers; they do not copy
this file.

Sources: Vaswani et al. 2017 (attention); Touvron et al. 2023, "LLaMA" (RMSNorm, SwiGLU, RoPE);
Su et al. 2021, "RoFormer" (RoPE, Eq. 34, in the rotate-half form of Hugging Face Llama);
Ainslie et al. 2023, "GQA" (Hkv < H key/value heads, each shared by H / Hkv query heads);
Radford et al. 2019 (GPT-2).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .linear import Linear

RAGGED_NEEDS_PAGED = ("input_pos: per-row (B, T) positions need a cache that serves a ragged batch "
                      "(minillm.paged.PagedKVCache) and no pad_lengths; pass (T,) positions otherwise")


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, normalized in float32 (Zhang & Sennrich 2019)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class LayerNorm(nn.Module):
    """GPT-2's LayerNorm, computed in float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.bias = nn.Parameter(bias.clone(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


def rope_tables(head_dim: int, max_seq_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_seq_len, head_dim) float32, for rotate-half RoPE.

    angle[p, i] = p * base^(-2i / D) for i < D/2, repeated for the second half (RoFormer Eq. 34).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (S, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (S, D)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by the angles of its positions; cos/sin are (T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v, written out, with each KV head repeated for its group.

    q: (B, H, T, D); k, v: (B, Hkv, S, D); mask: (T, S) or (B, 1, T, S) bool (True = may attend) or None.
    Returns (B, H, T, D). The baseline of ``attention`` (same signature).
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, H, S, D)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Same as ``attention_naive`` through torch's fused ``scaled_dot_product_attention`` (GQA aware)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=bool(q.shape[1] != k.shape[1]))


def attention_mask(input_pos: torch.Tensor, key_pos: torch.Tensor,
                   pad_lengths: torch.Tensor | None = None) -> torch.Tensor | None:
    """The boolean mask of one forward (True = may attend), shared by every cache.

    Causal over slots: a query at slot p sees the keys at slots <= p.

    Args:
        input_pos: (T,) slots of the queries, the same for every row, or (B, T) per row with -1
            marking padding (a ragged batch, ``minillm.paged``).
        key_pos: (S,) slots of the keys the step attends over.
        pad_lengths: (B,) left padding per row, or None (only with (T,) ``input_pos``).

    Returns:
        None when a single query at the last slot sees every key (a decode step: SDPA then takes its
        fastest path); (T, S) for one causal pattern shared by all rows; (B, 1, T, S) per row. A
        padding query sees one key (its own slot, or slot 0 in a ragged batch) so that no softmax
        row is empty; its output is never used.
    """
    if input_pos.dim() == 2:
        mask = key_pos[None, None, :] <= input_pos[:, :, None]  # (B, T, S)
        padding = (input_pos < 0)[:, :, None] & (key_pos == 0)  # (B, T, S)
        return (mask | padding)[:, None]  # (B, 1, T, S)
    mask = None
    if len(input_pos) > 1 or pad_lengths is not None:
        mask = key_pos[None, :] <= input_pos[:, None]  # (T, S)
    if pad_lengths is not None:
        real = key_pos[None, :] >= pad_lengths[:, None]  # (B, S): not padding
        mask = mask & (real[:, None, :] | (key_pos[None, :] == input_pos[:, None]))  # (B, T, S)
        mask = mask[:, None]  # (B, 1, T, S)
    return mask


class Attention(nn.Module):
    """Grouped-query attention. Q, K and V are one fused Linear ``wqkv`` (C -> (H + 2 Hkv) * D),
    as vLLM's ``qkv_proj``: one weight read instead of three.

    The cache is the one interface between the model and any KV layout: ``cache.attend(layer, q, k, v, mask)``
    stores this layer's new keys and values and attends over every position it holds (``minillm.kv_cache``,
    ``minillm.paged.PagedKVCache``)."""

    def __init__(self, config: ModelConfig, wq, wk, wv, wo, bq=None, bk=None, bv=None, bo=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        bias = None if bq is None else torch.cat([bq, bk, bv])
        self.wqkv = Linear(torch.cat([wq, wk, wv]), bias)
        self.wo = Linear(wo, bo)

    def forward(self, x, layer_idx, rope, cache, mask):
        B, T, _ = x.shape
        q, k, v = self.heads(self.wqkv(x), rope)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
        y = attention(q, k, v, mask) if cache is None else cache.attend(layer_idx, q, k, v, mask)  # (B, H, T, D)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def heads(self, qkv: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused product's output (B, T, (H + 2 Hkv) D) as q (B, H, T, D), k and v (B, Hkv, T, D), q and k
        rotated by RoPE (``rope`` (cos, sin), or None for learned positions)."""
        B, T, _ = qkv.shape
        qkv = qkv.view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)
        qk, v = qkv.split([self.n_heads + self.n_kv_heads, self.n_kv_heads], dim=1)  # (B, H+Hkv, T, D), (B, Hkv, T, D)
        if rope is not None:
            qk = apply_rope(qk, *rope)  # q and k rotated in one go
        q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
        return q, k, v


class MLP(nn.Module):
    """SwiGLU ``w_down(silu(gate) * up)`` (Llama; gate and up fused in ``w_gate_up``, vLLM's
    ``gate_up_proj``) or ``w_down(gelu(w_up x))`` (GPT-2)."""

    def __init__(self, w_up, w_down, w_gate=None, b_up=None, b_down=None, b_gate=None):
        super().__init__()
        self.gated = w_gate is not None
        if self.gated:
            gate_up_bias = None if b_up is None else torch.cat([b_gate, b_up])
            self.w_gate_up = Linear(torch.cat([w_gate, w_up]), gate_up_bias)
        else:
            self.w_up = Linear(w_up, b_up)
        self.w_down = Linear(w_down, b_down)

    def forward(self, x):
        if not self.gated:
            return self.w_down(F.gelu(self.w_up(x), approximate="tanh"))
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # (..., F) each
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    """One pre-norm layer: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``."""

    def __init__(self, attn_norm, attn, ffn_norm, mlp):
        super().__init__()
        self.attn_norm, self.attn, self.ffn_norm, self.mlp = attn_norm, attn, ffn_norm, mlp

    def forward(self, x, layer_idx, rope, cache, mask):
        x = x + self.attn(self.attn_norm(x), layer_idx, rope, cache, mask)
        return x + self.mlp(self.ffn_norm(x))


class Decoder(nn.Module):
    """The decoder. Build it with ``Decoder(config, state)``; ``minillm.load_model`` does that
    from a GGUF file or a Hugging Face folder.

    Args:
        config: the ``ModelConfig``.
        state: float tensors in minillm's names (``tok_embeddings.weight`` (V, C),
            ``layers.{i}.attn.wq.weight`` (H*D, C), ``layers.{i}.mlp.w_gate.weight`` (F, C), ...;
            see ``minillm.formats.gguf``), with Linear weights as (out, in).

    Raises:
        KeyError: a tensor is missing from ``state`` (the loaders check first and say which file).
    """

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor]):
        super().__init__()
        self.config = config
        self.accelerated = False  # whether minillm.fast.accelerate swapped its layers in
        self.paged_backend = "blockwise"  # the paged read an engine serving this model uses (minillm.fast sets its own)
        self.quant_linear_class = None  # what quantization builds its layers of (None: minillm.quant's QuantLinear)
        c = config
        llama = c.arch == "llama"

        def norm(prefix):
            if llama:
                return RMSNorm(state[f"{prefix}.weight"], c.norm_eps)
            return LayerNorm(state[f"{prefix}.weight"], state[f"{prefix}.bias"], c.norm_eps)

        def opt(name):
            return state.get(name)

        layers = []
        for i in range(c.n_layers):
            p = f"layers.{i}"
            attn = Attention(
                c, *(state[f"{p}.attn.{n}.weight"] for n in ("wq", "wk", "wv", "wo")),
                *(opt(f"{p}.attn.{n}.bias") for n in ("wq", "wk", "wv", "wo")),
            )
            mlp = MLP(
                state[f"{p}.mlp.w_up.weight"], state[f"{p}.mlp.w_down.weight"],
                state[f"{p}.mlp.w_gate.weight"] if llama else None,
                opt(f"{p}.mlp.w_up.bias"), opt(f"{p}.mlp.w_down.bias"), opt(f"{p}.mlp.w_gate.bias"),
            )
            layers.append(Block(norm(f"{p}.attn_norm"), attn, norm(f"{p}.ffn_norm"), mlp))
        self.layers = nn.ModuleList(layers)
        self.norm = norm("norm")
        self.output = Linear(state["tok_embeddings.weight"] if c.tie_embeddings else state["output.weight"])
        if not c.tie_embeddings:
            self.tok_embeddings = nn.Parameter(state["tok_embeddings.weight"].clone(), requires_grad=False)
        self.pos_embeddings = None
        if not llama:
            self.pos_embeddings = nn.Parameter(state["pos_embeddings.weight"].clone(), requires_grad=False)
        if llama:
            cos, sin = rope_tables(c.head_dim, c.max_seq_len, c.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def embedding_weight(self) -> torch.Tensor:
        """The token embedding (V, C) (the output layer's weight when tied)."""
        return self.output.weight if self.config.tie_embeddings else self.tok_embeddings

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embedding rows (B, T) -> (B, T, C); tied models read the output weight's rows (a
        quantized output layer dequantizes just those rows: ``QuantLinear.rows``)."""
        if self.config.tie_embeddings:
            return self.output.rows(tokens)
        return F.embedding(tokens, self.tok_embeddings)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device  # the final norm stays float whatever the linear layers become

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache=None,
                pad_lengths: torch.Tensor | None = None, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for every position (or for the positions in ``logits_indices``).

        Args:
            tokens: (B, T) int64 token ids.
            input_pos: (T,) int64 slots of those tokens (0-based), shared by every row; or (B, T), row b's
                own positions with -1 marking padding (a ragged batch: needs ``minillm.paged.PagedKVCache``).
            cache: None (attend over ``tokens`` only; positions start at 0) or a KV cache holding slots
                ``0..input_pos[0]-1`` (``minillm.kv_cache.KVCache``).
            pad_lengths: (B,) int64 left padding per row (prompts of different lengths), or None. Row b's
                tokens sit at positions ``slot - pad_lengths[b]``; no query attends to padding.
            logits_indices: (N,) int64 indices into the B * T positions flattened row by row: the output
                projection runs for those only (vLLM's ``logits_indices``).

        Returns:
            (B, T, V) float32 logits, or (N, V) with ``logits_indices``.

        Raises:
            ValueError: a position past the context length, (B, T) positions without a ragged-batch
                cache, or (through the cache) a write that would leave a gap.
        """
        per_row = self._check_inputs(tokens, input_pos, cache, pad_lengths)
        x, rope = self._add_positions(self.embed(tokens), input_pos, pad_lengths, per_row)  # x (B, T, C)
        key_pos = input_pos if cache is None else torch.arange(cache.prepare(input_pos), device=tokens.device)
        mask = attention_mask(input_pos, key_pos, pad_lengths)
        return self.forward_layers(x, rope, cache, mask, logits_indices)

    def _check_inputs(self, tokens, input_pos, cache, pad_lengths) -> bool:
        """``forward``'s checks (its Raises); returns whether the positions are per row ((B, T))."""
        if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(f"tokens: must be (B, T) integer ids, got shape {tuple(tokens.shape)} of {tokens.dtype}")
        B, T = tokens.shape
        if T == 0 or input_pos.shape[-1] != T or input_pos.dim() > 2 or (input_pos.dim() == 2 and len(input_pos) != B):
            raise ValueError(f"input_pos: needs one position per token ({T}), got shape {tuple(input_pos.shape)}")
        per_row = input_pos.dim() == 2
        if per_row and (cache is None or pad_lengths is not None):  # the cache's prepare refuses them too
            raise ValueError(RAGGED_NEEDS_PAGED)
        # the checks read two values back from the device, once per forward
        ends = torch.stack([input_pos.min(), input_pos.max()]) if per_row else input_pos[[0, -1]]
        first, last = ends.tolist()
        if ((tokens < 0) | (tokens >= self.config.vocab_size)).any():
            raise ValueError(f"tokens: ids must be in [0, {self.config.vocab_size})")
        if last >= self.config.max_seq_len:
            raise ValueError(f"input_pos: position {last} is past the context length ({self.config.max_seq_len} tokens)")
        if first < -per_row or (cache is None and first != 0):
            raise ValueError("input_pos: must start at 0 without a cache (and be >= 0 with one; -1 marks padding "
                             "in per-row positions)")
        return per_row

    def _add_positions(self, x, input_pos, pad_lengths, per_row: bool):
        """Each token's position (``_positions``) enters the model one of two ways: GPT-2 adds learned position
        embeddings to x (B, T, C); Llama rotates queries and keys by RoPE in attention. Returns x and RoPE's
        (cos, sin) (``_rope``; None for GPT-2)."""
        pos = self._positions(input_pos, pad_lengths, per_row)  # (T,), or (B, T) per row
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings[pos]
        return x, self._rope(pos)

    @staticmethod
    def _positions(input_pos, pad_lengths, per_row: bool) -> torch.Tensor:
        """Each token's position in its sequence (for RoPE / learned positions): the slot, less the row's
        left padding; padding itself gets position 0 (its output is never used)."""
        if per_row:
            return input_pos.clamp_min(0)  # (B, T)
        return input_pos if pad_lengths is None else (input_pos[None, :] - pad_lengths[:, None]).clamp_min(0)

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE's (cos, sin) at ``pos``: (T, D) each, or (B, 1, T, D) per row (broadcast over heads);
        None for learned positions (GPT-2)."""
        if self.config.arch != "llama":
            return None
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (T, D), or (B, T, D) per row
        return (cos, sin) if pos.dim() == 1 else (cos[:, None], sin[:, None])

    def forward_layers(self, x: torch.Tensor, rope, cache, mask, logits_indices=None) -> torch.Tensor:
        """The blocks, the final norm and the output projection: x (B, T, C) -> (B, T, V) float32
        logits ((N, V) at ``logits_indices``, see ``forward``). ``forward`` checks its inputs and prepares
        rope (cos, sin), the cache and the mask, then calls this (``minillm.fast.compiled`` compiles it for
        one-token steps)."""
        for i, layer in enumerate(self.layers):
            x = layer(x, i, rope, cache, mask)
        if logits_indices is not None:
            x = x.flatten(0, 1)[logits_indices]  # (N, C): only the positions whose logits are wanted
        return self.output(self.norm(x)).float()

    @property
    def compiled(self) -> bool:
        """Whether a compiled one-token step is swapped in (``minillm.fast.compiled.compile_decode``)."""
        return "forward_layers" in self.__dict__

    def drop_compiled_step(self) -> None:
        """Forget a compiled one-token step (``minillm.fast.compiled`` froze the weights as they were): called by
        whatever changes the weights (quantization), so that the next step runs, and may be compiled, anew."""
        self.__dict__.pop("forward_layers", None)

    def __getstate__(self):  # copy.deepcopy / pickle: a step swapped in from outside belongs to this object only
        return {k: v for k, v in self.__dict__.items() if k != "forward_layers"}
