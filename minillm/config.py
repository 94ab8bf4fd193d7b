"""``ModelConfig``: a decoder's hyper-parameters, read from the model file; ``weight_shapes``: the tensors a
Llama-architecture model of a config needs (the loaders check a file against them)."""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "gpt2")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder, read from the model file (never hard-coded).

    Attributes:
        arch: "llama" (RMSNorm, RoPE, SwiGLU) or "gpt2" (LayerNorm, learned positions, GELU).
        n_layers, dim (C), n_heads (H), n_kv_heads (Hkv), head_dim (D), ffn_dim: sizes.
        vocab_size (V): rows of the token embedding.
        max_seq_len: the context length the model was trained for, in tokens.
        rope_base: RoPE's theta (Llama only).
        norm_eps: epsilon of RMSNorm / LayerNorm.
        tie_embeddings: the output projection reuses the token embedding.
        attn_bias, mlp_bias: whether those linear layers carry a bias (GPT-2: both).

    Raises:
        ValueError: naming the field, when sizes are inconsistent.
    """

    arch: str = "llama"
    n_layers: int = 30
    dim: int = 576
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    ffn_dim: int = 1536
    vocab_size: int = 49152
    max_seq_len: int = 8192
    rope_base: float = 100000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    attn_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch: {self.arch!r} is not supported; use one of {ARCHITECTURES}")
        for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.max_seq_len > 1 << 20:
            raise ValueError(f"max_seq_len: {self.max_seq_len} is implausibly large (over 2^20 tokens)")
        if not (0 < self.rope_base < float("inf")):
            raise ValueError(f"rope_base: must be a positive finite number, got {self.rope_base}")
        if not (0 < self.norm_eps < 1):
            raise ValueError(f"norm_eps: must be in (0, 1), got {self.norm_eps}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads: {self.n_kv_heads} must divide n_heads ({self.n_heads}) for grouped-query attention"
            )

    @property
    def layer_linear_params(self) -> int:
        """Weights in the linear layers of one block: Q, K, V, O and the MLP's two or three matrices."""
        C, D = self.dim, self.head_dim
        attn = C * D * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * D * C
        return attn + (3 if self.arch == "llama" else 2) * C * self.ffn_dim

    @property
    def n_params(self) -> int:
        """Number of distinct weights (tied embeddings counted once)."""
        C = self.dim
        norms = (2 if self.arch == "llama" else 4) * C
        per_layer = self.layer_linear_params + norms
        emb = self.vocab_size * C * (1 if self.tie_embeddings else 2)
        pos = self.max_seq_len * C if self.arch == "gpt2" else 0
        return self.n_layers * per_layer + emb + pos + C


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The (out, in) shape of every tensor a Llama-architecture model of ``config`` needs."""
    C, D, F_ = config.dim, config.head_dim, config.ffn_dim
    shapes = {"tok_embeddings.weight": (config.vocab_size, C), "norm.weight": (C,)}
    if not config.tie_embeddings:
        shapes["output.weight"] = (config.vocab_size, C)
    for i in range(config.n_layers):
        p = f"layers.{i}"
        shapes.update({
            f"{p}.attn_norm.weight": (C,), f"{p}.ffn_norm.weight": (C,),
            f"{p}.attn.wq.weight": (config.n_heads * D, C),
            f"{p}.attn.wk.weight": (config.n_kv_heads * D, C),
            f"{p}.attn.wv.weight": (config.n_kv_heads * D, C),
            f"{p}.attn.wo.weight": (C, config.n_heads * D),
            f"{p}.mlp.w_gate.weight": (F_, C), f"{p}.mlp.w_up.weight": (F_, C),
            f"{p}.mlp.w_down.weight": (C, F_),
        })
    return shapes
