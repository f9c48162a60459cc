"""The completion tokens an OpenAI answer used, read as the answer passes to the client: the
`usage` it reports (a whole answer, or a stream's usage chunk), else, for a stream, one token per
chunk with choices (the replica sends one chunk per generated token). What settles a token
quota (`rate_limits.py`)."""

from __future__ import annotations

import msgspec

from lockgate.router.upstream import Response


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Answer(msgspec.Struct):
    choices: list[msgspec.Raw] = []
    usage: _Usage | None = None


_decode = msgspec.json.Decoder(_Answer).decode


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
        """Completion tokens used; None: unknown (a whole answer without a readable usage)."""
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
            self.reported = answer.usage.completion_tokens
        elif answer.choices:
            self.chunks += 1
