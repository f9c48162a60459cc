"""OpenAI API wire format: request schemas (msgspec) and response and stream-chunk builders.

Unknown request fields are ignored, as OpenAI does; fields of the wrong type are a 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from lockgate.errors import BadRequest


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    priority: int = 0  # 1 is the highest; 0: the model's default (as lockgate's v2 priority)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    # known to the OpenAI API, not implemented by lockgate: refused by name when given
    best_of: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    suffix: Any = None
    parallel_tool_calls: Any = None

    def unsupported(self) -> str | None:
        """The first field given that lockgate does not implement, if any."""
        for name in UNSUPPORTED:
            value = getattr(self, name)
            if value is None:
                continue
            if name == "best_of" and value == 1:
                continue
            if (
                name == "response_format"
                and isinstance(value, dict)
                and value.get("type") == "text"
            ):
                continue
            return name
        return None


UNSUPPORTED = (
    "best_of",
    "response_format",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "suffix",
    "parallel_tool_calls",
)


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any  # a string, token ids, or a list of one of those; checked by the route
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[str]
    model: str = ""
    encoding_format: str = "float"
    user: str | None = None


_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def decode(body: bytes, kind: Any) -> Any:
    """`body` decoded as `kind` (a Struct, or any type msgspec knows); BadRequest (400) when it
    is not JSON of that shape."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None


def message_text(message: ChatMessage) -> str:
    """A message's text; content parts of type text are joined, other parts refused."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest("only text content parts are supported")
        texts.append(part["text"])
    return "".join(texts)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _envelope(rid: str, model: str, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def completion_response(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    logprobs: Any,
    usage_: dict[str, Any],
) -> dict[str, Any]:
    return {**completion_chunk(rid, model, text, finish_reason, logprobs), "usage": usage_}


def completion_chunk(
    rid: str, model: str, text: str, finish_reason: str | None, logprobs: Any = None
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(rid, model, "text_completion", [choice])


def chat_response(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    logprobs: Any,
    usage_: dict[str, Any],
) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_envelope(rid, model, "chat.completion", [choice]), "usage": usage_}


def chat_chunk(
    rid: str, model: str, delta: dict[str, Any], finish_reason: str | None, logprobs: Any = None
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(rid, model, "chat.completion.chunk", [choice])


def usage_chunk(rid: str, model: str, obj: str, usage_: dict[str, Any]) -> dict[str, Any]:
    return {**_envelope(rid, model, obj, []), "usage": usage_}


def error_body(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
