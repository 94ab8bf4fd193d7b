"""The OpenAI API's request and response shapes, as far as the engine supports them, and their checks.

Requests are strict pydantic models (FastAPI parses and documents them): a value of the wrong JSON type is
refused, naming the field, as OpenAI refuses it, rather than coerced (``"n": true`` is not 1, ``"max_tokens":
"12"`` not 12); an integer is still a number where a float is expected. ``sampling_params`` turns one into
the engine's ``SamplingParams``, whose own checks name the field. Every refusal is an ``APIError`` with
OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``. Responses are plain dicts in OpenAI's
field names (``text_completion``, ``chat.completion``, their ``.chunk`` forms, ``usage``).
``TextStream`` cuts a streamed choice's text into deltas that never show what may still change: the
start of a stop string, or a character whose UTF-8 bytes have not all arrived.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from ..sampling_params import SamplingParams
from .logprobs import MAX_LOGPROBS, token_text

ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 500: "server_error",
               503: "service_unavailable_error"}
# SamplingParams' names for what OpenAI calls otherwise
PARAM_NAMES = {"max_new_tokens": "max_tokens", "prompt_tokens": "prompt"}


class APIError(Exception):
    """A refusal with OpenAI's error body; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def param_of(message: str) -> str | None:
    """The request field a library error names (its messages start with 'field: ...'), in OpenAI's name."""
    head = message.split(":", 1)[0].strip()
    head = PARAM_NAMES.get(head, head)
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    return head if head in fields else None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its prompt's usage so far


class _Sampling(BaseModel):
    """The fields both endpoints share. Fields OpenAI has and the engine lacks are accepted at their
    neutral value only (``UNSUPPORTED``); other unknown fields are kept aside (``model_extra``) and ignored,
    as vLLM does."""

    # strict: pydantic's loose mode would read true as 1, 1.0 as 1 and "0.5" as 0.5, and serve what the client
    # did not mean; a nested model keeps its own config, so StreamOptions and ChatMessage say strict too
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # None: OpenAI's default, 1
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False  # None (JSON null, as OpenAI allows): the default
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # vLLM's extension (benchmarks)
    stop_token_ids: list[int] | None = None  # vLLM's extension: ids that end a choice as EOS does
    user: str | None = None
    logprobs: bool | int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict | None = None
    best_of: int | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt as text or token ids, or a list of them (one choice per prompt and n)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool | None = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages through the model's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    top_logprobs: int | None = None  # alternatives per token, with logprobs: true


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # accepted; the ids are those /v1/completions gets, which adds none
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids to text."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]


# field -> the values that change nothing (which pass: some clients always send them); any other is refused, naming
# the field. The first are fields of this server's requests; the others (tools, structured output, vLLM's sampling
# extensions) are unknown to it, and refused rather than ignored as other unknown fields are: a client asking for
# tool calls or JSON must not get plain text
UNSUPPORTED = {"presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
               "logit_bias": (None, {}), "best_of": (None, 1), "suffix": (None, ""),
               "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
               "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
               "guided_json": (None,), "guided_choice": (None,), "guided_regex": (None,),
               "guided_grammar": (None,), "structured_outputs": (None,), "repetition_penalty": (None, 1, 1.0),
               "min_tokens": (None, 0), "min_p": (None, 0, 0.0)}
# stop strings per request (OpenAI allows 4) and characters per string: each is checked against the text's tail at
# every streamed chunk, on the server's event loop, so their total bounds what one request can stall the others
MAX_STOP, MAX_STOP_CHARS = 16, 1000


