"""The capstone: the student writes the engine's serving loop (schedule, give and free blocks, pack, forward,
sample or verify, append, stop) around their own pieces and the package's model, and its tokens are compared
with the package's engine (``minillm.LLM``) token for token.

The student's loop has ``serve``'s signature and returns a ``ServeResult``; every decision in it is one of
their functions (``capstone_kit.PIECES``): ``schedule_step`` says who decodes, who is preempted and who is
admitted; ``blocks_needed`` / ``needs_new_block`` give sequences their blocks from one pool; ``slot_mapping``
says where each position's keys and values go and ``cache_update`` writes them there; ``rope_at_offset``
rotates queries and keys at their real positions; ``top_p_filter`` filters the next-token distribution; with
``num_speculative_tokens``, ``ngram_propose`` drafts into the free slots of a sequence's last block and
``speculative_verify`` keeps a prefix (at temperature 0 the emitted tokens are the target's own). The model's
forward runs unchanged: the pieces come in through the cache it is given (``capstone_kit.SequenceCache``) and
through its RoPE (``capstone_kit.rope_swapped``). What is not the lesson is the kit's (capstone_kit.py); this
file holds the reference loop (``serve``, the solution notebook's twin), the comparison with the engine, and
the grader's row: the student's loop, called with the student's own pieces on ``PROMPTS`` in each of
``SETTINGS``, earns a point per prompt and setting whose tokens are the engine's.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .capstone_kit import (PIECES, PROMPTS, SETTINGS, SPECULATIVE_PIECES, SequenceCache, ServeResult, check_pieces,
                           default_schedule_step, new_pools, rope_swapped)
from .checker import Answer, CaseResult, Report, describe

# the engine, switched off while the student's loop runs (here in the notebook; the grader's process switches
# off the whole package but the model's forward and the config classes)
ENGINE = ("minillm.paged.llm.LLM.generate", "minillm.paged.engine.LLMEngine.step", "minillm.generation.generate",
          "minillm.generation.generate_cached", "minillm.generation.generate_naive",
          "minillm.generation.generate_batch", "minillm.generation.generate_dynamic",
          "minillm.paged.generate.generate_paged", "minillm.exercises.capstone.serve")
# what the student's loop may call in the grader's process besides torch and the kit: the model's forward
TOOLS = ("minillm.model", "minillm.linear", "minillm.kv_cache.Cache")


@torch.inference_mode()
def serve(model, prompts: list[list[int]], pieces: dict, *, max_new_tokens: int = 16, block_size: int = 4,
          num_blocks: int = 24, max_num_seqs: int = 4, top_p: float = 0.9, num_speculative_tokens: int = 0,
          seed: int = 0) -> ServeResult:
    """Greedy continuous batching over one pool of ``num_blocks`` blocks, every decision one of ``pieces``.

    Each step: schedule (``schedule_step``: who decodes, who is preempted, who is admitted); give and free blocks
    (preempted sequences give theirs back and are recomputed later; a decode that opens a block takes one; an
    admitted prompt takes ``blocks_needed``); then per sequence: pack (its ``SequenceCache`` over the pool),
    forward (its prefill, or its pending token and drafts, with RoPE at their positions), sample or verify
    (greedy through ``top_p_filter``; drafts through ``speculative_verify``), append; stop (a sequence with
    ``max_new_tokens`` new tokens leaves and frees its blocks).

    Args:
        model: a ``minillm.Decoder``. prompts: token ids per prompt.
        pieces: name -> function for each of ``PIECES`` (the last two only with drafts).
        max_new_tokens: tokens generated per prompt. block_size, num_blocks: the pool. max_num_seqs: seats.
        top_p: passed to ``top_p_filter``. num_speculative_tokens: drafts per decode (0: none). seed: of the
            verification's uniforms.

    Returns:
        ``ServeResult``: each prompt's ``max_new_tokens`` new tokens, steps, preemptions, drafted and accepted.

    Raises:
        ValueError: a piece missing (naming it), or a piece whose answer breaks the loop's bookkeeping (a
            free-block count that disagrees with the block tables, a prompt that never fits the pool).
    """
    check_pieces(pieces, num_speculative_tokens)
    pools = new_pools(model, num_blocks, block_size)
    free = list(range(num_blocks))  # free block ids, taken from the front
    tokens = [list(p) for p in prompts]  # each sequence's known tokens
    cached = [0] * len(prompts)  # positions whose keys and values are in the pool
    tables: list[list[int]] = [[] for _ in prompts]
    waiting, running = list(range(len(prompts))), []
    out = ServeResult([[] for _ in prompts])
    gen = torch.Generator().manual_seed(seed)
    while waiting or running:
        out.steps += 1
        # 1. schedule
        decoded, preempted, admitted, n_free = pieces["schedule_step"](
            [(i, cached[i]) for i in running], [(i, len(tokens[i])) for i in waiting], len(free), block_size,
            max_num_seqs)
        # 2. blocks: a preempted sequence gives its back and is recomputed from every known token
        for i in preempted:
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
        running = [i for i in running if i not in preempted] + list(admitted)
        waiting = sorted([i for i in waiting if i not in admitted] + list(preempted))
        for i in list(decoded) + list(admitted):
            start, draft = cached[i], []
            if start and num_speculative_tokens:  # 3. drafts, only into the free slots of the blocks it holds
                room = len(tables[i]) * block_size - start - 1
                if room > 0:
                    draft = list(pieces["ngram_propose"](tokens[i], min(num_speculative_tokens, room), 3, 1))[:room]
            feed = tokens[i][start:] + draft  # a prefill: every known token; a decode: the pending one (and drafts)
            # 4. pack and forward
            cache = SequenceCache(pools, tables[i], block_size, pieces)
            with rope_swapped(pieces["rope_at_offset"], start, model.config.rope_base):
                logits = model(torch.tensor([feed]), torch.arange(start, start + len(feed)), cache)[0]  # (T, V)
            # 5. sample (greedy, through top-p) or verify the drafts
            rows = logits[-1 - len(draft):].float()  # the pending token's row and one per draft
            probs = pieces["top_p_filter"](torch.softmax(rows, -1), top_p)  # (1 + k, V)
            target = torch.zeros_like(probs).scatter(-1, probs.argmax(-1, keepdim=True), 1.0)  # greedy target
            n_ok, next_probs = 0, target[-1]
            if draft:
                draft_probs = torch.zeros(len(draft), probs.shape[1]).scatter(-1, torch.tensor(draft)[:, None], 1.0)
                n_ok, next_probs = pieces["speculative_verify"](draft, draft_probs, target,
                                                                torch.rand(len(draft), generator=gen))
                n_ok = int(n_ok)
                out.drafted, out.accepted = out.drafted + len(draft), out.accepted + n_ok
            # 6. append: the accepted drafts and the next token; the rejected drafts' positions are rolled back
            tokens[i] += draft[:n_ok] + [int(torch.as_tensor(next_probs).argmax())]
            cached[i] = start + len(feed) - len(draft) + n_ok
        # 7. stop: a finished sequence leaves and frees its blocks
        for i in [i for i in running if len(tokens[i]) - len(prompts[i]) >= max_new_tokens]:
            running.remove(i)
            free += tables[i]
            tables[i] = []
    out.tokens = [tokens[i][len(p):len(p) + max_new_tokens] for i, p in enumerate(prompts)]
    return out


def engine_tokens(model, prompts: list[list[int]], max_new_tokens: int = 16) -> list[list[int]]:
    """``minillm.LLM``'s greedy tokens for each prompt (temperature 0, no end-of-sequence stop)."""
    from ..paged.llm import LLM
    from ..sampling import SamplingParams

    outputs = LLM(model, block_size=16, num_blocks=64).generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """None when the token lists are equal, else the index of the first token where they differ (or where the
    shorter ends)."""
    if ours == theirs:
        return None
    return next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def _differs(ours: list[int], theirs: list[int], j: int) -> str:
    return f"differs from token {j} on (yours {ours[j:j + 3]}, the engine's {theirs[j:j + 3]})"


