"""The capstone: a student's own pieces, plugged into the package's model, serve a batch of prompts, and the
tokens are compared with the package's engine (``minillm.LLM``) token for token.

``serve(model, prompts, pieces)`` is a small continuous-batching loop in which every step the engine takes
is a student's function: ``schedule_step`` decides who decodes, who is preempted and who is admitted;
``blocks_needed`` / ``needs_new_block`` give sequences their blocks from one pool; ``slot_mapping`` says
where each position's keys and values go, ``cache_update`` writes them there (one slot at a time, the pool
seen as one long cache); ``rope_at_offset`` rotates queries and keys at their real positions;
``top_p_filter`` filters the next-token distribution; with ``num_speculative_tokens``, ``ngram_propose``
drafts into the free slots of a sequence's last block and ``speculative_verify`` keeps a prefix (at
temperature 0 the emitted tokens are the target's own). The model's forward runs unchanged: the pieces
come in through the cache it is given and through its RoPE, which is wrapped while a sequence runs (the
decoder has no RoPE argument, so ``minillm.model.apply_rope`` is swapped for the student's and put back).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .. import model as model_module
from ..kv_cache import Cache

PIECES = ("cache_update", "rope_at_offset", "blocks_needed", "needs_new_block", "slot_mapping", "top_p_filter",
          "schedule_step", "speculative_verify", "ngram_propose")


class _SequenceCache(Cache):
    """The KV-cache interface the decoder calls (``prepare``, ``update``), for one sequence over the shared
    pool: each layer's pool is a (1, Hkv, num_blocks * block_size, D) tensor, slot s at position s."""

    def __init__(self, pools, table: list[int], block_size: int, pieces: dict):
        self.pools, self.table, self.block_size, self.pieces = pools, table, block_size, pieces

    def prepare(self, input_pos: torch.Tensor) -> int:
        self.start, self.end = int(input_pos[0]), int(input_pos[-1]) + 1
        slots = self.pieces["slot_mapping"]
        self.new_slots = [int(s) for s in slots(self.table, input_pos.cpu(), self.block_size)]
        self.all_slots = torch.as_tensor(slots(self.table, torch.arange(self.end), self.block_size), dtype=torch.long)
        return self.end

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        k_pool, v_pool = self.pools[layer]
        for t, slot in enumerate(self.new_slots):  # (1, Hkv, 1, D) at pool position ``slot``, in place
            self.pieces["cache_update"](k_pool, v_pool, k[:, :, t:t + 1], v[:, :, t:t + 1], slot)
        return k_pool[:, :, self.all_slots], v_pool[:, :, self.all_slots]  # (1, Hkv, end, D) in position order


@contextmanager
def _student_rope(rope_at_offset, cache: _SequenceCache, base: float):
    """The decoder's RoPE replaced by the student's for one forward of one sequence (positions start..)."""
    original = model_module.apply_rope
    model_module.apply_rope = lambda x, cos, sin: rope_at_offset(x, cache.start, base)
    try:
        yield
    finally:
        model_module.apply_rope = original


@dataclass
class ServeResult:
    """Each prompt's generated token ids, in the prompts' order, and what the loop did."""

    tokens: list[list[int]]
    steps: int = 0
    preemptions: int = 0
    drafted: int = 0
    accepted: int = 0


