"""Load from raw HTTP/1.1 connections: open-loop arrivals and closed-loop clients that cost the
client tens of microseconds per request.

aiohttp costs its event loop a few hundred microseconds per request, so one client core
offers a model of 0.3 ms no more than about three times its capacity, and its own queue
shows in every latency it measures. Here requests are pre-encoded bytes written on asyncio
protocols, and a response is read by its `Content-Length`: one core offers tens of thousands
of requests per second, and what a latency shows is the server's.

Each connection carries one request at a time (no pipelining). In the open loop, a request
whose scheduled time comes while every connection is busy waits in the client for one, and
that wait counts in its latency, as the wait of a real client's pool would. A connection the
server closes (an answer with `connection: close`, or a close) is replaced by a new one, and
its request in flight, if unanswered, is recorded with status 0.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from dataclasses import dataclass, field
from typing import cast


@dataclass(slots=True)
class Outcomes:
    """What the client saw: per request, its status (0: no answer) and its latency in seconds
    from its scheduled send time, in the order answers came."""

    statuses: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)  # of each, for a free connection
    sent: int = 0

    def record(self, status: int, latency: float, wait: float) -> None:
        self.statuses.append(status)
        self.latencies.append(latency)
        self.waits.append(wait)


@dataclass(slots=True)
class _Pending:
    request: bytes
    scheduled: float  # perf_counter seconds
    written: float = 0.0  # when it was written on a connection


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.current: _Pending | None = None
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.pool.ready(self)

    def send(self, pending: _Pending) -> None:
        assert self.transport is not None
        self.current = pending
        pending.written = time.perf_counter()
        self.transport.write(pending.request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.current is not None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end]).lower()
            at = head.find(b"content-length:")
            if at < 0:
                length = 0  # lockgate always sends one; a response without has no body here
            else:
                stop = head.find(b"\r\n", at)
                length = int(head[at + 15 : stop if stop >= 0 else None])
            if len(self.buffer) < end + 4 + length:
                return
            del self.buffer[: end + 4 + length]
            status = int(head[9:12])
            done, self.current = self.current, None
            self.closing = b"connection: close" in head
            self.pool.answered(self, status, done)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pool.lost(self)


class _Pool:
    """At most `size` connections to one server; requests wait here for a free one."""

    def __init__(self, host: str, port: int, size: int, outcomes: Outcomes) -> None:
        self.host, self.port, self.size = host, port, size
        self.outcomes = outcomes
        self.idle: list[_Connection] = []
        self.opening = 0
        self.open = 0
        self.waiting: collections.deque[_Pending] = collections.deque()
        self.in_flight = 0
        self.on_answer: list[asyncio.Future[None]] = []  # closed loop: woken per answer
        self.loop = asyncio.get_running_loop()

    def submit(self, pending: _Pending) -> None:
        self.in_flight += 1
        if self.idle:
            self.idle.pop().send(pending)
            return
        self.waiting.append(pending)
        if self.open + self.opening < self.size:
            self._connect()

    def _connect(self) -> None:
        self.opening += 1

        async def connect() -> None:
            try:
                await self.loop.create_connection(lambda: _Connection(self), self.host, self.port)
            except OSError:
                self.opening -= 1
                if self.waiting:  # the server refused the connection: fail one request
                    self._finish(0, self.waiting.popleft())
                    if self.waiting and not self.open and not self.opening:
                        self._connect()

        self.loop.create_task(connect())

    def ready(self, connection: _Connection) -> None:
        self.opening -= 1
        self.open += 1
        self._next(connection)

    def _next(self, connection: _Connection) -> None:
        if self.waiting:
            connection.send(self.waiting.popleft())
        else:
            self.idle.append(connection)

    def answered(self, connection: _Connection, status: int, done: _Pending) -> None:
        self._finish(status, done)
        if connection.closing:
            return  # connection_lost replaces it
        self._next(connection)

    def lost(self, connection: _Connection) -> None:
        self.open -= 1
        if connection in self.idle:
            self.idle.remove(connection)
        if connection.current is not None:
            self._finish(0, connection.current)
            connection.current = None
        if self.waiting and self.open + self.opening < self.size:
            self._connect()

    def _finish(self, status: int, done: _Pending) -> None:
        self.in_flight -= 1
        written = done.written or done.scheduled  # never written: no wait to count
        self.outcomes.record(status, time.perf_counter() - done.scheduled, written - done.scheduled)
        waiters, self.on_answer = self.on_answer, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def close(self) -> None:
        for connection in self.idle:
            if connection.transport is not None:
                connection.transport.close()


def post_request(host: str, port: int, path: str, body: bytes) -> bytes:
    """A pre-encoded POST of a JSON body."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def open_loop(
    host: str,
    port: int,
    requests: list[bytes],
    rate: float,
    seconds: float,
    connections: int,
    seed: int,
    drain_s: float = 30.0,
) -> Outcomes:
    """Poisson arrivals at `rate` per second for `seconds`, cycling through `requests`; waits
    up to `drain_s` for the last answers (what is unanswered then counts as sent, not
    answered)."""
    outcomes = Outcomes()
    pool = _Pool(host, port, connections, outcomes)
    rng = random.Random(seed)
    start = time.perf_counter()
    offset = rng.expovariate(rate)
    while offset < seconds:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        now = time.perf_counter() - start
        while offset <= now and offset < seconds:  # every arrival due by now
            pool.submit(_Pending(requests[outcomes.sent % len(requests)], start + offset))
            outcomes.sent += 1
            offset += rng.expovariate(rate)
    await _drain(pool, drain_s)
    pool.close()
    return outcomes


async def closed_loop(
    host: str, port: int, requests: list[bytes], clients: int, seconds: float, drain_s: float = 30.0
) -> Outcomes:
    """`clients` clients on a connection each, each sending again the moment it has an
    answer (any status) for `seconds`."""
    outcomes = Outcomes()
    pool = _Pool(host, port, clients, outcomes)
    stop = time.perf_counter() + seconds
    for _ in range(clients):
        pool.submit(_Pending(requests[outcomes.sent % len(requests)], time.perf_counter()))
        outcomes.sent += 1
    while time.perf_counter() < stop:
        waiter = pool.loop.create_future()
        pool.on_answer.append(waiter)
        await waiter
        while pool.in_flight < clients and time.perf_counter() < stop:
            pool.submit(_Pending(requests[outcomes.sent % len(requests)], time.perf_counter()))
            outcomes.sent += 1
    await _drain(pool, drain_s)
    pool.close()
    return outcomes


async def _drain(pool: _Pool, drain_s: float) -> None:
    deadline = time.perf_counter() + drain_s
    while pool.in_flight and time.perf_counter() < deadline:
        waiter = pool.loop.create_future()
        pool.on_answer.append(waiter)
        try:
            await asyncio.wait_for(waiter, deadline - time.perf_counter())
        except TimeoutError:
            break
