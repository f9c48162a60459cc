"""What the router reads off an OpenAI request's body (`POST /v1/completions`,
`/v1/chat/completions` and `/v1/embeddings`): the model it names, its token budget, whether it
streams and asks for a usage chunk, and the start of its prompt, for prefix-aware routing (an
embeddings request: its model only).

The body is already in memory (the router forwards it whole), and msgspec scans it once without
building the prompt: `prompt` and each message's `content` stay raw until the first
`prefix_chars` characters are taken from them. A body that does not decode (the replica will
answer 400) gives a request with no model, charged as if it named no budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

LLM_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # they generate tokens
EMBEDDINGS_PATH = "/v1/embeddings"
OPENAI_PATHS = LLM_PATHS | {EMBEDDINGS_PATH}
DEFAULT_MAX_TOKENS = 16  # charged when a request names no budget (the replica's default)


class _Message(msgspec.Struct):
    role: Any = ""
    content: msgspec.Raw = msgspec.Raw()  # empty: none given


class _Body(msgspec.Struct):
    model: Any = ""
    max_tokens: Any = None
    max_completion_tokens: Any = None
    stream: Any = False
    stream_options: Any = None
    prompt: msgspec.Raw = msgspec.Raw()
    messages: list[_Message] | None = None


_decode_body = msgspec.json.Decoder(_Body).decode
_decode_any = msgspec.json.Decoder().decode


@dataclass(frozen=True, slots=True)
class LLMRequest:
    model: str  # '' when the body names none (or does not decode)
    max_tokens: int | None  # the completion budget it asks for
    stream: bool
    prefix: bytes  # the model, then the prompt's (or rendered messages') first characters
    generates: bool = True  # False: an embeddings request (no completion, no prefix routing)
    asks_usage: bool = False  # it streams with `stream_options.include_usage` true

    @property
    def charge(self) -> int:
        """Tokens charged to a tokens-per-minute quota at admission: the completion budget
        (an embeddings request: none; its tokens are taken when its answer reports them)."""
        if not self.generates:
            return 0
        return self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS

    @classmethod
    def parse(cls, body: bytes, prefix_chars: int, generates: bool = True) -> LLMRequest:
        """`generates`: a completion request; False: an embeddings request."""
        try:
            decoded = _decode_body(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return cls("", None, False, b"", generates)
        model = decoded.model if isinstance(decoded.model, str) else ""
        if not generates:
            return cls(model, None, False, b"", generates=False)
        options = decoded.stream_options
        asks = isinstance(options, dict) and options.get("include_usage") is True
        budget = decoded.max_completion_tokens
        if budget is None:
            budget = decoded.max_tokens
        max_tokens = budget if isinstance(budget, int) and budget > 0 else None
        if decoded.messages is not None:
            text = _rendered(decoded.messages, prefix_chars)
        else:
            text = _text(decoded.prompt, prefix_chars)
        prefix = f"{model}\n{text[:prefix_chars]}".encode()
        stream = decoded.stream is True
        return cls(model, max_tokens, stream, prefix, asks_usage=stream and asks)


def _rendered(messages: list[_Message], limit: int) -> str:
    """`role\\ncontent\\n` for each message, until `limit` characters."""
    parts: list[str] = []
    size = 0
    for message in messages:
        part = f"{message.role}\n{_text(message.content, limit - size)}\n"
        parts.append(part)
        size += len(part)
        if size >= limit:
            break
    return "".join(parts)


def _text(raw: msgspec.Raw, limit: int) -> str:
    """A prompt's or a message content's text: a string, the text of content parts, or (token
    ids, a list of prompts) its JSON."""
    if not raw or limit <= 0:
        return ""
    try:
        value = _decode_any(raw)
    except msgspec.DecodeError:
        return ""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        return "".join(str(p.get("text", "")) for p in value)[:limit]
    return bytes(raw)[:limit].decode(errors="replace")
