"""HTTP/1.1 to one replica: a pool of kept-alive connections, parsed by httptools.

The router's own client, not a general one: requests carry their whole body, responses
come back as a head and then body chunks as they arrive (server-sent events pass through
as they are written). A connection goes back to the pool when its response has ended and
both ends keep it alive; a request whose caller gives up (a hedge that lost, a client that
left) aborts its connection, so the replica sees the disconnect and drops the work.

A request sent on a reused connection that the replica had already closed (its idle
timeout) fails before any byte of an answer: it is sent again once on a new connection,
which cannot run it twice.

The router's lane (`lane.py`) sends on an idle connection with `send_lane` and is told of the
whole answer at once (`Listener`), read by a parser of its own that makes no call per header
line (`lane_answer.py`): its raw bytes, to pass on as they came, and what the router reads of
its head.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import httptools

from lockgate.router.lane_answer import BadAnswer, LaneAnswer, LaneReader

# headers that describe one connection, not the message: never forwarded
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",  # the body goes with the head; a 100 Continue would pass for the answer
    }
)


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}  # with their \r\n


class UpstreamError(Exception):
    """The replica could not be reached, or its connection broke before the answer ended;
    `sent`: the request may have reached the replica (False: it could not be connected)."""

    def __init__(self, message: str, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


class Listener(Protocol):
    """Told of a lane request's answer (`Upstream.send_lane`)."""

    def answered(self, answer: LaneAnswer) -> None:
        """The whole answer."""

    def broke(self, answered_nothing: bool) -> None:
        """The connection broke (or the answer was not HTTP) before the answer ended;
        `answered_nothing`: not a byte of it had come."""


