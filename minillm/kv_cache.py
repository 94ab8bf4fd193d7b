"""KV caches: what the decoder is handed so that each decode step computes only the new token.

At step t the attention of the new token needs the keys and values of every earlier position.
Recomputing them costs a forward pass over the whole sequence each step (O(T^2) tokens processed
for T tokens); caching them costs memory instead:
``2 x batch x seq_len x n_layers x n_kv_heads x head_dim x bytes`` (Pope et al. 2023, Sec. 2.2;
GQA divides it by n_heads / n_kv_heads, Ainslie et al. 2023).

The interface every cache implements (the decoder calls nothing else):

* ``prepare(input_pos) -> S``: called once per forward with the (T,) positions about to be
  written; checks them, and returns S, the number of key positions the step attends over
  (positions ``0..S-1``).
* ``update(layer, k, v) -> (k_all, v_all)``: stores this layer's new (B, Hkv, T, D) keys and values
  at the prepared positions and returns all S of them, (B, Hkv, S, D).
* ``truncate(n)``: forget every position ``>= n`` (rolling back rejected speculative tokens).
* ``seq_len``: how many positions are stored.
"""

from __future__ import annotations

import torch

from .model import ModelConfig


class KVCache:
    """A contiguous, preallocated cache: one (n_layers, B, Hkv, max_seq_len, D) tensor for keys
    and one for values, slot = position. Nothing is allocated while decoding.

    Args:
        config: the model's config (layers, KV heads, head dim).
        batch_size: B.
        max_seq_len: positions to reserve (at most the model's context length).
        dtype, device: of the stored tensors (normally the model's).

    Raises:
        ValueError: ``max_seq_len`` not positive, or larger than the model's context.
    """

    def __init__(self, config: ModelConfig, batch_size: int = 1, max_seq_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        max_seq_len = config.max_seq_len if max_seq_len is None else max_seq_len
        if not 0 < max_seq_len <= config.max_seq_len:
            raise ValueError(
                f"max_seq_len: {max_seq_len} must be between 1 and the model's context length "
                f"({config.max_seq_len})"
            )
        shape = (config.n_layers, batch_size, config.n_kv_heads, max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len
        self.seq_len = 0
        self._pos: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value tensors (the whole reservation, used or not)."""
        return self.k.numel() * self.k.element_size() * 2

    def prepare(self, input_pos: torch.Tensor) -> int:
        """Check that ``input_pos`` (T,) continues the stored sequence; returns the new seq_len.

        Raises:
            ValueError: the positions would leave a gap after ``seq_len`` or run past
                ``max_seq_len``.
        """
        start, end = int(input_pos[0]), int(input_pos[-1]) + 1
        if start > self.seq_len:
            raise ValueError(
                f"input_pos: starts at {start} but the cache holds only {self.seq_len} positions; "
                "write the positions in between first"
            )
        if end > self.max_seq_len:
            raise ValueError(
                f"input_pos: position {end - 1} does not fit a cache of max_seq_len={self.max_seq_len}; "
                "make a larger cache"
            )
        self._pos = input_pos
        self.seq_len = end
        return end

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, D) at the prepared positions; return (B, Hkv, seq_len, D) views."""
        self.k[layer].index_copy_(2, self._pos, k)
        self.v[layer].index_copy_(2, self._pos, v)
        return self.k[layer, :, :, : self.seq_len], self.v[layer, :, :, : self.seq_len]

    def truncate(self, n: int) -> None:
        """Keep positions ``0..n-1`` only; the next write starts at position n.

        Raises:
            ValueError: n negative or larger than ``seq_len``.
        """
        if not 0 <= n <= self.seq_len:
            raise ValueError(f"n: cannot truncate a cache of {self.seq_len} positions to {n}")
        self.seq_len = n

    def reset(self) -> None:
        """Empty the cache for a new request (the memory stays reserved)."""
        self.seq_len = 0


def kv_cache_bytes(config: ModelConfig, batch_size: int, seq_len: int, bytes_per_element: float) -> float:
    """KV-cache size in bytes: 2 x B x seq_len x n_layers x n_kv_heads x head_dim x bytes
    (keys and values; Pope et al. 2023, Sec. 2.2)."""
    return 2 * batch_size * seq_len * config.n_layers * config.n_kv_heads * config.head_dim * bytes_per_element
