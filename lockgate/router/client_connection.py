"""One client's HTTP/1.1 connection to the router, parsed by httptools, each request run by the
router's ASGI app: uvicorn's protocol cut to what the router needs, since a proxy hop's own
work is small and uvicorn's general machinery was a large share of its cost.

It keeps what uvicorn gives the router: keep-alive (closed after `timeout_keep_alive` idle
seconds, or at once on `Connection: close` and HTTP/1.0 without keep-alive), pipelined
requests answered in order (reading pauses until the answer in progress ends), `Expect:
100-continue`, a body passed on as it arrives (reading pauses past 64 KiB not yet taken),
writes that wait while the client does not read, `http.disconnect` when the client leaves,
400 on a request the parser rejects, 500 when the app fails before answering, and uvicorn's
graceful shutdown (`shutdown`, the server's table of connections and tasks).

A KServe v2 inference POST whose head arrives whole, at a message boundary, is offered, once
its body has come, to the app's lane first (`lane.py`, `RouterApp.lane`): taken there, it
never reaches the parser, and bytes the client sends meanwhile wait, unread, for its answer;
an attempt there that ends without an answer to pass on comes back as an ordinary request of
this connection (`lane_failed`), its body whole.

Answers carry uvicorn's default headers (`date`, `server`) unless they bring their own (a
replica's answer does: each header is sent once), and are framed as uvicorn frames
them: by their `content-length`, else chunked. An answer's head written with `HOLD` waits for
the body's first bytes, which the app sends next: both leave in one write (one send on the
socket, one wake-up of the client, not two). Its headers are checked with two searches in all:
they are a replica's, which httptools parsed, or the router's own.
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import httptools

from lockgate.router.lane import LANE_SCOPE, LaneCall
from lockgate.router.lane_head import LaneHead, LaneHeads
from lockgate.router.upstream import STATUS_LINES

log = logging.getLogger("lockgate.router")

Message = MutableMapping[str, Any]
App = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]

# in an `http.response.start`: the body's first bytes follow at once, and the head may be
# written with them (one write, not two); a server that does not know the key ignores it
HOLD = "lockgate.hold"
HIGH_WATER = 64 * 1024  # body bytes held for the app before reading pauses
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection", b"date", b"server"})


@dataclass(slots=True)
class _DefaultHead:
    """uvicorn's default headers (`date`, `server`) as head lines, made again when uvicorn
    makes a new list of them (when the date changes, once a second)."""

    headers: list[tuple[bytes, bytes]] | None = None
    lines: bytes = b""

    def of(self, headers: list[tuple[bytes, bytes]]) -> bytes:
        if headers is not self.headers:
            self.headers = headers
            self.lines = b"".join([b"%s: %s\r\n" % header for header in headers])
        return self.lines


_DEFAULT_HEAD = _DefaultHead()


class ClientConnection(asyncio.Protocol):
    """Made by uvicorn's server for each connection (`uvicorn.Config(http=...)`)."""

    def __init__(self, config: Any, server_state: Any, app_state: Any, _loop: Any = None) -> None:
        self.app: App = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.state = server_state  # its `connections`, `tasks` and `default_headers`
        self.keep_alive_timeout: float = config.timeout_keep_alive
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_continue = False
        self.exchange: _Exchange | None = None  # the request being answered
        self.waiting: deque[_Exchange] = deque()  # pipelined requests, in order
        # closes the connection once it has been idle `keep_alive_timeout` seconds: armed once,
        # and when it fires early (the connection was busy meanwhile) set again for the rest
        self.idle_timer: asyncio.TimerHandle | None = None
        self.idle_since: float | None = None  # loop time it went idle; None: busy
        self.read_paused = False
        self.write_paused = False
        self.drained: asyncio.Future[None] | None = None
        # RouterApp.lane and the heads it takes, if the app has a lane
        self.lane_app = getattr(self.app, "lane", None)
        self.lane_heads: LaneHeads | None = getattr(self.app, "lane_heads", None)
        self.between = True  # the parser is between messages: a new head starts here
        self.lane: LaneCall | None = None  # the request on the lane now
        self.pending: LaneHead | None = None  # a lane request whose body is still arriving
        self.held = bytearray()  # its bytes so far; or what came while the lane had one
        self.closing = False  # the server is stopping: close once the lane's answer is out

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.state.connections.add(self)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.connections.discard(self)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if self.lane is not None:
            self.lane.cancel()
            self.lane = None
        for exchange in (self.exchange, *self.waiting):
            if exchange is not None:
                exchange.disconnected = True
                exchange.wake()
        self.waiting.clear()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.write_paused = False

    def data_received(self, data: bytes) -> None:
        self.idle_since = None  # busy: the idle timer, when it fires, waits for it to go idle
        if self.lane is not None:  # answers leave in order: this waits for the lane's
            self.held += data
            self._pause_reading()
            return
        if self.pending is not None:  # the rest of a lane request's body
            self.held += data
            if len(self.held) < self.pending.size:
                self._arm_idle_timer()
                return
            pending, data, self.pending = self.pending, bytes(self.held), None
            self.held.clear()
            self._offer(pending, data)
            return
        if (
            self.between
            and self.exchange is None
            and data[:5] == b"POST "
            and self.lane_heads is not None
            and (head := self.lane_heads.of(data)) is not None
        ):
            if len(data) >= head.size:
                self._offer(head, data)
                return
            if head.length <= HIGH_WATER:  # its body is still to come (most clients send it
                self.pending = head  # in a write of its own)
                self.held += data
                self._arm_idle_timer()
                return
        self._feed(data)

    def _offer(self, head: LaneHead, data: bytes) -> None:
        """The request `head` starts `data`, its body all in: to the lane, or the parser."""
        assert self.lane_app is not None
        call = self.lane_app(self, head, data[: head.size])
        if call is None:
            self._feed(data)
            return
        self.lane = call
        if len(data) > head.size:
            self.held += data[head.size :]
            self._pause_reading()

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no upgrade is served: the request was taken as a plain one
        except httptools.HttpParserError:
            self._bad_request()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    async def drain(self) -> None:
        if self.drained is None:
            self.drained = self.loop.create_future()
        await self.drained

    # -- the lane ------------------------------------------------------------------------------
    def lane_answered(self, data: bytes) -> None:
        """The lane's request is answered: `data` goes to the client whole."""
        self.lane = None
        self.state.total_requests += 1
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(data)
        if self.closing:
            transport.close()
        elif self.held or self.read_paused:
            self._next_after_lane()
        else:  # idle: the keep-alive timer counts from now (`_arm_idle_timer`)
            self.idle_since = self.loop.time()
            if self.idle_timer is None:
                self.idle_timer = self.loop.call_later(self.keep_alive_timeout, self._idle)

    def lane_failed(self, call: LaneCall) -> None:
        """The lane's attempt gave no answer to pass on: the request goes on along the app's
        path, as if it had been parsed here."""
        self.lane = None
        if self.transport.is_closing():
            return
        scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": "http",
            "method": "POST",
            "root_path": "",
            "path": call.path,
            "raw_path": call.path.encode("ascii"),
            "query_string": b"",
            "headers": call.headers,
            LANE_SCOPE: call,
        }
        exchange = _Exchange(self, scope, not self.closing, False)
        exchange.body.append(call.body)
        exchange.more_body = False
        self.exchange = exchange
        self._start(exchange)
        self._next_after_lane()

    def _next_after_lane(self) -> None:
        """Read on: what the client sent while the lane had its request, then the socket."""
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        if self.held:
            held = bytes(self.held)
            self.held.clear()
            self.data_received(held)
        elif self.exchange is None:
            self._arm_idle_timer()

    def _arm_idle_timer(self) -> None:
        self.idle_since = self.loop.time()
        if self.idle_timer is None:
            self.idle_timer = self.loop.call_later(self.keep_alive_timeout, self._idle)

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.between = False
        self.url = b""
        self.headers = []
        self.expect_continue = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        url = httptools.parse_url(self.url)
        raw_path = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": parser.get_http_version(),
            "server": self.server,
            "client": self.client,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": url.query or b"",
            "headers": self.headers,
        }
        keep_alive = scope["http_version"] != "1.0" and parser.should_keep_alive()
        exchange = _Exchange(self, scope, keep_alive, self.expect_continue)
        if self.exchange is None:
            self.exchange = exchange
            self._start(exchange)
        else:  # pipelined behind the one being answered: read no more until that ends
            self.waiting.append(exchange)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        exchange = self.waiting[-1] if self.waiting else self.exchange
        if exchange is None or exchange.complete:
            return  # answered already: the rest of its body is dropped
        exchange.body.append(body)
        exchange.buffered += len(body)
        if exchange.buffered > HIGH_WATER:
            self._pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        self.between = True
        exchange = self.waiting[-1] if self.waiting else self.exchange
        if exchange is None or exchange.complete:
            return
        exchange.more_body = False
        exchange.wake()

    # -- requests --------------------------------------------------------------------------
    def _start(self, exchange: _Exchange) -> None:
        task = self.loop.create_task(exchange.run(self.app))
        task.add_done_callback(self.state.tasks.discard)
        self.state.tasks.add(task)

    def answered(self, exchange: _Exchange) -> None:
        """`exchange`'s answer has ended: the next pipelined request, or wait for one."""
        self.state.total_requests += 1
        self.exchange = None
        if not exchange.keep_alive:
            self.transport.close()
            return
        if self.transport.is_closing():
            return
        self._resume_reading()
        if self.waiting:
            self.exchange = self.waiting.popleft()
            self._start(self.exchange)
        else:
            self._arm_idle_timer()

    def shutdown(self) -> None:
        """The server is stopping: close now if idle, else once the answer has ended."""
        if self.lane is not None:
            self.closing = True
            return
        if self.exchange is None or self.exchange.complete:
            self.transport.close()
        else:
            self.exchange.keep_alive = False

    def _idle(self) -> None:
        self.idle_timer = None
        if self.idle_since is None:  # busy: armed again when it next goes idle
            return
        left = self.idle_since + self.keep_alive_timeout - self.loop.time()
        if left > 0:  # it was busy meanwhile
            self.idle_timer = self.loop.call_later(left, self._idle)
        elif not self.transport.is_closing():
            self.transport.close()

    def _pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    def _bad_request(self) -> None:
        body = b"Invalid HTTP request received."
        head = [STATUS_LINES[400]]
        head += [name + b": " + value + b"\r\n" for name, value in self.state.default_headers]
        head.append(b"content-type: text/plain; charset=utf-8\r\n")
        head.append(b"content-length: %d\r\n" % len(body))
        head.append(b"connection: close\r\n\r\n")
        self.transport.write(b"".join(head) + body)
        self.transport.close()


