"""KV caches: what the decoder is handed so that each decode step computes only the new token.

Recomputing every earlier position's keys and values costs a forward over the whole sequence each step
(O(T^2) tokens processed for T tokens); caching them costs memory instead,
``2 x batch x seq_len x n_layers x n_kv_heads x head_dim x bytes`` (Pope et al. 2023, Sec. 2.2; GQA
divides it by n_heads / n_kv_heads, Ainslie et al. 2023). Every cache implements (the decoder calls
nothing else):

* ``prepare(input_pos) -> S``: called once per forward with the (T,) positions about to be
  written; checks them, advances ``seq_len`` to cover them, and returns S, the number of key
  positions the step attends over (positions ``0..S-1``).
* ``attend(layer, q, k, v, mask) -> y``: stores this layer's new (B, Hkv, T, D) keys and values at the
  prepared positions and attends the queries (B, H, T, D) over all S of them (``Cache.attend``: through
  ``update``, which returns them as (B, Hkv, S, D)).
* ``truncate(n)``: forget every position ``>= n`` (rolling back rejected speculative tokens).
* ``seq_len``: how many positions are stored.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .model import RAGGED_NEEDS_PAGED, attention


class Cache:
    """What the caches here share: ``attend`` is ``update`` then attention over every stored position."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Store k, v (B, Hkv, T, D); return attention of q (B, H, T, D) over every stored position."""
        k_all, v_all = self.update(layer, k, v)  # (B, Hkv, S, D)
        return attention(q, k_all, v_all, mask)

    @staticmethod
    def check_positions(input_pos: torch.Tensor) -> None:
        """Raises ValueError for per-row (B, T) positions, which only a paged cache serves."""
        if input_pos.dim() != 1:
            raise ValueError(RAGGED_NEEDS_PAGED)


