"""PagedAttention's memory side (Kwon et al. 2023, arXiv 2309.06180, Sec. 4) and the engine on top of it.

* ``BlockManager`` over a ``BlockPool`` and a ``PrefixCache``: block tables, slot_mapping, copy-on-write,
  prefix caching. ``PagedKVCache``: the pool behind the cache interface, so ``Decoder.forward`` runs on it.
* ``paged_attention``: block-wise attention with an online softmax; ``generate_paged``: ``generate_cached``
  on a paged cache.
* ``LLM`` / ``LLMEngine``: continuous batching in vLLM's API (``Scheduler``, ``pack_flat`` / ``pack_rows``,
  ``Sequence`` / ``RequestOutput``, beam search, speculative decoding in the batch).
* ``kv_utilization`` and the request traces: what paging saves (Sec. 3, Fig. 2).
"""

from .attention import paged_attention
from .block_manager import BlockManager, DoubleFreeError, NoFreeBlocksError, UnknownSequenceError, blocks_for
from .block_pool import BlockPool
from .prefix_cache import PrefixCache, hash_block_tokens
from .stats import PrefixCacheStats
from .batching import pack_flat, pack_rows, pack_rows_naive
from .beam import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_search_naive
from .cache import PagedKVCache
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from .fragmentation import TRACES, kv_utilization, make_trace
from .generate import generate_paged

__all__ = [
    "LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput", "LLMEngine",
    "RequestMetrics", "RequestOutput", "Scheduler", "Sequence", "SequenceStatus", "beam_search_naive", "pack_flat",
    "pack_rows", "pack_rows_naive",
    "BlockManager", "BlockPool", "DoubleFreeError", "NoFreeBlocksError", "PagedKVCache", "PrefixCache",
    "PrefixCacheStats", "TRACES", "UnknownSequenceError", "blocks_for", "generate_paged", "hash_block_tokens",
    "kv_utilization", "make_trace", "paged_attention",
]
