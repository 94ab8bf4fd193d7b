"""PagedAttention's memory side (Kwon et al. 2023, arXiv 2309.06180, Sec. 4): KV blocks in one pool,
a block table per sequence, copy-on-write after a fork, prefix caching, attention over blocks, and
the fragmentation lab (Sec. 3, Fig. 2).

* ``BlockManager`` (block_manager.py): free queue, reference counts, block tables, slot_mapping,
  fork / copy-on-write, prefix caching; ``NoFreeBlocksError`` when the pool runs out.
* ``PagedKVCache`` (cache.py): the pool of (num_blocks, block_size, Hkv, D) tensors per layer behind
  the cache interface, so ``minillm.model.Decoder.forward`` runs on it, for ragged batches too.
* ``paged_attention`` (attention.py): block-wise attention with an online softmax (the kernel's algorithm).
* ``generate_paged`` (generate.py): ``generate_cached`` on a paged cache.
* ``run_lab`` / ``format_table`` / ``kv_utilization`` (fragmentation.py): the share of reserved KV
  memory holding tokens under reservation and paging; figures in plots.py;
  ``python -m minillm fragmentation`` (cli.py, ``register``).
"""

from .attention import measure_attention_paths, paged_attention
from .block_manager import (
    BlockManager,
    DoubleFreeError,
    NoFreeBlocksError,
    PrefixCacheStats,
    UnknownSequenceError,
    blocks_for,
    hash_block_tokens,
)
from .cache import PagedKVCache
from .fragmentation import TRACES, format_table, kv_utilization, make_trace, run_lab
from .generate import generate_paged
from .plots import fork_example, plot_fork_cow, plot_memory_vs_block_size

__all__ = [
    "BlockManager", "DoubleFreeError", "NoFreeBlocksError", "PagedKVCache", "PrefixCacheStats", "TRACES",
    "UnknownSequenceError", "blocks_for", "fork_example", "format_table", "generate_paged", "hash_block_tokens",
    "kv_utilization", "make_trace", "measure_attention_paths", "paged_attention", "plot_fork_cow",
    "plot_memory_vs_block_size", "run_lab",
]
