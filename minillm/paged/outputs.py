"""What the engine hands back, in vLLM's names (``vllm.outputs``): ``RequestOutput`` per request and step, one
``CompletionOutput`` per sample, and the request's times (``RequestMetrics``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    """Times of a request in seconds of ``time.perf_counter`` (vLLM's ``RequestMetrics``), None until they
    happen; ``spec_decoding``: its ``spec_decode.SpecDecodingStats`` when the engine speculates, else None."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    spec_decoding: object = None

    @property
    def ttft(self) -> float | None:
        """Time to first token: first_token_time - arrival_time (s)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput``)."""

    index: int  # sample number
    text: str  # cut before a stop string
    token_ids: list[int]  # the output ids, the stop token included
    cumulative_logprob: float | None
    finish_reason: str | None = None  # None while running, "stop", "length" or "abort"
    stop_reason: str | None = None  # the stop string, or None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a request produced so far (vLLM's ``RequestOutput``)."""

    request_id: str
    prompt: str | None  # None when given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per sample, by index
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics
    beam_search_output: object = None  # a finished beam search's ``BeamSearchOutput`` (best first)