@torch.inference_mode()
def serve(model, prompts: list[list[int]], pieces: dict, *, max_new_tokens: int = 16, block_size: int = 4,
          num_blocks: int = 24, max_num_seqs: int = 4, top_p: float = 0.9, num_speculative_tokens: int = 0,
          seed: int = 0) -> ServeResult:
    """Greedy continuous batching with the student's ``pieces`` (a dict, names as ``PIECES``).

    Raises:
        ValueError: a piece missing (naming it), or a piece whose answer breaks the loop's bookkeeping (a
            free-block count that disagrees with the block tables, a prompt that never fits the pool).
    """
    needed = [p for p in PIECES[:7] + (PIECES[7:] if num_speculative_tokens else ()) if not callable(pieces.get(p))]
    if needed:
        raise ValueError(f"pieces: give your functions {', '.join(needed)} (a dict: name -> function)")
    c = model.config
    pools = [(torch.zeros(1, c.n_kv_heads, num_blocks * block_size, c.head_dim, dtype=model.dtype),
              torch.zeros(1, c.n_kv_heads, num_blocks * block_size, c.head_dim, dtype=model.dtype))
             for _ in range(c.n_layers)]
    free = list(range(num_blocks))
    tokens = {i: list(p) for i, p in enumerate(prompts)}
    cached = {i: 0 for i in tokens}  # positions in the cache
    tables: dict[int, list[int]] = {i: [] for i in tokens}
    waiting, running, done = sorted(tokens), [], set()
    out = ServeResult([[] for _ in prompts])
    gen = torch.Generator().manual_seed(seed)
    while waiting or running:
        out.steps += 1
        decoded, preempted, admitted, n_free = pieces["schedule_step"](
            [(i, cached[i]) for i in running], [(i, len(tokens[i])) for i in waiting], len(free), block_size,
            max_num_seqs)
        for i in preempted:  # its blocks go back; it is recomputed from every known token
            free += tables[i]
            tables[i], cached[i] = [], 0
        for i in decoded:
            if pieces["needs_new_block"](cached[i], block_size):
                tables[i].append(free.pop(0))
        for i in admitted:
            tables[i] = [free.pop(0) for _ in range(pieces["blocks_needed"](len(tokens[i]), block_size))]
        if n_free != len(free):
            raise ValueError(f"schedule_step: says {n_free} blocks are free after the step; the block tables leave "
                             f"{len(free)}")
        if not decoded and not admitted and not preempted:
            raise ValueError(f"schedule_step: nothing scheduled with {len(waiting)} waiting; a prompt longer than "
                             f"the pool ({num_blocks} blocks of {block_size})?")
        out.preemptions += len(preempted)
        running = [i for i in running if i not in preempted]
        waiting = sorted([i for i in waiting if i not in admitted] + list(preempted))
        running += admitted
        for i in decoded + admitted:
            _advance(model, i, tokens, cached, tables, pools, pieces, block_size, top_p, num_speculative_tokens,
                     gen, out)
            if len(tokens[i]) - len(prompts[i]) >= max_new_tokens:
                done.add(i)
        for i in [i for i in running if i in done]:
            running.remove(i)
            free += tables[i]
            tables[i] = []
    out.tokens = [tokens[i][len(p):len(p) + max_new_tokens] for i, p in enumerate(prompts)]
    return out


def _advance(model, i, tokens, cached, tables, pools, pieces, block_size, top_p, gamma, gen, out) -> None:
    """One forward of sequence i: its prefill (or recompute), or its pending token and drafts; then the
    next token (and the accepted drafts) appended."""
    known = tokens[i]
    start = cached[i]
    draft = []
    if start and gamma:  # drafts only into the free slots of the blocks it holds
        room = len(tables[i]) * block_size - start - 1
        draft = list(pieces["ngram_propose"](known, min(gamma, room), 3, 1))[:max(room, 0)] if room > 0 else []
    feed = known[start:] + draft  # a prefill: every known token; a decode: the pending one (and drafts)
    cache = _SequenceCache(pools, tables[i], block_size, pieces)
    with _student_rope(pieces["rope_at_offset"], cache, model.config.rope_base):
        logits = model(torch.tensor([feed]), torch.arange(start, start + len(feed)), cache)[0]  # (T, V)
    rows = logits[-1 - len(draft):].float()  # the pending token's row and one per draft
    probs = pieces["top_p_filter"](torch.softmax(rows, -1), top_p)  # (1 + k, V)
    target = torch.zeros_like(probs).scatter(-1, probs.argmax(-1, keepdim=True), 1.0)  # greedy target
    if draft:
        draft_probs = torch.zeros(len(draft), probs.shape[1]).scatter(-1, torch.tensor(draft)[:, None], 1.0)
        uniforms = torch.rand(len(draft), generator=gen)
        n_ok, next_probs = pieces["speculative_verify"](draft, draft_probs, target, uniforms)
        n_ok = int(n_ok)
        out.drafted, out.accepted = out.drafted + len(draft), out.accepted + n_ok
    else:
        n_ok, next_probs = 0, target[-1]
    new = draft[:n_ok] + [int(torch.as_tensor(next_probs).argmax())]
    cached[i] = start + len(feed) - len(draft) + n_ok  # the rejected drafts' positions are rolled back
    tokens[i] = known + new


def compare_with_engine(model, prompts: list[list[int]], pieces: dict, *, max_new_tokens: int = 16,
                        **kwargs) -> tuple[bool, str, ServeResult]:
    """``serve`` with the student's pieces beside ``minillm.LLM`` at temperature 0 on the same prompts:
    (same tokens for every prompt, a line per prompt saying where they first differ, the student's result)."""
    from ..paged.llm import LLM
    from ..sampling import SamplingParams

    mine = serve(model, prompts, pieces, max_new_tokens=max_new_tokens, **kwargs)
    engine = LLM(model, block_size=16, num_blocks=64).generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True), use_tqdm=False)
    lines, same = [], True
    for k, (ours, theirs) in enumerate(zip(mine.tokens, (o.outputs[0].token_ids for o in engine))):
        theirs = list(theirs)
        first = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is None and len(ours) == len(theirs):
            lines.append(f"prompt {k}: {len(ours)} tokens, the same as the engine's")
        else:
            same = False
            j = first if first is not None else min(len(ours), len(theirs))
            lines.append(f"prompt {k}: differs from token {j} on (yours {ours[j:j + 3]}, "
                         f"the engine's {theirs[j:j + 3]})")
    return same, "\n".join(lines), mine
