"""``generate_paged``: ``generate_cached`` with its contiguous cache replaced by a ``PagedKVCache``: the same
loop and result, so the two can be timed against each other (Kwon et al. 2023, Sec. 4: the block-table
indirection should cost little against reading the weights).
"""

from __future__ import annotations

from typing import Callable

from ..generation import run_batch
from ..stops import GenerationResult, check_prompt
from ..sampling_params import SamplingParams
from .block_manager import blocks_for
from .cache import backend


def generate_paged(model, prompt_tokens: list[int], params: SamplingParams = SamplingParams(), *,
                   block_size: int = 16, num_blocks: int | None = None, attention: str | None = None,
                   max_seq_len: int | None = None, tokenizer=None,
                   on_token: Callable[[int], None] | None = None,
                   eos_ids: set[int] | None = None) -> GenerationResult:
    """Generate with a paged KV cache: prefill once, then one token per decode step; at temperature 0 the
    same ``GenerationResult`` as ``generate_cached``, whose other arguments it takes.

    Args:
        block_size: tokens per KV block; attention: the cache's read (``cache.BACKENDS``; None: the model's own,
            ``model.paged_backend``).
        num_blocks: blocks in the pool (default: enough for the prompt and ``max_new_tokens``, within the context).

    Raises:
        ValueError: as ``generate_cached``, and a pool too small for the prompt.
        NoFreeBlocksError: a ``num_blocks`` too small for the tokens generated.
    """
    ctx = check_prompt(model, prompt_tokens, max_seq_len)
    attention = attention or model.paged_backend
    if num_blocks is None:
        num_blocks = blocks_for(min(ctx, len(prompt_tokens) + params.max_new_tokens), block_size)

    def paged_cache(config, batch_size, max_seq_len, dtype, device):
        cache = backend(attention)(config, num_blocks, block_size, dtype=dtype, device=device,
                             enable_prefix_caching=False, attention=attention)
        cache.add_sequence(0, prompt_tokens)
        cache.set_rows([0])
        return cache

    return run_batch(model, [prompt_tokens], params, cache_kind="paged", max_seq_len=max_seq_len, tokenizer=tokenizer,
                on_token=on_token, eos_ids=eos_ids, cache_factory=paged_cache)[0]
