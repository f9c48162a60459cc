"""The raw-connection load generator used by overload_real, against a small HTTP server: every
request sent is answered or counted, a connection the server closes is replaced, and an
unanswered request is recorded with status 0."""

from __future__ import annotations

import asyncio

from benchmarks import raw_load


async def _serve(closing_every: int) -> tuple[asyncio.Server, int, list[int]]:
    """Answers 200 to each request; every `closing_every`-th request (0: never) is answered
    with `connection: close` and the connection closed. Returns the server, its port and
    the running count of requests."""
    seen = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                seen[0] += 1
                close = closing_every and seen[0] % closing_every == 0
                extra = b"Connection: close\r\n" if close else b""
                writer.write(b"HTTP/1.1 200 OK\r\n" + extra + b"Content-Length: 2\r\n\r\nok")
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def test_open_loop_answers_every_request_and_replaces_closed_connections() -> None:
    async def body() -> tuple[raw_load.Outcomes, int]:
        server, port, seen = await _serve(closing_every=7)
        requests = [raw_load.post_request("127.0.0.1", port, "/x", b'{"a": 1}')]
        outcomes = await raw_load.open_loop("127.0.0.1", port, requests, 400.0, 0.5, 4, seed=3)
        server.close()
        return outcomes, seen[0]

    outcomes, seen = asyncio.run(body())
    assert outcomes.sent > 100
    assert len(outcomes.statuses) == outcomes.sent == seen  # all answered, none twice
    assert set(outcomes.statuses) == {200}
    assert all(
        lat >= wait >= 0 for lat, wait in zip(outcomes.latencies, outcomes.waits, strict=True)
    )


def test_closed_loop_keeps_its_clients_busy_and_records_a_lost_answer() -> None:
    async def body() -> raw_load.Outcomes:
        answered = [0]

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            answered[0] += 1
            if answered[0] == 1:  # the first request: closed unanswered
                writer.close()
                return
            await reader.readexactly(2)
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
                b"Content-Length: 0\r\n\r\n"
            )
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        requests = [raw_load.post_request("127.0.0.1", port, "/x", b"{}")]
        outcomes = await raw_load.closed_loop("127.0.0.1", port, requests, 2, 0.3, drain_s=2.0)
        server.close()
        return outcomes

    outcomes = asyncio.run(body())
    assert outcomes.statuses.count(0) == 1  # the connection closed with its request unanswered
    assert outcomes.statuses.count(503) >= 10  # answers that close: the connection is replaced
    assert len(outcomes.statuses) == outcomes.sent
