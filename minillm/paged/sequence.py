"""What the engine knows about each request, as plain data: ``Sequence`` and ``Request`` (what it hands back
is in ``outputs.py``).

Kwon et al. 2023 (vLLM, arXiv 2309.06180), Sec. 4.5 (a request is a group of sequences sharing the prompt's
blocks: n samples or a search's beams) and vLLM V1's ``Request`` (``num_computed_tokens`` catches up with
the known tokens, prompt and output alike: no separate prefill or decode state). A ``Sequence`` holds no
tensors and no block size; its ``block_table`` lives in the ``BlockManager`` alone, so that a fork, a
copy-on-write or a preemption can never leave two copies disagreeing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .outputs import RequestMetrics


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # holds no blocks: not yet admitted, or preempted (recomputed when readmitted)
    RUNNING = "running"  # holds blocks; catches up with its known tokens step by step
    FINISHED = "finished"  # blocks returned


@dataclass(eq=False)  # compared by identity: the scheduler's lists find a sequence without comparing its tokens
class Sequence:
    """One sequence of a request (a sample or a beam)."""

    seq_id: int  # the block manager's id (unique in the engine)
    request_id: str
    index: int  # its sample (or beam) number in the request
    priority: tuple[int, int]  # (request's arrival order, index): lower runs first, the highest is preempted first
    token_ids: list[int]  # every known token, prompt then outputs (a sampled token is known before its K/V)
    num_prompt_tokens: int
    num_computed_tokens: int = 0  # leading tokens whose K/V is in the cache (0 after a preemption: recomputed)
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0  # of its output tokens, under the raw model distribution (as vLLM)
    finish_reason: str | None = None  # None while running; "stop" (EOS or a stop string), "length" or "abort"
    stop_reason: str | None = None  # the stop string or stop token id that ended it (None for EOS, as vLLM)
    text: str = ""  # the decoded output, cut before a stop string (filled when it finishes)
    # places among the scheduler's max_num_seqs: what it may fork into (n for a request's first sample
    # before it forks, the beam width shared by a search's beams), else 1
    seats: int = 1
    # drafts for the next step: not yet known tokens, scheduled after its pending token and verified then
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """Whether prompt tokens remain to compute (the first pass, or the recompute after a preemption)."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)  # by identity, as Sequence
class Request:
    """A request: its prompt, its parameters (``SamplingParams`` or ``BeamSearchParams``), its sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: object
    arrival_order: int
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served at its first admission
    forked: bool = False
    aborted: bool = False
    completed: list[tuple[list[int], float]] = field(default_factory=list)  # closed beams: (token_ids, logprob)
    beam_output: object = None  # the BeamSearchOutput, once a beam search ends
    stopper: object = None  # its generation.Stopper (None for beam search)
    generators: dict = field(default_factory=dict)  # sample index -> torch.Generator, made at its first draw

    @property
    def is_beam_search(self) -> bool:
        return hasattr(self.params, "beam_width")

    @property
    def is_finished(self) -> bool:
        return self.aborted or (bool(self.seqs) and all(s.is_finished for s in self.seqs))
