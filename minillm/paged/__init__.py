"""PagedAttention's memory side (Kwon et al. 2023, arXiv 2309.06180, Sec. 4): KV blocks in one pool,
a block table per sequence, copy-on-write after a fork, prefix caching, attention over blocks, and
what paging saves (Sec. 3, Fig. 2).

* ``BlockManager`` (block_manager.py): block tables, slot_mapping, fork / copy-on-write, over a
  ``BlockPool`` (block_pool.py: free queue, reference counts; ``NoFreeBlocksError`` when it runs out).
  ``PrefixCache`` (prefix_cache.py): full blocks found again by their tokens.
* ``PagedKVCache`` (cache.py): the pool of (num_blocks, block_size, Hkv, D) tensors per layer behind
  the cache interface, so ``minillm.model.Decoder.forward`` runs on it, for ragged batches too.
* ``paged_attention`` (attention.py): block-wise attention with an online softmax (the kernel's algorithm).
* ``generate_paged`` (generate.py): ``generate_cached`` on a paged cache.
* The engine: ``LLM`` / ``LLMEngine`` (llm.py, engine.py: continuous batching in vLLM's API; its
  settings: config.py), ``Scheduler`` (scheduler.py), ``pack_flat`` / ``pack_rows`` (batching.py), what
  each request draws, forks and keeps (requests.py), ``Sequence`` / ``RequestOutput`` (sequence.py),
  beam search (beam.py).
* ``kv_utilization`` and the request traces (fragmentation.py): the share of reserved KV memory holding
  tokens under reservation and paging. What measures all this lives in ``minillm.lab``.
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
from .scheduler import Scheduler
from .sequence import CompletionOutput, RequestMetrics, RequestOutput, Sequence, SequenceStatus
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
