"""The C open-loop client used by serving_maxrate (`benchmarks/openloop.c`), against a small
HTTP server: every request is answered or recorded once, a connection the server closes is
replaced, a request lost with its connection gets status 0, and the summary's dispatch rate
is the rate asked for."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import raw_load
from benchmarks.serving_maxrate import OpenLoop, read_records, write_requests

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> OpenLoop:
    return OpenLoop.build(tmp_path_factory.mktemp("openloop"))


async def _run(
    client: OpenLoop, tmp: Path, server: asyncio.Server, rate: float, connections: int
) -> tuple[np.ndarray, dict[str, Any]]:
    port = server.sockets[0].getsockname()[1]
    requests, out = tmp / "requests.bin", tmp / "records.bin"
    write_requests(requests, [raw_load.post_request("127.0.0.1", port, "/x", b'{"a": 1}')])
    command = client.command(port, requests, rate, 0.5, out, connections=connections, seed=3)
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    stdout, _ = await process.communicate()
    server.close()
    assert process.returncode == 0
    return read_records(out), json.loads(stdout)


def test_answers_every_request_and_replaces_closed_connections(
    client: OpenLoop, tmp_path: Path
) -> None:
    seen = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(8)  # the body
                seen[0] += 1
                close = seen[0] % 7 == 0
                extra = b"Connection: close\r\n" if close else b""
                writer.write(b"HTTP/1.1 200 OK\r\n" + extra + b"Content-Length: 2\r\n\r\nok")
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def body() -> tuple[np.ndarray, dict[str, Any]]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return await _run(client, tmp_path, server, 400.0, 4)

    records, summary = asyncio.run(body())
    assert len(records) == summary["sent"] == seen[0] > 100  # all answered, none twice
    assert set(records["status"]) == {200}
    assert (records["latency_ns"] >= records["lag_ns"]).all() and (records["lag_ns"] >= 0).all()
    assert summary["dispatch_rate"] == pytest.approx(400, rel=0.25)  # Poisson, 0.5 s
    assert 0 <= summary["cpu_share"] < 0.5


def test_records_a_lost_answer_and_each_status(client: OpenLoop, tmp_path: Path) -> None:
    heads = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        heads[0] += 1
        if heads[0] == 1:  # the first request: closed unanswered
            writer.close()
            return
        await reader.readexactly(8)
        writer.write(
            b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
        )
        await writer.drain()
        writer.close()

    async def body() -> tuple[np.ndarray, dict[str, Any]]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return await _run(client, tmp_path, server, 200.0, 2)

    records, summary = asyncio.run(body())
    statuses = dict(zip(*np.unique(records["status"], return_counts=True), strict=True))
    assert statuses.get(0) == 1
    assert statuses.get(503) == len(records) - 1 == summary["sent"] - 1