def brief(value, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (an error message quotes what it refuses)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_supported(req: _Sampling) -> None:
    given = {**(req.model_extra or {}), **{name: getattr(req, name) for name in type(req).model_fields}}
    for name, neutral in UNSUPPORTED.items():
        value = given.get(name)
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise APIError(400, f"{name}: not supported by minillm's server (got {brief(value)}); leave it out", name)


def completion_prompts(req: CompletionRequest, tokenizer) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of each prompt: one string or id list, or a list of them."""
    prompt = req.prompt
    if isinstance(prompt, list) and not prompt:
        raise APIError(400, "prompt: the list is empty; give a prompt (text or token ids) or a list of them", "prompt")
    batch = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]
    return [_one_prompt(p, tokenizer, f"prompt[{i}]" if len(batch) > 1 else "prompt") for i, p in enumerate(batch)]


def _one_prompt(prompt, tokenizer, name: str) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(400, f"{name}: this model has no tokenizer; send token ids", "prompt")
        try:
            # special-token text is the special token, as vLLM's Hugging Face tokenizers read a prompt (a ChatML
            # prompt written by hand, lm-eval's eos_token through /tokenize); chat content stays plain text
            ids = tokenizer.encode(prompt, allow_special=True)
        except ValueError as e:  # text the tokenizer cannot encode (a lone UTF-16 surrogate)
            raise APIError(400, f"{name}: {e}", "prompt") from None
        text = prompt
    else:
        ids, text = list(prompt), None
    if not ids:
        raise APIError(400, f"{name}: is empty; give at least one token", "prompt")
    return text, ids


@dataclass(frozen=True)
class LogprobsWanted:
    """What a request asks of log-probabilities: ``top`` alternatives per token (None: no logprobs) and ``echo``
    (a completion's prompt returned before its text, with its tokens' logprobs when ``top`` is set)."""

    top: int | None = None
    echo: bool = False


def logprobs_wanted(req: _Sampling, has_tokenizer: bool) -> LogprobsWanted:
    """Check ``logprobs``, ``top_logprobs`` and ``echo`` (limits: 0..``MAX_LOGPROBS`` alternatives; echo with
    completions only, not streamed).

    Raises:
        APIError: 400 naming the field.
    """
    chat = isinstance(req, ChatCompletionRequest)
    given = req.logprobs
    if chat:
        if given is not None and type(given) is not bool:
            raise APIError(400, f"logprobs: true or false in chat completions (got {brief(given)}); top_logprobs "
                                "gives the alternatives per token", "logprobs")
        top = req.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        if top and not given:
            raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        top = (top or 0) if given else None
        if (req.model_extra or {}).get("echo") not in (None, False):
            raise APIError(400, "echo: only /v1/completions echoes its prompt; leave it out of chat completions", "echo")
        echo = False
    else:
        if type(given) is bool and given:
            raise APIError(400, f"logprobs: the number of alternatives per token in completions, an integer in [0, "
                                f"{MAX_LOGPROBS}] (got true)", "logprobs")
        if type(given) is int and not 0 <= given <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs: at most {MAX_LOGPROBS} alternatives per token, and not negative (got "
                                f"{given})", "logprobs")
        top = given if type(given) is int else None
        echo = bool(req.echo)
        if echo and req.stream:
            raise APIError(400, "echo: not with stream: true on this server; ask for the whole response", "echo")
    if top is not None and not has_tokenizer:
        raise APIError(400, "logprobs: this model has no tokenizer to name the tokens", "logprobs")
    if echo and not has_tokenizer:
        raise APIError(400, "echo: this model has no tokenizer to write the prompt's text", "echo")
    return LogprobsWanted(top, echo)


def chat_prompt(req: ChatCompletionRequest, tokenizer, add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """(rendered text, token ids) of the conversation through the chat template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "messages: this model has no chat template; use /v1/completions", "messages")
    if not req.messages:
        raise APIError(400, "messages: is empty; give at least one message", "messages")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content or ""
        if isinstance(content, list):  # content parts: only text ones
            if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        messages.append({"role": m.role, "content": content})
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    return tokenizer.decode(ids), ids


