"""A draft model inside the engine: its own paged KV pool, one block table per target sequence.

Each step the speculating sequences draft together: the first forward feeds every sequence's tokens the
draft has not seen (the longest prefix its KV shares with the known tokens stays), each further one a
drafted token per sequence, all in one flat row (``pack_flat``). A sampled request drafts from
``logits_to_probs`` with a generator of its own, and verification uses exactly those probabilities as q.
"""

from __future__ import annotations

import math
import time

import torch

from ..sampling import logits_to_probs
from ..sampling_params import SamplingParams
from ..speculative.rejection import draw
from .batching import pack_flat
from .block_manager import NoFreeBlocksError, blocks_for
from .cache import backend
from .sampler import keyed_generator
from .spec_auto import measure_step_cost


class DraftRunner:
    """Drafts for a batch of sequences with a draft ``Decoder`` (the target's vocabulary; a quantized copy of
    the target is one) on its own ``PagedKVCache``, sized from the engine's pool and seats (its ``Scheduler``)."""

    def __init__(self, model, scheduler, k: int, auto: bool):
        self.model = model
        pool, bs = scheduler.manager, scheduler.manager.block_size
        extra = scheduler.max_num_seqs * (blocks_for(k, bs) + 1)  # the drafts past each context
        self.cache = backend(model.paged_backend)(model.config, pool.num_blocks + extra, bs, dtype=model.dtype,
                                                  device=model.device, enable_prefix_caching=False,
                                                  attention=model.paged_backend)
        self.manager = self.cache.manager
        self.max_seq_len = model.config.max_seq_len
        self.fed: dict[int, list[int]] = {}  # seq_id -> the tokens whose K/V the draft's pool holds
        self._q: dict[int, torch.Tensor] = {}  # seq_id -> (d, V) the distributions its drafts came from
        self._seeds: dict[tuple[str, int], int] = {}  # (request, sample) -> the seed its drafts are keyed by
        # what a step changes, so that a failed one is undone (``begin``, ``restore``): per sequence it drafted for,
        # the prefix of its draft KV the step kept (None: the step gave it its draft blocks)
        self._kept: dict[int, int | None] = {}
        # the start's curve reaches a step's token budget (or the draft's context, if shorter): a first forward
        # feeds a whole prompt, which a curve measured only up to the seats would extrapolate flat
        self.cost = measure_step_cost(model, scheduler.max_num_batched_tokens, repeats=2,
                                      every_logit=False) if auto else None
        self.seconds: dict[int, float] = {}  # tokens fed -> seconds of one draft forward of that many, as run

    def forward_cost(self, n: int) -> float:
        """Seconds of one draft forward over n tokens: a moving average of those run at n, else the start's
        measure scaled as the nearest count run so far was (the start times the bare forward, without packing)."""
        if not n or self.cost is None:
            return 0.0
        if n in self.seconds or not self.seconds:
            return self.seconds.get(n, self.cost(n))
        near = min(self.seconds, key=lambda m: abs(math.log(m / n)))
        return self.cost(n) * self.seconds[near] / self.cost(near)

    def feed(self, seq) -> int:
        """Tokens the sequence's first draft forward would feed: those past the longest prefix the draft's KV
        shares with the sequence (its pending token, the last step's accepted ones, or all after a pause)."""
        fed, known = self.fed.get(seq.seq_id, []), seq.token_ids
        n = min(len(fed), len(known) - 1)
        # asked twice a step for every drafting sequence: one list comparison (in C) settles the usual case, where
        # only tokens past the draft's KV differ; a rolled-back draft is found token by token
        keep = n if fed[:n] == known[:n] else next(i for i in range(n) if fed[i] != known[i])
        return len(known) - keep

    def begin(self) -> None:
        """A step starts: what ``restore`` returns to if it fails."""
        self._kept = {}

    @torch.inference_mode()
    def propose(self, seqs) -> None:
        """Draft up to k tokens for each (sequence, request, k); sets ``spec_token_ids`` (and q)."""
        work = []
        for seq, req, k in seqs:
            k = min(k, self.max_seq_len - seq.num_tokens + 1)
            if k < 1:
                continue
            if not self.manager.holds(seq.seq_id):
                self.manager.allocate(seq.seq_id)
                self.fed[seq.seq_id] = []
                self._kept[seq.seq_id] = None
            keep = seq.num_tokens - self.feed(seq)
            self._cut(seq.seq_id, keep)  # rejected drafts leave now: their blocks count as free for this step
            self._kept.setdefault(seq.seq_id, keep)  # a sequence new this step keeps None
            work.append([seq, req, k, seq.token_ids[keep:]])
        try:
            self._draft(work)
        except NoFreeBlocksError:  # the pool is short (forks hold their own copies): no drafts this step
            for seq, _, _, _ in work:
                seq.spec_token_ids = []
                self.free(seq.seq_id)

    def _draft(self, work) -> None:
        for seq, _, _, _ in work:
            seq.spec_token_ids, self._q[seq.seq_id] = [], []
        depth = 0
        while work:
            start = time.perf_counter()
            spans = [(seq.seq_id, len(self.fed[seq.seq_id]), feed) for seq, _, _, feed in work]
            rows = pack_flat(spans, self.model.device)
            self.cache.set_rows(rows.seq_ids, rows.widths)
            logits = self.model(rows.tokens, rows.input_pos, self.cache,
                                logits_indices=rows.logits_indices([s for s, _, _ in spans]))
            greedy = logits.argmax(-1).tolist()
            # every forward is timed by the tokens it fed, the first too: a draft's cost is its packing and its
            # paged cache as much as its weights, and its first forward also feeds what the last step accepted
            fed, took = rows.tokens.numel(), time.perf_counter() - start
            self.seconds[fed] = 0.7 * self.seconds.get(fed, took) + 0.3 * took
            for i, (seq, req, k, feed) in enumerate(work):
                self.fed[seq.seq_id] += feed
                if req.params.greedy:
                    token = greedy[i]
                else:
                    q = logits_to_probs(logits[i:i + 1], req.params)[0].cpu()
                    token = draw(q, self._generator(req, seq.index, seq.num_tokens + len(seq.spec_token_ids)))
                    self._q[seq.seq_id].append(q)
                seq.spec_token_ids.append(token)
                work[i][3] = [token]
            depth += 1
            work = [w for w in work if w[2] > depth]

    def probs(self, seq) -> torch.Tensor:
        """(d, V) q of the sequence's drafts (one-hot of the argmax for a greedy request)."""
        d, q = len(seq.spec_token_ids), self._q.get(seq.seq_id) or []
        if len(q) >= d:
            return torch.stack(q[:d])
        onehot = torch.zeros(d, self.model.config.vocab_size)
        onehot[torch.arange(d), torch.tensor(seq.spec_token_ids)] = 1.0
        return onehot

    def _generator(self, req, index: int, position: int) -> torch.Generator:
        """The random numbers of the draft at ``position``, keyed by the request's seed (a random one if it has
        none), the sample and the position, as ``keyed_run`` keys the target's: a draft drawn again at the same
        place (after a failed step, a preemption) is the same draft, so a seeded request's drafts do not depend on
        its batch. Still exact: a position's draft is verified once, with the request's own random numbers."""
        key = (req.request_id, index)
        if key not in self._seeds:
            seed = req.params.seed
            self._seeds[key] = seed if seed is not None else int(torch.randint(2 ** 62, ()))
        return keyed_generator(self._seeds[key], index, position)

    def _cut(self, seq_id: int, n: int) -> None:
        """Keep the first n tokens of the sequence's draft KV (and their blocks)."""
        del self.fed[seq_id][n:]
        if self.manager.num_tokens(seq_id) > n:
            self.manager.truncate(seq_id, n)

    def restore(self) -> None:
        """A failed step: the sequences it gave draft blocks to give them back, and the others keep the prefix it
        did not write over (its tokens were known, so the next step feeds from there, as the failed one did)."""
        for seq_id, keep in self._kept.items():
            if keep is None:
                self.free(seq_id)
            elif self.manager.holds(seq_id):
                self._cut(seq_id, keep)
        self._kept = {}

    def release(self, running) -> None:
        """Free the draft KV of sequences that no longer run (preempted ones recompute it)."""
        alive = {s.seq_id for s in running}
        for seq_id in [s for s in self.manager.seq_ids() if s not in alive]:
            self.free(seq_id)

    def free(self, seq_id: int) -> None:
        """Give back a sequence's draft blocks and forget its drafts."""
        if self.manager.holds(seq_id):
            self.cache.free(seq_id)
        self.fed.pop(seq_id, None)
        self._q.pop(seq_id, None)

    def forget(self, seq) -> None:
        """A finished or aborted sequence: its blocks and its seed go."""
        self.free(seq.seq_id)
        self._seeds.pop((seq.request_id, seq.index), None)
