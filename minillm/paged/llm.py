"""``LLM``: vLLM's offline API over ``LLMEngine`` (Kwon et al. 2023, Sec. 5): ``generate`` is a loop over the
engine's steps. A notebook cell written for vLLM runs here by changing the import:

    from minillm import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    outputs = llm.generate(["The history of"], SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

from tqdm.auto import tqdm

from ..loading import load_model
from ..sampling_params import SamplingParams
from .beam import BeamSearchOutput, BeamSearchParams
from .config import check_engine_args
from .engine import LLMEngine
from .outputs import RequestOutput
from .trace import check_trace_path


class LLM:
    """An engine with its model (vLLM's ``LLM``).

    Args:
        model: None (the embedded SmolLM2-135M-Instruct), a path ``load_model`` takes, or a loaded
            ``minillm.model.Decoder`` (then pass its ``tokenizer``, or None for token-id prompts).
        block_size ... max_num_batched_tokens, **engine_kwargs: as ``LLMEngine`` (``trace=PATH`` writes the
            engine's steps, one JSON line each: docs/trace.md).
        disable_log_stats: no counters or step records (``llm_engine.stats`` is None), as vLLM's ``LLM``; False
            keeps them (``EngineStats``: steps, preemptions, prefix hits, blocks in use per step).
        dtype, device, fast, n_shards: how ``load_model`` loads a path (ignored for a loaded model): ``fast=False``
            serves the plain model (the library's torch only, the "blockwise" read).

    ``generate``, ``chat`` and ``beam_search`` own the requests they add: an interrupt or error aborts them,
    and they refuse to run while the engine holds requests added through ``llm_engine.add_request``. One
    thread at a time: a call from another thread while one runs raises ``RuntimeError``.

    Raises:
        ValueError / ModelFileError: from ``check_engine_args`` (before loading), ``load_model`` and ``LLMEngine``.
    """

    def __init__(self, model=None, *, tokenizer=None, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: float | None = None, enable_prefix_caching: bool = True, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 256, disable_log_stats: bool = True, dtype="float32",
                 device="cpu", fast: bool = True, n_shards: int | None = None, **engine_kwargs):
        check_engine_args(block_size, num_blocks, kv_cache_bytes, max_num_seqs, max_num_batched_tokens,
                          engine_kwargs.get("max_seq_len"))
        if engine_kwargs.get("trace") is not None:
            check_trace_path(engine_kwargs["trace"])  # before loading: a bad path costs nothing
        if model is None or isinstance(model, (str, Path)):
            model, tokenizer = load_model(model, dtype=dtype, device=device, fast=fast, n_shards=n_shards)
        self.model, self.tokenizer = model, tokenizer
        self.llm_engine = LLMEngine(model, tokenizer, block_size=block_size, num_blocks=num_blocks,
                                    kv_cache_bytes=kv_cache_bytes, enable_prefix_caching=enable_prefix_caching,
                                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                    log_stats=not disable_log_stats, **engine_kwargs)
        # ids of the form "<this LLM>-<n>": never equal to an id a caller picks for llm_engine.add_request
        self._ids = (f"llm-{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (a string, ``{"prompt_token_ids": [...]}``, or a list of them) with one
        ``SamplingParams`` or one per prompt; returns the finished ``RequestOutput``s in the prompts' order.

        Raises:
            ValueError: a params list of another length than the prompts, or an invalid request (``add_request``);
                no request of the call then runs.
        """
        return self._run(self._as_list(prompts), sampling_params or SamplingParams(), use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """``generate`` on conversations through the model's chat template: one conversation
        ([{"role", "content"}, ...]) or a list of them.

        Raises:
            ValueError: no tokenizer or chat template, a malformed message (``Tokenizer.apply_chat_template``).
        """
        if self.tokenizer is None:
            raise ValueError("chat: needs a tokenizer with a chat template; pass tokenizer= to LLM")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            ids = self.tokenizer.apply_chat_template(conv)
            prompts.append({"prompt_token_ids": ids, "prompt": self.tokenizer.decode(ids)})
        return self._run(prompts, sampling_params or SamplingParams(), use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt; a prompt's beams share blocks in the engine. Returns one
        ``BeamSearchOutput`` per prompt (best first)."""
        prompts = self._as_list(prompts)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: beam_search takes BeamSearchParams, got {type(params).__name__}")
        return [out.beam_search_output for out in self._run(prompts, [params] * len(prompts), use_tqdm)]

    # ---- internals -----------------------------------------------------------------------------
    @staticmethod
    def _as_list(prompts) -> list:
        return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)

    def _run(self, prompts: list, params, use_tqdm: bool) -> list[RequestOutput]:
        """Add the call's requests, step until they finish, return their outputs in order; whatever
        interrupts it aborts them (and only them)."""
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} params for {len(prompts)} prompts; give one, or one "
                             "per prompt")
        engine = self.llm_engine
        with engine.driving():
            if engine.has_unfinished_requests():
                raise RuntimeError(f"LLM.generate: the engine holds {engine.get_num_unfinished_requests()} requests "
                                   "added through llm_engine.add_request (or their outputs, not yet returned by "
                                   "step); generate would run them and drop their outputs, so step them to the end "
                                   "with llm_engine.step() or abort them first")
            ids, finished = [], {}
            try:
                for prompt, p in zip(prompts, params):
                    ids.append(next(self._ids))
                    engine.add_request(ids[-1], prompt, p)
                wanted = set(ids)
                with tqdm(total=len(ids), desc="requests", disable=not use_tqdm) as bar:
                    while len(finished) < len(ids):
                        for out in engine.step():
                            if out.finished and out.request_id in wanted:
                                finished[out.request_id] = out
                                bar.update(1)
            except BaseException:
                engine.abort_request(ids)
                raise
        return [finished[i] for i in ids]