def tokenize_response(req: TokenizeRequest, tokenizer, max_seq_len: int) -> dict:
    """vLLM's ``/tokenize`` body: ``count``, ``max_model_len``, ``tokens`` and ``token_strs`` (None unless asked):
    the ids that /v1/completions (a prompt) or /v1/chat/completions (messages) would run.

    Raises:
        APIError: 400 naming prompt or messages (neither or both given, no tokenizer, text it cannot encode).
    """
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "prompt: give a prompt (text) or messages (a chat), not both or neither", "prompt")
    if req.prompt is not None:
        _, ids = (None, []) if req.prompt == "" else _one_prompt(req.prompt, tokenizer, "prompt")
    else:
        _, ids = chat_prompt(ChatCompletionRequest(messages=req.messages), tokenizer, req.add_generation_prompt)
    strs = [token_text(tokenizer, i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_seq_len, "tokens": ids, "token_strs": strs}


def detokenize_response(req: DetokenizeRequest, tokenizer, vocab_size: int) -> dict:
    """vLLM's ``/detokenize`` body: ``{"prompt": text}``.

    Raises:
        APIError: 400 naming tokens (an id outside the vocabulary, or no tokenizer).
    """
    if tokenizer is None:
        raise APIError(400, "tokens: this model has no tokenizer", "tokens")
    bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens: {bad} is not a token id of this model (0 to {vocab_size - 1})", "tokens")
    return {"prompt": tokenizer.decode(req.tokens)}


def tokenizer_info_response(tokenizer, max_seq_len: int) -> dict:
    """vLLM's ``/tokenizer_info``: the tokenizer's special tokens, chat template and context."""
    if tokenizer is None:
        raise APIError(404, "this model has no tokenizer; send token ids")

    def special(token_id):
        return next((t for t, i in tokenizer.special_tokens.items() if i == token_id), None)

    return {"tokenizer_class": "minillm.tokenizer.Tokenizer", "eos_token": special(tokenizer.eos_id),
            "eos_token_id": tokenizer.eos_id, "bos_token": special(tokenizer.bos_id), "bos_token_id": tokenizer.bos_id,
            "pad_token": None, "chat_template": tokenizer.chat_template, "model_max_length": max_seq_len,
            "vocab_size": tokenizer.vocab_size, "add_bos_token": False, "add_eos_token": False}


def sampling_params(req: _Sampling, num_prompt_tokens: int, max_seq_len: int, pool_tokens: int,
                    echo: bool = False) -> SamplingParams | None:
    """The engine's ``SamplingParams`` for ``req``; an unset max_tokens (chat) is what the context and the
    KV pool leave after the prompt. ``pool_tokens``: num_blocks * block_size, what one sequence could
    hold with the whole pool (the engine refuses a request past it). None for max_tokens 0 with ``echo``:
    the prompt is scored, nothing is generated.

    Raises:
        APIError: 400 naming the field: an unsupported field, a sampling value out of range, a prompt or
            max_tokens beyond the context (code context_length_exceeded), or one that could never fit the
            KV pool.
    """
    check_supported(req)
    ctx_left = max_seq_len - num_prompt_tokens
    if ctx_left < 1:
        raise APIError(400, f"prompt: {num_prompt_tokens} tokens leave no room in the model's context of "
                            f"{max_seq_len} tokens; shorten the prompt", "prompt", "context_length_exceeded")
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = max(1, min(ctx_left, pool_tokens - num_prompt_tokens))
    elif max_tokens == 0 and echo:
        return None
    elif max_tokens == 0:
        raise APIError(400, "max_tokens: 0 generates nothing; it is allowed with echo: true only (scoring the "
                            "prompt); ask for at least 1 token", "max_tokens")
    elif max_tokens > ctx_left:
        raise APIError(400, f"max_tokens: {max_tokens} tokens after a {num_prompt_tokens}-token prompt exceed the "
                            f"model's context of {max_seq_len} tokens; ask for at most {ctx_left}", "max_tokens",
                       "context_length_exceeded")
    if num_prompt_tokens >= pool_tokens:
        raise APIError(400, f"prompt: {num_prompt_tokens} tokens could never fit the KV cache of {pool_tokens} tokens "
                            "with a token to generate; shorten the prompt", "prompt")
    if max_tokens >= 1 and num_prompt_tokens + max_tokens > pool_tokens:
        raise APIError(400, f"max_tokens: a {num_prompt_tokens}-token prompt and max_tokens {max_tokens} "
                            f"could never fit the KV cache of {pool_tokens} tokens; ask for at most "
                            f"{max(pool_tokens - num_prompt_tokens, 0)}", "max_tokens")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed with stream: true", "stream_options")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP or any(len(x) > MAX_STOP_CHARS for x in stop):
        raise APIError(400, f"stop: at most {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters each (got "
                            f"{len(stop)}, the longest {max(map(len, stop))} characters)", "stop")
    try:
        return SamplingParams(temperature=_default(req.temperature, 1.0), top_p=_default(req.top_p, 1.0),
                              top_k=_default(req.top_k, 0), max_tokens=max_tokens, seed=req.seed, stop=tuple(stop),
                              n=_default(req.n, 1), ignore_eos=bool(req.ignore_eos),
                              stop_token_ids=tuple(req.stop_token_ids or ()))
    except ValueError as e:
        raise APIError(400, str(e).replace("max_new_tokens", "max_tokens"), param_of(str(e))) from None


def _default(value, default):
    return default if value is None else value


# ---- responses ---------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outs) -> dict:
    """OpenAI's usage of ``RequestOutput``s (one per prompt; a prompt scored only is a (prompt ids, []) pair)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def choice(index: int, text: str, finish_reason: str | None, stop_reason, chat: bool, logprobs: dict | None) -> dict:
    """One choice of a whole (not streamed) response."""
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason, "stop_reason": stop_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def completion_response(rid: str, model: str, choices: list[dict], usage_: dict, chat: bool) -> dict:
    """The non-streamed body."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage_}


def chunk(rid: str, model: str, created: int, choices: list[dict], chat: bool, usage_: dict | None = None) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chunk_choice(index: int, text: str, finish_reason: str | None, chat: bool, first: bool = False,
                 logprobs: dict | None = None) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def safe_length(text: str, stop: tuple[str, ...]) -> int:
    """Characters of a running sequence's ``text`` that can no longer change: none from the first stop
    string on, none of a tail that may begin one, no trailing U+FFFD (a character still missing bytes)."""
    safe = len(text.rstrip("\ufffd"))
    for s in stop:
        hit = text.find(s)
        if hit >= 0:
            safe = min(safe, hit)
        else:  # the longest tail of the text that begins s
            k = next((k for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), 0)
            safe = min(safe, len(text) - k)
    return safe


class TextStream:
    """One choice's text as deltas: ``delta(text, finished)`` returns what is new and safe to send; the
    deltas add up to the finished text (the engine's, cut before a stop string)."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop, self.sent = stop, 0

    def delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else safe_length(text, self.stop)
        if end <= self.sent:
            return ""
        new, self.sent = text[self.sent:end], end
        return new
