"""The engine's settings, refused before any memory is taken or model loaded (as vLLM's ``EngineArgs``),
each error naming the setting and what it takes."""

from __future__ import annotations

import numbers

from .cache import backend

__all__ = ["DEFAULT_KV_BYTES", "check_count", "check_engine_args"]

DEFAULT_KV_BYTES = 512 * 2 ** 20  # the pool when neither num_blocks nor kv_cache_bytes is given (at most)


def check_count(name: str, value, optional: bool = False) -> None:
    """Raises ValueError naming ``name`` unless value is an integer >= 1 (or None, when optional)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}: must be an integer >= 1{' (or None)' if optional else ''}, got {value!r}")


def check_engine_args(block_size=16, num_blocks=None, kv_cache_bytes=None, max_num_seqs=64,
                      max_num_batched_tokens=256, max_seq_len=None, attention=None, row_width=None) -> None:
    """Refuse an engine setting before any memory is taken or model loaded, naming the setting.

    Raises:
        ValueError: a size that is not a positive integer (num_blocks, max_seq_len: or None), a
            kv_cache_bytes that is not a positive number, an unknown attention path, or a row_width
            with a path that packs one flat row.
    """
    for name, value, optional in (("block_size", block_size, False), ("num_blocks", num_blocks, True),
                                  ("max_num_seqs", max_num_seqs, False),
                                  ("max_num_batched_tokens", max_num_batched_tokens, False),
                                  ("max_seq_len", max_seq_len, True)):
        check_count(name, value, optional)
    if kv_cache_bytes is not None and (isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, numbers.Real)
                                       or not 0 < kv_cache_bytes < float("inf")):
        raise ValueError(f"kv_cache_bytes: must be a positive number of bytes (or None), got {kv_cache_bytes!r}")
    if attention is not None and row_width is not None and attention in backend(attention).FLAT_PATHS:
        raise ValueError(f"row_width: attention={attention!r} packs one flat row without padding; row_width "
                         "applies to the padded rows of 'indexed' and 'gather'")
