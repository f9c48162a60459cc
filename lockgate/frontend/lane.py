"""The lane: v2 inference requests answered from the HTTP protocol itself, below ASGI.

A `POST /v2/models/{m}[/versions/{v}]/infer` whose head arrives whole in one read, at a
message boundary, and which the connection gate and its model's admission let through on
arrival (`server._Protocol._arrival`, which has already split its head), is not handed to
the HTTP parser and the ASGI app. Its body is gathered as it comes (within the body
timeout, up to the body limit), then it runs as one task: `App.infer_lane` decodes, runs and
encodes it with the ASGI route's own core (`v2_routes.infer_reply`), and the protocol writes
the answer in one write. That skips the second parse of the head, the ASGI scope, the
receive and send messages, uvicorn's response path and the disconnect subscription, which
cost more than the model on a small one (see "Operating under load" in the README).

The answers are the same as the ASGI path's: status, body, headers, metrics, deadlines,
admission, authentication and priority keys. Bytes a client sends while its request runs
here wait, unread, for its answer (answers leave in order); a disconnect cancels the
request. Chunked bodies, compressed bodies (`Content-Encoding`), `Expect`, HTTP/1.0,
encoded paths, heads split over reads, and every request while the access log or tracing
is on, take the ASGI path.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from http import HTTPStatus

from lockgate.frontend.http import Reply


@dataclass(slots=True)
class LaneRequest:
    """A v2 inference request as split on arrival; `body` is set once it is all in."""

    name: str  # the model
    version: str | None  # from /versions/{v}/, else None
    path: str
    headers: list[tuple[bytes, bytes]]  # names in lower case
    body: bytes
    received: float  # time.monotonic() of its first byte
    keep_alive: bool
    started: bool = False  # its task has begun (`core.batcher.Arriving`)

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(slots=True)
class BodiesArriving:
    """Requests of a whole server let through and still receiving their body.

    `count`, the lane's: with the running tasks, the requests in progress the connection gate
    caps. `asgi`, those whose ASGI task has started (they are among the tasks already). Both
    wait on their client, not on the event loop: a request let through now waits for the
    loop's work of the others alone, so a client holding bodies half sent does not make every
    arrival look late to admission."""

    count: int = 0
    asgi: int = 0


@dataclass(slots=True)
class Lane:
    """One connection's lane: the request whose body is still arriving, or the one running
    (one at a time), and what the client sent meanwhile, read again once it is answered."""

    task: asyncio.Task[None] | None = None
    held: bytearray = field(default_factory=bytearray)
    closing: bool = False  # the server is shutting down: close once the answer is out
    waiting: LaneRequest | None = None  # its head is in, its body still arriving
    body: bytearray = field(default_factory=bytearray)
    length: int = 0  # the waiting request's Content-Length
    body_timer: asyncio.TimerHandle | None = None

    def wait_for_body(self, request: LaneRequest, length: int, first: bytes) -> None:
        self.waiting, self.length = request, length
        self.body[:] = first

    def feed(self, data: bytes) -> tuple[LaneRequest | None, bytes]:
        """Body bytes of the waiting request: (that request, once its body is whole, and the
        bytes after it), or (None, b"") while more is to come."""
        assert self.waiting is not None
        self.body += data
        if len(self.body) < self.length:
            return None, b""
        request, rest = self.waiting, bytes(self.body[self.length :])
        request.body = bytes(self.body[: self.length])
        self.waiting = None
        self.body.clear()
        return request, rest

    def take_held(self) -> bytes:
        held = bytes(self.held)
        self.held.clear()
        return held


def lane_target(path: str) -> tuple[str, str | None] | None:
    """(model, version or None) when `path` is a v2 inference path, else None."""
    if not path.startswith("/v2/models/") or not path.endswith("/infer"):
        return None
    parts = path.split("/")  # "", "v2", "models", name, ["versions", v,] "infer"
    if len(parts) == 5 and parts[3]:
        return parts[3], None
    if len(parts) == 7 and parts[3] and parts[4] == "versions":
        return parts[3], parts[5]
    return None


def reply_bytes(
    reply: Reply, default_headers: list[tuple[bytes, bytes]], keep_alive: bool
) -> bytes:
    """The whole HTTP/1.1 answer, head and body, as uvicorn writes an ASGI one: the status
    line, the server's default headers (date, server), then the reply's own."""
    parts = [_STATUS_LINES.get(reply.status) or _status_line(reply.status)]
    for name, value in default_headers:
        parts += [name, b": ", value, b"\r\n"]
    parts += [
        b"content-type: ",
        reply.content_type,
        b"\r\ncontent-length: %d\r\n" % len(reply.body),
    ]
    for name, value in reply.headers:
        parts += [name, b": ", value, b"\r\n"]
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts += [b"\r\n", reply.body]
    return b"".join(parts)


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES = {s.value: _status_line(s.value) for s in HTTPStatus}
