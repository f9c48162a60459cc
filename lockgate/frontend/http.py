"""ASGI primitives: the request view, body reading with a size and a time limit, and responses.

lockgate speaks raw ASGI rather than through a framework: the per-request cost of the HTTP
layer sets the latency floor for small models.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from lockgate.errors import (
    BadRequest,
    MethodNotAllowed,
    PayloadTooLarge,
    RequestTimeout,
    ServingError,
)
from lockgate.protocol.content_coding import coding_of, compress, inflate
from lockgate.protocol.v2_codec import encode_error

if TYPE_CHECKING:
    from lockgate.frontend.otel import RequestTrace

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = b"application/json"
# a streamed answer's headers (Triton's generate_stream, and lockgate's)
EVENT_STREAM = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_json_encode = msgspec.json.Encoder().encode


class ClientDisconnected(Exception):
    """The client went away before its request was read or answered."""


class Disconnect:
    """A connection's close, told to the handlers running on it: lockgate's HTTP protocol
    puts one on each request's scope (`lockgate.disconnect`), so a handler learns of a
    disconnect without a task of its own waiting on `receive`."""

    __slots__ = ("_callbacks", "closed")

    def __init__(self) -> None:
        self.closed = False
        self._callbacks: set[Callable[[], None]] = set()

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._callbacks.add(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        self._callbacks.discard(callback)

    def close(self) -> None:
        self.closed = True
        for callback in list(self._callbacks):
            callback()


@dataclass(slots=True)
class HttpRequest:
    scope: Scope
    receive: Receive
    send: Send
    method: str
    path: str
    max_body: int
    body_timeout: float = 30.0  # seconds to receive the whole body, from the first read
    body_flag: str = "--max-body-mb"  # the flag that sets `max_body`, named in a 413
    bytes_read: int = 0  # body bytes received so far
    trace: RequestTrace | None = None  # when tracing is on and the route is traced

    @property
    def received(self) -> float:
        """When the request's first bytes were parsed (`time.monotonic()`), as the protocol
        layer stamped it; now, for a server that does not stamp it."""
        stamped = self.scope.get("lockgate.received")
        return stamped if isinstance(stamped, float) else time.monotonic()

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.scope["headers"]:
            if key == name:
                return bytes(value)
        return None

    def bearer(self) -> bytes | None:
        """The raw token of an `Authorization: Bearer` header (bytes: compared in constant
        time), or None."""
        return bearer_of(self.header(b"authorization"))

    def header_str(self, name: bytes) -> str | None:
        value = self.header(name)
        return value.decode("latin-1") if value is not None else None

    @property
    def query(self) -> dict[str, str]:
        raw = self.scope.get("query_string", b"").decode("latin-1")
        pairs = (p.partition("=") for p in raw.split("&") if p)
        return {k: v for k, _, v in pairs}

    async def body(self) -> bytes:
        """The whole body, refused with 413 past `max_body` bytes (declared or streamed), and
        decoded when it has a `Content-Encoding` (`protocol/content_coding.py`): inflated
        under the same limit, 415 for a coding lockgate does not decode."""
        coding = coding_of(self.header(b"content-encoding"))  # before any body is read
        body = await self._raw_body()
        if coding is None:
            return body
        return await inflate(body, coding, self.max_body)

    async def _raw_body(self) -> bytes:
        declared = self.header(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise BadRequest("Content-Length is not an integer") from None
            if size > self.max_body:
                raise PayloadTooLarge(
                    f"body of {size} bytes is over the limit of {self.max_body} ({self.body_flag})"
                )
        if self.scope.get("lockgate.body_complete"):  # all in already: no timer to wait on
            chunks = await self._read_chunks()
        else:
            try:
                async with asyncio.timeout(self.body_timeout):
                    chunks = await self._read_chunks()
            except TimeoutError:
                raise RequestTimeout(
                    f"request body not received within {self.body_timeout:g} s"
                ) from None
        if len(chunks) == 1:
            return chunks[0]
        return b"".join(chunks)

    async def _read_chunks(self) -> list[bytes]:
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected()
            chunk = message.get("body", b"")
            if chunk:
                total += len(chunk)
                self.bytes_read = total
                if total > self.max_body:
                    raise PayloadTooLarge(
                        f"body is over the limit of {self.max_body} bytes ({self.body_flag})"
                    )
                chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks


def bearer_of(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header's value, or None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return None
    return token.strip()


@dataclass(slots=True)
class Reply:
    """A whole response, before any transport has it: what a handler that does not stream
    answers, written by ASGI (`respond_reply`) or by the protocol's lane (`frontend/lane.py`)."""

    status: int
    body: bytes
    content_type: bytes = JSON
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