class KVCache(Cache):
    """A contiguous, preallocated cache: per layer one (B, Hkv, max_seq_len, D) tensor for keys
    and one for values (``k[layer]``, ``v[layer]``), slot = position. Nothing is allocated while
    decoding.

    Each layer's tensors are allocated separately, not as views of one (n_layers, ...) tensor, so that
    ``torch.compile`` (``minillm.fast.compiled``) writes the new position in place instead of copying every
    layer's whole reservation each step (docs/roofline.md).

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
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: must be an int >= 1, got {batch_size!r}")
        if not 0 < max_seq_len <= config.max_seq_len:
            raise ValueError(
                f"max_seq_len: {max_seq_len} must be between 1 and the model's context length "
                f"({config.max_seq_len})"
            )
        shape = (batch_size, config.n_kv_heads, max_seq_len, config.head_dim)
        # empty, not zeros: only the stored positions are ever read (``update`` returns views up to seq_len), and
        # zeroing a whole context's reservation (8,192 positions: 380 MB) cost a generation 60 ms before its prefill
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.max_seq_len = max_seq_len
        self.seq_len = 0
        self._pos: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value tensors (the whole reservation, used or not)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def prepare(self, input_pos: torch.Tensor) -> int:
        """Check that ``input_pos`` (T,) continues the stored sequence, advance ``seq_len`` past it (the
        positions count as stored from here on, before ``update`` writes them) and return the new seq_len.
        Writing at a position below ``seq_len`` overwrites it and forgets every later position
        (this is how rejected speculative tokens are rolled back).

        Raises:
            ValueError: the positions would leave a gap after ``seq_len`` or run past
                ``max_seq_len``.
        """
        self.check_positions(input_pos)
        start, end = int(input_pos[0]), int(input_pos[-1]) + 1
        if start < 0 or end - start != len(input_pos):
            raise ValueError(f"input_pos: positions must be consecutive and >= 0, got {start}..{end - 1} "
                             f"for {len(input_pos)} tokens")
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

    def check_batch(self, k: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Raises ValueError unless ``k`` (B, Hkv, T, D) has the cache's batch size (and ``dtype``)."""
        if k.shape[0] != self.k[0].shape[0]:
            raise ValueError(f"cache: holds a batch of {self.k[0].shape[0]} rows, the forward has {k.shape[0]}; "
                             "make the cache with the batch size of the tokens")
        if dtype is not None and k.dtype != dtype:
            raise ValueError(f"cache: stores {dtype}, the model computes in {k.dtype}; make the cache with the "
                             "model's dtype (model.dtype)")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, D) at the prepared positions; return (B, Hkv, seq_len, D) views.

        Raises:
            ValueError: k's batch size or dtype is not the cache's.
        """
        self.check_batch(k, self.k[layer].dtype)
        self.k[layer][:, :, self._pos] = k  # (B, Hkv, T, D) into slots input_pos
        self.v[layer][:, :, self._pos] = v
        return self.k[layer][:, :, : self.seq_len], self.v[layer][:, :, : self.seq_len]

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


class DynamicKVCache(Cache):
    """A cache that grows by concatenation, as Hugging Face's ``DynamicCache`` does: nothing is
    reserved up front, but every step allocates new (B, Hkv, S + T, D) tensors and copies the old
    ones, so writing N tokens one by one copies O(N^2) elements. Same interface as ``KVCache``.

    Raises:
        ValueError: (``prepare``) positions that do not continue the stored sequence exactly.
    """

    def __init__(self, config: ModelConfig, batch_size: int = 1, max_seq_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.n_layers = config.n_layers
        self.max_seq_len = config.max_seq_len if max_seq_len is None else max_seq_len
        self.k: list[torch.Tensor | None] = [None] * config.n_layers
        self.v: list[torch.Tensor | None] = [None] * config.n_layers
        self.seq_len = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def prepare(self, input_pos: torch.Tensor) -> int:
        self.check_positions(input_pos)
        start, end = int(input_pos[0]), int(input_pos[-1]) + 1
        if end - start != len(input_pos):
            raise ValueError(f"input_pos: positions must be consecutive, got {start}..{end - 1} for {len(input_pos)} tokens")
        if start != self.seq_len:
            raise ValueError(f"input_pos: starts at {start} but a dynamic cache can only append at {self.seq_len}; "
                             "truncate it first to rewrite positions")
        if end > self.max_seq_len:
            raise ValueError(f"input_pos: position {end - 1} does not fit max_seq_len={self.max_seq_len}")
        self.seq_len = end
        return end

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k.contiguous(), v.contiguous()
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)  # (B, Hkv, S + T, D): a fresh copy
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.seq_len:
            raise ValueError(f"n: cannot truncate a cache of {self.seq_len} positions to {n}")
        for i in range(self.n_layers):
            if self.k[i] is not None:
                self.k[i], self.v[i] = self.k[i][:, :, :n], self.v[i][:, :, :n]
        self.seq_len = n

    def reset(self) -> None:
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers
        self.seq_len = 0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per vector of the last dimension (per token, per head).

    x: (..., D) float -> (codes (..., D) int8, scales (..., 1) float32), x ~= codes * scales,
    scale = max|x| / 127 (KIVI, Liu et al. 2024, and KVQuant, Hooper et al. 2024, use finer schemes).
    """
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-8) / 127.0
    return torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8), scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., D) int8, scales (..., 1) -> (..., D) ``dtype``."""
    return (codes.float() * scale).to(dtype)


class Int8KVCache(KVCache):
    """A contiguous cache storing keys and values as int8 with a float32 scale per token and head.

    Bytes per position: 2 x Hkv x (D + 4) x layers instead of 2 x Hkv x D x 2 (float16): about half.
    ``update`` returns the dequantized keys/values of every stored position. Same interface as
    ``KVCache``.
    """

    def __init__(self, config: ModelConfig, batch_size: int = 1, max_seq_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__(config, batch_size, max_seq_len, torch.int8, device)
        shape = self.k[0].shape[:-1] + (1,)  # (B, Hkv, S, 1) per layer
        self.k_scale = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in self.k]
        self.v_scale = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in self.v]
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.numel() * 4 for t in self.k_scale + self.v_scale)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_batch(k, self.dtype)
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = quantize_int8(x)
            codes[layer][:, :, self._pos] = q
            scales[layer][:, :, self._pos] = s
        n = self.seq_len
        return (dequantize_int8(self.k[layer][:, :, :n], self.k_scale[layer][:, :, :n], self.dtype),
                dequantize_int8(self.v[layer][:, :, :n], self.v_scale[layer][:, :, :n], self.dtype))


CACHES = {"contiguous": KVCache, "dynamic": DynamicKVCache}


def make_cache(kind: str, config: ModelConfig, batch_size: int = 1, max_seq_len: int | None = None,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", kv_dtype: str | None = None):
    """A cache by name: "none" (None: recompute every step), "contiguous" (preallocated) or
    "dynamic" (grows by concatenation); ``kv_dtype="int8"`` stores a contiguous cache in int8.

    Raises:
        ValueError: an unknown kind, an unknown kv_dtype, or int8 with another cache than contiguous.
    """
    if kind != "none" and kind not in CACHES:
        raise ValueError(f"cache: {kind!r} is not one of {['none', *CACHES]}")
    if kv_dtype in (None, "auto"):
        return None if kind == "none" else CACHES[kind](config, batch_size, max_seq_len, dtype, device)
    if kv_dtype != "int8":
        raise ValueError(f"kv_dtype: {kv_dtype!r} is not supported; use int8 (or leave it unset for the model's dtype)")
    if kind != "contiguous":
        raise ValueError("kv_dtype: int8 is implemented for the contiguous cache only; use --cache contiguous")
    return Int8KVCache(config, batch_size, max_seq_len, dtype, device)


def kv_cache_bytes(config: ModelConfig, batch_size: int, seq_len: int, bytes_per_element: float) -> float:
    """KV-cache size in bytes: 2 x B x seq_len x n_layers x n_kv_heads x head_dim x bytes
    (keys and values; Pope et al. 2023, Sec. 2.2)."""
    return 2 * batch_size * seq_len * config.n_layers * config.n_kv_heads * config.head_dim * bytes_per_element