def compare_with_engine(loop, model, prompts: list[list[int]], pieces: dict, *, max_new_tokens: int = 16,
                        **settings) -> tuple[bool, str, ServeResult]:
    """The student's serving ``loop`` (``serve``'s signature) with their ``pieces`` beside ``minillm.LLM`` at
    temperature 0 on the same prompts: (same tokens for every prompt, a line per prompt saying where they first
    differ, the loop's result). While the loop runs, the engine (``ENGINE``) raises ``ForbiddenCallError``.

    Raises:
        whatever the loop raises; TypeError: it returned no ``ServeResult``.
    """
    from .forbid import forbidden

    with forbidden("serve", ENGINE) if loop is not serve else contextlib.nullcontext():
        mine = loop(model, prompts, pieces, max_new_tokens=max_new_tokens, **settings)
    if not isinstance(getattr(mine, "tokens", None), list):
        raise TypeError(f"serve: return a ServeResult (from minillm.exercises.capstone), got {type(mine).__name__}")
    lines, same = [], True
    for k, (ours, theirs) in enumerate(zip(mine.tokens, engine_tokens(model, prompts, max_new_tokens))):
        ours = [int(t) for t in ours]
        j = first_difference(ours, theirs)
        same = same and j is None
        lines.append(f"prompt {k}: " + (f"{len(ours)} tokens, the same as the engine's" if j is None
                                        else _differs(ours, theirs, j)))
    return same, "\n".join(lines), mine


