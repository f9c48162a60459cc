"""The closed loops of the router suite's replicas comparison (`benchmarks/closedloop.c` and
`RawLoop`), against a small HTTP server whose first connection answers slowly: every request
of the round is answered once, and the round's count is the connections' together, so the
fast connection takes most of it instead of waiting idle for the slow one's quota; and the
meter that tells how long each replica's event loop sat idle meanwhile (`ServerMeter`)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks.router import CLoop, Closed, RawLoop, ServerMeter

SLOW_S = 0.01  # the first connection's answers take this long; the others' none


@pytest.fixture
def server() -> Iterator[tuple[int, dict[int, int]]]:
    """A server on its own loop and thread: its port, and the requests each connection sent
    (by the order it was accepted in)."""
    counts: dict[int, int] = {}
    loop = asyncio.new_event_loop()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(counts)
        counts[index] = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                counts[index] += 1
                if index == 0:
                    await asyncio.sleep(SLOW_S)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    started = threading.Event()
    holder: list[asyncio.Server] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        holder.append(loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0)))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait(5)
    yield holder[0].sockets[0].getsockname()[1], counts
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _c_loop(tmp: Path) -> Callable[[RawLoop], Closed]:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("needs a C compiler")
    built = CLoop.build(tmp)
    assert built is not None
    return lambda loop: built.run(loop, tmp)


def _raw_loop(tmp: Path) -> Callable[[RawLoop], Closed]:
    return lambda loop: asyncio.run(loop.run())


@pytest.mark.parametrize("client", [_c_loop, _raw_loop], ids=["closedloop.c", "RawLoop"])
def test_a_round_is_counted_over_all_connections(
    client: Callable[[Path], Callable[[RawLoop], Closed]],
    server: tuple[int, dict[int, int]],
    tmp_path: Path,
) -> None:
    port, counts = server
    meter = [0.0]

    def server_cpu() -> float:  # read before and after the timed requests
        meter[0] += 1.0
        return meter[0]

    loop = RawLoop(port, "/x", (b'{"a": 1}',), concurrency=2, requests=300, server_cpu=server_cpu)
    closed = client(tmp_path)(loop)
    assert closed.requests == 300  # the round's count, each answered once
    assert closed.server_cpu == 1.0 and closed.client_cpu >= 0
    assert 0 < closed.p50 < SLOW_S
    # warm-up: 10 on each connection; then the fast connection took most of the round: a
    # quota of 150 each would have held it idle while the slow one sent 150 at 10 ms apiece
    slow, fast = counts[0] - 10, counts[1] - 10
    assert fast > 5 * slow
    assert closed.rate > 150 / (150 * SLOW_S)


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs /proc schedstat")
def test_the_meter_tells_a_busy_process_from_an_idle_one() -> None:
    """A parent (a supervisor: not a leaf, not counted) with a child that spins and one
    that sleeps."""
    spin = "import time\nend = time.monotonic() + 2\nwhile time.monotonic() < end: pass"
    parent = (
        "import subprocess, sys, time\n"
        f"a = subprocess.Popen([sys.executable, '-c', {spin!r}])\n"
        "b = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(2)'])\n"
        "print(a.pid, b.pid, flush=True)\n"
        "a.wait(); b.wait()\n"
    )
    with subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE) as process:
        assert process.stdout is not None
        spinning, sleeping = map(int, process.stdout.readline().split())
        time.sleep(0.5)  # both started: the sleeping one asleep
        meter = ServerMeter(process.pid)
        before = meter()
        time.sleep(0.5)
        after = meter()
        process.kill()
    assert after > before  # CPU seconds of the tree: the spinning child's
    idle = dict(zip(meter.reads[-1][1], meter.idle(), strict=True))
    assert set(idle) == {spinning, sleeping}
    assert idle[spinning] < 0.2 and idle[sleeping] > 0.8