@dataclass(slots=True)
class Response:
    """An answer whose head has arrived; its body arrives in `parts` (None ends it, an
    exception breaks it off). A deque and one future, not an `asyncio.Queue`: each answer
    makes one, and a queue's getters, putters and locks are more than one reader needs."""

    status: int
    headers: list[tuple[bytes, bytes]]
    connection: _Connection | None = None
    parts: deque[bytes | Exception | None] = field(default_factory=deque)
    waiter: asyncio.Future[None] | None = None  # the reader, waiting for the next part

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def put(self, part: bytes | Exception | None) -> None:
        """The next part of the body (None: the end; an exception: the connection broke)."""
        self.parts.append(part)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    @property
    def waiting(self) -> bool:
        """Nothing of the body is here to read: the next read waits for the replica."""
        return not self.parts

    @property
    def at_hand(self) -> bool:
        """The body's next part is here, and it is not a broken connection."""
        return bool(self.parts) and not isinstance(self.parts[0], Exception)

    @property
    def ending(self) -> bool:
        """The next part is the end: the body has all been read."""
        return len(self.parts) == 1 and self.parts[0] is None

    async def next(self) -> bytes | None:
        """The body's next chunk as it arrives, None at its end; UpstreamError if the
        connection breaks first."""
        while not self.parts:
            waiter = self.waiter = asyncio.get_running_loop().create_future()
            await waiter
        part = self.parts.popleft()
        if isinstance(part, Exception):
            raise part
        return part

    async def body(self) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive; UpstreamError if the connection breaks first."""
        while (chunk := await self.next()) is not None:
            yield chunk

    async def read(self) -> bytes:
        parts: list[bytes] = []
        while (chunk := await self.next()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def abort(self) -> None:
        """Give up on the rest of the body: the connection closes."""
        if self.connection is not None:
            self.connection.abort()


class _Connection(asyncio.Protocol):
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.head: asyncio.Future[Response] | None = None
        self.response: Response | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.received = 0  # bytes of the current answer
        self.closed = False
        self.listener: Listener | None = None  # a lane request's, told of the whole answer
        self.reader: LaneReader | None = None  # reads the lane's answers (made at first use)

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.listener is not None and self.reader is not None:  # a lane request's answer
            try:
                answer = self.reader.feed(data)
            except BadAnswer as exc:
                self._fail(UpstreamError(f"bad response from {self.upstream.name}: {exc}"))
                self.abort()
                return
            if answer is not None:
                self._lane_answered(answer)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"bad response from {self.upstream.name}: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.upstream.forget(self)
        self._fail(UpstreamError(f"{self.upstream.name} closed the connection"))

    # -- httptools callbacks -----------------------------------------------------------
    def on_message_begin(self) -> None:
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.response = Response(self.parser.get_status_code(), self.headers, connection=self)
        if self.head is not None and not self.head.done():
            self.head.set_result(self.response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response.put(body)

    def on_message_complete(self) -> None:
        response, self.response, self.head = self.response, None, None
        if response is not None:
            response.put(None)
            response.connection = None
        if self.parser.should_keep_alive() and not self.closed:
            self.upstream.release(self)
        else:
            self.abort()

    def _lane_answered(self, answer: LaneAnswer) -> None:
        listener, self.listener = self.listener, None
        if answer.keep_alive and not self.closed:
            self.upstream.release(self)
        else:
            self.abort()
        assert listener is not None
        listener.answered(answer)

    # -- use -------------------------------------------------------------------------------
    def send(self, request: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        self.received = 0
        self.head = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.head

    def send_lane(self, request: bytes, listener: Listener) -> None:
        assert self.transport is not None
        self.received = 0
        self.listener = listener
        if self.reader is None:
            self.reader = LaneReader()
        self.transport.write(request)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self.upstream.forget(self)

    def _fail(self, error: UpstreamError) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            if self.reader is not None:
                self.reader.clear()
            listener.broke(not self.received)
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        if self.response is not None:
            self.response.put(error)
        self.head = self.response = None


class Upstream:
    """Connections to one replica at `host:port`."""

    def __init__(self, host: str, port: int, max_idle: int = 256) -> None:
        self.host, self.port = host, port
        self.name = f"{host}:{port}"
        self.max_idle = max_idle
        self.idle: list[_Connection] = []
        self.busy: set[_Connection] = set()

    async def request(
        self,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        connect_timeout: float = 2.0,
    ) -> Response:
        """Send a request; the answer once its head arrives. UpstreamError when the replica
        cannot be reached or the connection breaks first."""
        message = encode(method, path, self.name, headers, body)
        reused = bool(self.idle)
        connection = self.idle.pop() if reused else await self._connect(connect_timeout)
        try:
            return await self._send(connection, message)
        except UpstreamError:
            if not reused or connection.received:
                raise
        # the replica had closed the idle connection: once more, on a new one
        return await self._send(await self._connect(connect_timeout), message)

    def send_lane(self, message: bytes, listener: Listener) -> _Connection | None:
        """Send on an idle connection, telling `listener` of the answer; None (nothing sent)
        when no connection is idle. The connection returned is the one to `abort`."""
        if not self.idle:
            return None
        connection = self.idle.pop()
        self.busy.add(connection)
        connection.send_lane(message, listener)
        return connection

    async def _send(self, connection: _Connection, message: bytes) -> Response:
        self.busy.add(connection)
        try:
            return await connection.send(message)
        except BaseException:
            connection.abort()
            raise

    async def _connect(self, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port
                )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {self.name}: {exc}", sent=False) from exc
        return connection

    def release(self, connection: _Connection) -> None:
        self.busy.discard(connection)
        if len(self.idle) < self.max_idle:
            self.idle.append(connection)
        else:
            connection.abort()

    def forget(self, connection: _Connection) -> None:
        self.busy.discard(connection)
        with contextlib.suppress(ValueError):
            self.idle.remove(connection)

    def close(self) -> None:
        for connection in [*self.idle, *self.busy]:
            connection.abort()


def encode(
    method: str, path: str, host: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"host: " + host.encode()]
    lines += [name + b": " + value for name, value in headers if name not in HOP_BY_HOP]
    lines.append(b"content-length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body