async def compressed(reply: Reply, coding: bytes | None, min_bytes: int) -> Reply:
    """`reply` with its body in `coding` when it is at least `min_bytes` (0: never) and
    compressing makes it smaller; else `reply` itself."""
    if coding is None or not min_bytes or len(reply.body) < min_bytes:
        return reply
    body = await compress(reply.body, coding)
    if len(body) >= len(reply.body):
        return reply
    headers = [*reply.headers, (b"content-encoding", coding), (b"vary", b"accept-encoding")]
    return Reply(reply.status, body, reply.content_type, headers)


class CompressingSend:
    """An ASGI send that compresses a whole answer: one body message, its length in the
    head, at least `min_bytes`, not already coded and not an event stream. The head is held
    until the body comes; anything else passes as it is."""

    __slots__ = ("coding", "held", "min_bytes", "send")

    def __init__(self, send: Send, coding: bytes, min_bytes: int) -> None:
        self.send = send
        self.coding = coding
        self.min_bytes = min_bytes
        self.held: Message | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if self._whole_and_large(message):
                self.held = message
                return
        elif self.held is not None:
            start, self.held = self.held, None
            if not message.get("more_body", False):
                start, message = await self._compressed(start, message)
            await self.send(start)
        await self.send(message)

    def _whole_and_large(self, start: Message) -> bool:
        length = -1
        for name, value in start.get("headers", ()):
            if name == b"content-length" and value.isdigit():
                length = int(value)
            elif name == b"content-encoding" or (
                name == b"content-type" and value.startswith(b"text/event-stream")
            ):
                return False
        return length >= self.min_bytes

    async def _compressed(self, start: Message, body: Message) -> tuple[Message, Message]:
        headers = [(k, v) for k, v in start.get("headers", ()) if k != b"content-length"]
        reply = Reply(start["status"], body.get("body", b""), b"", headers)
        packed = await compressed(reply, self.coding, self.min_bytes)
        if packed is reply:
            return start, body
        length = (b"content-length", b"%d" % len(packed.body))
        return {**start, "headers": [*packed.headers, length]}, {**body, "body": packed.body}


def check_method(method: str, path: str, allowed: tuple[str, ...]) -> None:
    """405, with `allowed` as its Allow header, unless the route on `path` takes `method`."""
    if method not in allowed:
        allow = ", ".join(allowed)
        raise MethodNotAllowed(f"{method[:20]} is not allowed on {path[:200]}: {allow}", allow)


async def respond_reply(send: Send, reply: Reply) -> None:
    await respond(send, reply.status, reply.body, reply.content_type, reply.headers)


def error_reply(error: ServingError) -> Reply:
    """A v2 error answer: `{"error": message}` with the error's status and headers."""
    return Reply(error.status, encode_error(error.message), JSON, error_headers(error))


async def respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    raw_headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        raw_headers.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


async def respond_json(
    send: Send, status: int, payload: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await respond(send, status, _json_encode(payload), JSON, headers)


async def send_event(send: Send, payload: dict[str, Any]) -> None:
    """One server-sent event, `data: <payload as JSON>`, of a streamed answer (after its
    `http.response.start`)."""
    body = b"data: " + _json_encode(payload) + b"\n\n"
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def answer_whole(
    send: Send,
    stream: bool,
    payload: dict[str, Any],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """One answer known in full: a JSON body, or (`stream`) a stream of one event."""
    if not stream:
        await respond_json(send, 200, payload, headers)
        return
    await send(
        {"type": "http.response.start", "status": 200, "headers": EVENT_STREAM + (headers or [])}
    )
    await send_event(send, payload)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def error_headers(error: ServingError) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in error.headers().items()]


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: HttpRequest) -> Any:
    """Cancel the current task if the client disconnects while the block runs; the block then
    ends with ClientDisconnected.

    Use after the body has been read. Told by the protocol's `Disconnect` when the scope has
    one; otherwise a task waits on `receive`, where the only message left is the disconnect.
    """
    task = asyncio.current_task()
    assert task is not None
    fired = False

    def cancel() -> None:
        nonlocal fired
        if not fired:
            fired = True
            task.cancel("client disconnected")

    disconnect = request.scope.get("lockgate.disconnect")
    watcher: asyncio.Task[None] | None = None
    if isinstance(disconnect, Disconnect):
        if disconnect.closed:
            raise ClientDisconnected()
        disconnect.subscribe(cancel)
    else:
        receive = request.receive

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not fired:
            raise
        task.uncancel()  # our own cancellation: the request ends, quietly
        raise ClientDisconnected from None
    finally:
        if watcher is not None:
            watcher.cancel()
        elif isinstance(disconnect, Disconnect):
            disconnect.unsubscribe(cancel)