# ---------------------------------------------------------------------------------------------
# The grader's row


@functools.cache
def grading_setup() -> tuple:
    """(model, prompts, the engine's tokens) of the capstone's row: SmolLM2 as ``load_model(fast=False)`` gives
    it (the model's own forward, plain torch), ``PROMPTS`` encoded, and ``minillm.LLM``'s greedy tokens (the same
    in every setting: greedy tokens depend on neither the pool nor the drafts). Loaded once per grading run."""
    from ..loading import load_model

    model, tokenizer = load_model(fast=False)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    return model, prompts, engine_tokens(model, prompts, max(s["max_new_tokens"] for s in SETTINGS.values()))


def _token_lists(got, n: int) -> list[list[int]] | None:
    """The tokens of a loop's answer as it came back from its process (a ServeResult's fields as a dict, or the
    token lists themselves), or None when it holds no n lists of token ids."""
    tokens = got.get("tokens") if isinstance(got, dict) else got
    try:
        lists = [[int(t) for t in (row.tolist() if isinstance(row, torch.Tensor) else row)] for row in tokens]
    except (TypeError, ValueError):
        return None
    return lists if len(lists) == n else None


def grade_serve(answers: list[Answer], expected: list[list[int]], settings: list[str] = list(SETTINGS)) -> Report:
    """The capstone's row: one case per setting and prompt, a point each when the loop's tokens are the
    engine's (``expected``, per prompt). A loop that called the engine (``Answer.calls``) earns 0; one that
    raised, or never called one of the pieces the setting needs (``called`` in its answer, from the grader's
    process), loses that setting's points, with a line saying why."""
    report = Report("serve")
    report.calls = list(dict.fromkeys(c for a in answers for c in a.calls))
    for setting, ans in zip(settings, answers):
        names = [f"{setting}, prompt {k}" for k in range(len(expected))]
        if ans.error == "NotImplementedError":
            report.unwritten = f"not written yet ({ans.message}): replace the raise with your loop"
            report.results = [CaseResult(n, False, "", "NotImplementedError", report.unwritten) for n in
                              [f"{s}, prompt {k}" for s in settings for k in range(len(expected))]]
            return report
        if ans.error == "ForbiddenCallError" or ans.calls:
            called = ans.calls[0] if ans.calls else ans.message.split(" is ")[0]
            report.forbidden = report.forbidden or f"{called} is switched off while your serving loop is graded"
            report.results += [CaseResult(n, False, "the engine's tokens", f"your loop called {called}{ans.where}",
                                          "the grader switches off the engine (minillm.LLM, minillm.paged, "
                                          "generate*, capstone.serve) while your loop runs: write the loop "
                                          "yourself, with your pieces") for n in names]
            continue
        if ans.error:
            report.results += [CaseResult(n, False, "the engine's tokens", f"your loop raised {ans.error}: "
                                          f"{ans.message}{ans.where}", "run this setting in the notebook "
                                          "(compare_with_engine) and read the error") for n in names]
            continue
        got = _token_lists(ans.got, len(expected))
        wanted = PIECES if SETTINGS.get(setting, {}).get("num_speculative_tokens") else PIECES[:7]
        unused = [p for p in wanted if isinstance(ans.got, dict) and p not in ans.got.get("called", wanted)]
        if unused:  # tokens computed some other way (the model's forward without the pieces) earn nothing
            report.results += [CaseResult(n, False, "a loop that calls every piece", f"your loop never called "
                                          f"{', '.join(unused)}", "every decision of the loop is one of your pieces: "
                                          "call each where its step needs it") for n in names]
            continue
        if got is None:
            report.results += [CaseResult(n, False, "a ServeResult", describe(ans.got),
                                          f"return a ServeResult with one token list per prompt ({len(expected)})")
                               for n in names]
            continue
        for name, ours, theirs in zip(names, got, expected):
            j = first_difference(ours, theirs)
            report.results.append(CaseResult(name, True, points=1.0) if j is None else CaseResult(
                name, False, f"from token {j}: {describe(theirs[j:])}", f"from token {j}: {describe(ours[j:])}",
                _differs(ours, theirs, j) + ": the step that computes it went wrong (a piece, the blocks given "
                "or freed, the position a forward starts at); compare_with_engine shows it in the notebook"))
    return report


__all__ = ["ENGINE", "PIECES", "PROMPTS", "SETTINGS", "SPECULATIVE_PIECES", "TOOLS", "SequenceCache", "ServeResult",
           "check_pieces", "compare_with_engine", "default_schedule_step", "engine_tokens", "first_difference",
           "grade_serve", "grading_setup", "new_pools", "rope_swapped", "serve"]
