"""The tokens an OpenAI answer used, prompt and completion, read as the answer passes to the
client: the `usage` it reports (a whole answer, or a stream's usage chunk), else, for a stream
cut short before its usage chunk, one completion token per chunk with choices (the replica sends
one chunk per generated token). What settles a token quota (`rate_limits.py`).

A stream whose client did not ask for a usage chunk is sent on asking for one
(`stream_options.include_usage`, `asking_usage`), and that chunk is taken out of what the client
gets (`HiddenUsage`), so the client's stream is the one it asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from lockgate.router.llm_request import LLMRequest
from lockgate.router.upstream import Response


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0  # none for embeddings


class _Answer(msgspec.Struct):
    choices: list[msgspec.Raw] = []
    usage: _Usage | None = None


_decode = msgspec.json.Decoder(_Answer).decode
_decode_any = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class Metered:
    """A request under a token quota: its charge, the body sent for it, the meter its answer
    passes, and the usage chunks to take out of its stream (None: none)."""

    charge: int
    body: bytes
    meter: UsageMeter
    hidden: HiddenUsage | None = None

    @classmethod
    def of(cls, request: LLMRequest, body: bytes) -> Metered:
        metered = cls(request.charge, body, UsageMeter(request.stream))
        if request.stream and not request.asks_usage:
            asked = asking_usage(body)
            if asked is not None:  # the usage chunk counts the prompt: ask for it, hide it
                metered.body, metered.hidden = asked, HiddenUsage()
        return metered


class UsageMeter:
    def __init__(self, stream: bool, max_bytes: int = 2**20) -> None:
        self.stream = stream
        self.max_bytes = max_bytes  # a whole answer, or one line of a stream, kept at most
        self.status = 0  # 0: no answer from a replica
        self.buffer = bytearray()
        self.chunks = 0  # streamed chunks with choices
        self.reported: int | None = None
        self.overflow = False

    def head(self, response: Response) -> None:
        self.status = response.status

    def feed(self, chunk: bytes) -> None:
        if self.status != 200 or self.overflow:
            return
        self.buffer += chunk
        if self.stream:
            *lines, rest = self.buffer.split(b"\n")
            self.buffer = bytearray(rest)
            for line in lines:
                if line.startswith(b"data: {"):
                    self._event(bytes(line[6:]))
        if len(self.buffer) > self.max_bytes:
            self.overflow = True
            self.buffer = bytearray()

    def end(self) -> None:
        if not self.stream and self.status == 200 and not self.overflow:
            self._event(bytes(self.buffer))

    def used(self) -> int | None:
        """Prompt and completion tokens used; None: unknown (a whole answer without a readable
        usage)."""
        if self.status != 200:
            return 0
        if self.reported is not None:
            return self.reported
        return self.chunks if self.stream else None

    def _event(self, data: bytes) -> None:
        try:
            answer = _decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if answer.usage is not None:
            self.reported = answer.usage.prompt_tokens + answer.usage.completion_tokens
        elif answer.choices:
            self.chunks += 1


def asking_usage(body: bytes) -> bytes | None:
    """A streamed completion's body with `stream_options.include_usage` set; None when it is not
    a JSON object with an object or nothing as `stream_options` (the replica answers it 400)."""
    try:
        value: Any = _decode_any(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(value, dict):
        return None
    options = value.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return None
    value["stream_options"] = {**(options or {}), "include_usage": True}
    return _encode(value)


class HiddenUsage:
    """A stream's server-sent events, less its usage chunks (`"choices": []` and a `usage`):
    what a client gets that did not ask for them. Whole events are passed on as they complete;
    bytes that end no event wait for the rest (past `max_bytes`, they go on as they are)."""

    def __init__(self, max_bytes: int = 2**20) -> None:
        self.max_bytes = max_bytes
        self.buffer = bytearray()

    def edit(self, chunk: bytes) -> bytes:
        """What of the stream so far goes on to the client now."""
        self.buffer += chunk
        end = self.buffer.rfind(b"\n\n")
        if end < 0:
            return self.rest() if len(self.buffer) > self.max_bytes else b""
        whole = bytes(self.buffer[: end + 2])
        del self.buffer[: end + 2]
        if b'"usage"' not in whole:
            return whole
        events = whole.split(b"\n\n")[:-1]
        return b"".join(e + b"\n\n" for e in events if not _usage_chunk(e))

    def rest(self) -> bytes:
        """The bytes held back when the stream ends."""
        rest = bytes(self.buffer)
        self.buffer.clear()
        return rest


def _usage_chunk(event: bytes) -> bool:
    if not event.startswith(b"data: {"):
        return False
    try:
        answer = _decode(event[6:])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return answer.usage is not None and not answer.choices