class _Exchange:
    """One request and its answer, as ASGI's `receive` and `send`."""

    __slots__ = (
        "body",
        "buffered",
        "chunked",
        "complete",
        "connection",
        "disconnected",
        "expect_continue",
        "head",
        "keep_alive",
        "left",
        "more_body",
        "scope",
        "started",
        "taken",
        "waiter",
    )

    def __init__(
        self,
        connection: ClientConnection,
        scope: MutableMapping[str, Any],
        keep_alive: bool,
        expect_continue: bool,
    ) -> None:
        self.connection = connection
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body: list[bytes] = []  # arrived, not yet taken by the app
        self.buffered = 0
        self.more_body = True
        self.taken = False  # the whole body has gone to the app
        self.disconnected = False
        self.waiter: asyncio.Future[None] | None = None
        self.started = False  # the answer's head has been given
        self.complete = False  # the answer has ended
        self.chunked: bool | None = None
        self.left = 0  # body bytes the answer's content-length still owes
        self.head = b""  # the answer's head, held until the body's first bytes

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def run(self, app: App) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            log.error("router: exception in the app", exc_info=exc)
            if not self.started and not self.disconnected:
                await self._internal_error()
            else:
                self.connection.transport.close()
            if not isinstance(exc, Exception):
                raise
        else:
            if not self.complete and not self.disconnected:
                log.error("router: the app returned without completing its answer")
                if not self.started:
                    await self._internal_error()
                else:
                    self.connection.transport.close()

    async def _internal_error(self) -> None:
        body = b"Internal Server Error"
        headers = [(b"content-type", b"text/plain; charset=utf-8")]
        headers.append((b"content-length", b"%d" % len(body)))
        self.keep_alive = False
        await self.send({"type": "http.response.start", "status": 500, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    # -- ASGI ------------------------------------------------------------------------------
    async def receive(self) -> Message:
        connection = self.connection
        if self.expect_continue and not connection.transport.is_closing():
            connection.transport.write(_CONTINUE)
            self.expect_continue = False
        while not self.disconnected and not self.complete:
            if not self.taken and (self.body or not self.more_body):
                body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
                self.body.clear()
                self.buffered = 0
                self.taken = not self.more_body
                if connection.exchange is self:
                    connection._resume_reading()
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            waiter = self.waiter = connection.loop.create_future()
            await waiter
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        connection = self.connection
        if connection.write_paused and not self.disconnected:
            await connection.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected 'http.response.start', not {kind!r}")
            self.started = True
            self.expect_continue = False
            self.head = self._head(message["status"], list(message.get("headers", ())))
            if not message.get(HOLD):
                connection.transport.write(self.head)
                self.head = b""
            return
        if self.complete or kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        if self.scope["method"] == "HEAD":
            data = b""
        elif self.chunked:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more:
                data += b"0\r\n\r\n"
        else:
            self.left -= len(body)
            if self.left < 0:
                raise RuntimeError("answer longer than its content-length")
            data = body
        if self.head:
            data, self.head = self.head + data, b""
        if data:
            connection.transport.write(data)
        if not more:
            if self.left and self.scope["method"] != "HEAD":
                raise RuntimeError("answer shorter than its content-length")
            self.complete = True
            self.wake()
            connection.answered(self)

    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        """The status line and headers (ASGI's names are in lower case), framed as uvicorn
        frames them."""
        close = False  # the app's own `connection: close`
        own: set[bytes] = set()  # default headers the answer brings itself (a replica's)
        for name, value in headers:
            if name not in _FRAMING:
                continue
            if name in (b"date", b"server"):
                own.add(name)
            elif name == b"content-length" and self.chunked is None:
                self.left = int(value)
                self.chunked = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.left = 0
                self.chunked = True
            elif name == b"connection" and b"close" in [
                token.strip().lower() for token in value.split(b",")
            ]:
                self.keep_alive = False
                close = True
        if _BAD_NAME.search(b"".join([name for name, _ in headers])) or _BAD_VALUE.search(
            b"".join([value for _, value in headers])
        ):
            raise RuntimeError("invalid header name or value in the answer")
        defaults = self.connection.state.default_headers
        if own:  # each header once: the answer's own date and server, not the router's too
            default = b"".join([b"%s: %s\r\n" % h for h in defaults if h[0] not in own])
        else:
            default = _DEFAULT_HEAD.of(defaults)
        lines = [STATUS_LINES[status], default]
        lines += [b"%s: %s\r\n" % header for header in headers]
        if not self.keep_alive and not close:
            lines.append(b"connection: close\r\n")
        if self.chunked is None and self.scope["method"] != "HEAD" and status not in (204, 304):
            self.chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, (list, tuple)) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None
