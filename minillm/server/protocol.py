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

from pydantic import BaseModel, ConfigDict

from ..sampling import SamplingParams

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
    """``POST /v1/completions``: one prompt, as text or token ids (a list of one prompt is taken too)."""

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


# field -> the values that change nothing (which pass: some clients always send them); any other is refused, naming
# the field. The first are fields of this server's requests; the others (tools, structured output, vLLM's sampling
# extensions) are unknown to it, and refused rather than ignored as other unknown fields are: a client asking for
# tool calls or JSON must not get plain text
UNSUPPORTED = {"logprobs": (None, False, 0), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
               "logit_bias": (None, {}), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
               "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
               "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
               "top_logprobs": (None, 0), "guided_json": (None,), "guided_choice": (None,), "guided_regex": (None,),
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


def completion_prompt(req: CompletionRequest, tokenizer) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of the one prompt."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: a batch of {len(prompt)} prompts is not supported; send one request per "
                                "prompt (they are batched in the engine all the same)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(400, "prompt: this model has no tokenizer; send token ids", "prompt")
        try:
            ids = tokenizer.encode(prompt)
        except ValueError as e:  # text the tokenizer cannot encode (a lone UTF-16 surrogate)
            raise APIError(400, f"prompt: {e}", "prompt") from None
        text = prompt
    else:
        ids, text = list(prompt), None
    if not ids:
        raise APIError(400, "prompt: is empty; give at least one token", "prompt")
    return text, ids


def chat_prompt(req: ChatCompletionRequest, tokenizer) -> tuple[str, list[int]]:
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
        ids = tokenizer.apply_chat_template(messages)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    return tokenizer.decode(ids), ids


def sampling_params(req: _Sampling, num_prompt_tokens: int, max_seq_len: int, pool_tokens: int) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``req``; an unset max_tokens (chat) is what the context and the
    KV pool leave after the prompt. ``pool_tokens``: num_blocks * block_size, what one sequence could
    hold with the whole pool (the engine refuses a request past it).

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


def usage(out) -> dict:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion,
            "total_tokens": len(out.prompt_token_ids) + completion}


def completion_response(rid: str, model: str, out, chat: bool) -> dict:
    """The non-streamed body of a finished ``RequestOutput``."""
    if chat:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
    else:
        choices = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(out)}


def chunk(rid: str, model: str, created: int, choices: list[dict], chat: bool, usage_: dict | None = None) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chunk_choice(index: int, text: str, finish_reason: str | None, chat: bool, first: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


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
