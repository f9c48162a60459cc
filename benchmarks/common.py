"""Shared parts of the benchmark suites: results, servers, pinning and load generators.

A suite module calls these helpers and returns a `SuiteResult`. Timing conventions:

- Latencies are in seconds inside the code and in milliseconds in tables.
- The server runs on core 0 and the client (this process) on core 1 when `taskset` and
  `os.sched_setaffinity` are available; `pinned(core)` moves in-process baselines to the
  server's core so that both sides of a ratio ran on the same core.
- The open-loop client draws Poisson arrivals and counts latency from the *scheduled* send
  time, so a client that falls behind shows up as latency, not as a lower offered rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SERVER_CORE = 0
CLIENT_CORE = 1

Progress = Callable[[str], None]


# -- results ---------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    """One line of a suite's table: a value, optionally against a baseline from the same run."""

    label: str
    value: float
    unit: str
    baseline_label: str = ""
    baseline: float | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.baseline == 0:
            return None
        return self.value / self.baseline


@dataclass(slots=True)
class SuiteResult:
    """What a suite's `run(ctx)` returns; `benchmarks.run` writes it to JSON and Markdown."""

    suite: str
    title: str
    target: str  # the claim the suite checks, in words
    met: bool | None  # None: the target could not be evaluated in this run
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)  # per-repetition data for the JSON
    seconds: float = 0.0
    environment: dict[str, Any] = field(default_factory=dict)

    def add(self, label: str, value: float, unit: str, **extra: Any) -> Row:
        row = Row(label, value, unit, **extra)
        self.rows.append(row)
        return row

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for row, original in zip(data["rows"], self.rows, strict=True):
            row["ratio"] = original.ratio
        return data


@dataclass(slots=True)
class Context:
    """Settings shared by every suite in one `python -m benchmarks.run`."""

    work: Path  # a scratch folder, removed after the run
    results: Path  # benchmarks/results
    repetitions: int = 3
    quick: bool = False  # shorter runs, for checking that a suite works
    progress: Progress = print

    def scale(self, seconds: float) -> float:
        """A duration shortened in quick mode."""
        return seconds / 4 if self.quick else seconds

    def say(self, suite: str, message: str) -> None:
        self.progress(f"[{suite}] {message}")


def environment() -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "pinning": pinning_available(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


# -- statistics ------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def median(values: Sequence[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.median(finite) if finite else float("nan")


# -- pinning ---------------------------------------------------------------------------


def _allowed_cores() -> set[int]:
    if not hasattr(os, "sched_getaffinity"):
        return set()
    return set(os.sched_getaffinity(0))


_CORES_AT_START = _allowed_cores()  # before pin_client() narrows this process


def pinning_available() -> bool:
    return (
        shutil.which("taskset") is not None
        and SERVER_CORE in _CORES_AT_START
        and CLIENT_CORE in _CORES_AT_START
    )


def pin_command(command: list[str], core: int) -> list[str]:
    """`command` prefixed with `taskset -c core` when pinning is available."""
    return ["taskset", "-c", str(core), *command] if pinning_available() else command


@contextlib.contextmanager
def pinned(core: int) -> Iterator[None]:
    """Run this process on `core` inside the block (threads created inside inherit it)."""
    if not pinning_available():
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pin_client() -> None:
    """Move the benchmark process (the load generator) to the client core."""
    if pinning_available():
        os.sched_setaffinity(0, {CLIENT_CORE})


# -- servers ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(slots=True)
class Server:
    """A server subprocess pinned to the server core, with its log in the scratch folder."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(
    name: str,
    command: list[str],
    port: int,
    work: Path,
    ready_path: str = "/v2/health/ready",
    timeout: float = 180.0,
    pinned: bool = True,
) -> Server:
    """Start `command` on the server core (anywhere, unless `pinned`) and wait until
    `ready_path` answers 200."""
    log_path = work / f"{name}-{port}.log"
    if pinned:
        command = pin_command(command, SERVER_CORE)
    elif shutil.which("taskset") is not None and _CORES_AT_START:
        # every core this run started with: a child inherits this process's affinity, and
        # pin_client() may have narrowed it to the client's core
        cores = ",".join(str(c) for c in sorted(_CORES_AT_START))
        command = ["taskset", "-c", cores, *command]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    server = Server(name, process, port, log_path)
    try:
        _wait_ready(server, ready_path, timeout)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: Server, path: str, timeout: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited early:\n{server.log_tail()}")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(server.url + path, timeout=1.0) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{server.name} not ready after {timeout:.0f} s:\n{server.log_tail()}")


def start_lockgate(repository: Path, work: Path, *extra: str) -> Server:
    """`lockgate serve REPOSITORY --no-llm` on the server core."""
    port = free_port()
    command = [sys.executable, "-m", "lockgate.cli", "serve", str(repository)]
    command += ["--port", str(port), "--no-llm", *extra]
    return start_server("lockgate", command, port, work)


@contextlib.contextmanager
def running(*servers: Server) -> Iterator[None]:
    try:
        yield
    finally:
        for server in servers:
            server.stop()


SCRAPE_TIMEOUT_S = 30.0


def scrape_metrics(url: str) -> dict[str, float]:
    """The Prometheus text at `url`/metrics as {'name{labels}': value}. The timeout is long: on
    a loaded 2-core machine a replica just started, or just out of a saturating round, took
    over 5 s to answer, which failed a whole suite."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                values[key] = float(value)
    return values


def process_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds used so far by process `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(values: dict[str, float], name: str, model: str) -> float:
    """The sum of `name` over series whose labels name `model`."""
    needle = f'model="{model}"'
    return sum(v for k, v in values.items() if k.split("{")[0] == name and needle in k)


# -- load generators -------------------------------------------------------------------


@dataclass(slots=True)
class LoadResult:
    """Outcome of one load run. `latencies` holds successful requests only (seconds)."""

    latencies: list[float]
    statuses: Counter[int]
    seconds: float  # wall time from the first send to the last answer
    offered_rate: float = 0.0  # open loop only: requests per second scheduled

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0)

    @property
    def refused(self) -> int:
        """503 answers: a full queue or admission control said no."""
        return self.statuses.get(503, 0)

    @property
    def errors(self) -> int:
        """Anything that is neither a success nor a refusal (status 0: a client error)."""
        return sum(n for status, n in self.statuses.items() if status not in (200, 503))

    @property
    def throughput(self) -> float:
        """Successful requests per second."""
        return self.ok / self.seconds if self.seconds > 0 else 0.0

    def p(self, q: float) -> float:
        return percentile(self.latencies, q)


@dataclass(frozen=True, slots=True)
class Target:
    """Where to POST and what: a list of pre-encoded bodies, used round-robin or at random."""

    url: str
    bodies: tuple[bytes, ...]
    content_type: str = "application/json"


def _session(connections: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=connections, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120.0)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def _post(session: aiohttp.ClientSession, target: Target, body: bytes) -> int:
    headers = {"Content-Type": target.content_type}
    try:
        async with session.post(target.url, data=body, headers=headers) as response:
            await response.read()
            return response.status
    except (aiohttp.ClientError, TimeoutError):
        return 0


async def closed_loop(
    target: Target, concurrency: int, *, requests: int = 0, seconds: float = 0.0, warmup: int = 50
) -> LoadResult:
    """`concurrency` workers, each sending its next request when the last one answers.

    Stops after `requests` requests in total, or after `seconds` when `requests` is 0.
    """
    async with _session(concurrency) as session:
        for i in range(warmup):
            await _post(session, target, target.bodies[i % len(target.bodies)])
        latencies: list[float] = []
        statuses: Counter[int] = Counter()
        sent = 0
        start = time.perf_counter()
        stop_at = start + seconds if not requests else float("inf")

        async def worker() -> None:
            nonlocal sent
            while sent < requests if requests else time.perf_counter() < stop_at:
                body = target.bodies[sent % len(target.bodies)]
                sent += 1
                t0 = time.perf_counter()
                status = await _post(session, target, body)
                statuses[status] += 1
                if status == 200:
                    latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return LoadResult(latencies, statuses, time.perf_counter() - start)


async def open_loop(
    target: Target, rate: float, seconds: float, *, seed: int = 0, connections: int = 1024
) -> LoadResult:
    """Poisson arrivals at `rate` per second for `seconds`; latency from the scheduled time."""
    rng = random.Random(seed)
    offsets: list[float] = []  # seconds after the start
    t = rng.expovariate(rate)
    while t < seconds:
        offsets.append(t)
        t += rng.expovariate(rate)
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    async with _session(connections) as session:
        await _post(session, target, target.bodies[0])  # open one connection first

        async def one(scheduled: float, body: bytes) -> None:
            status = await _post(session, target, body)
            statuses[status] += 1
            if status == 200:
                latencies.append(time.perf_counter() - scheduled)

        start = time.perf_counter()
        tasks: list[asyncio.Task[None]] = []
        for offset in offsets:
            scheduled = start + offset
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = target.bodies[rng.randrange(len(target.bodies))]
            tasks.append(asyncio.create_task(one(scheduled, body)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return LoadResult(latencies, statuses, elapsed, offered_rate=len(offsets) / seconds)


Result = TypeVar("Result")


def run_async(coroutine: Awaitable[Result]) -> Result:
    """Run a load generator on a fresh event loop (uvloop when installed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)  # type: ignore[arg-type]
    return uvloop.run(coroutine)  # type: ignore[arg-type]


class RawClient:
    """A blocking HTTP/1.1 keep-alive client over one socket, for latency at concurrency 1.

    Requests are pre-encoded bytes and the response is read by its Content-Length, so the
    client costs tens of microseconds per request where aiohttp costs most of a millisecond:
    what remains of a round trip is the server and the loopback.
    """

    def __init__(self, url: str, content_type: str = "application/json") -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.path, self.content_type = parts.path, content_type
        self.sock = socket.create_connection((self.host, self.port))
        self.last_body = b""  # the body of the last answer
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def request(self, body: bytes) -> bytes:
        """POST `body`; the prepared request for it. Use with `send`."""
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: {self.content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    def send(self, request: bytes) -> int:
        """Send a prepared request, read its whole response; the HTTP status."""
        self.sock.sendall(request)
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
        while len(rest) < length:
            self.buffer = rest
            self._fill()
            rest = self.buffer
        self.last_body = bytes(rest[:length])
        self.buffer = rest[length:]
        return int(head[9:12])

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        self.buffer += chunk

    def close(self) -> None:
        self.sock.close()


def raw_latencies(target: Target, count: int, warmup: int = 20) -> list[float]:
    """Seconds per request of `count` sequential requests with `RawClient`; non-200 raises."""
    client = RawClient(target.url, target.content_type)
    requests = [client.request(body) for body in target.bodies]
    try:
        times: list[float] = []
        for i in range(warmup + count):
            t0 = time.perf_counter()
            status = client.send(requests[i % len(requests)])
            elapsed = time.perf_counter() - t0
            if status != 200:
                said = client.last_body[:300].decode(errors="replace")
                raise RuntimeError(f"{target.url}: HTTP {status}: {said}")
            if i >= warmup:
                times.append(elapsed)
        return times
    finally:
        client.close()


def time_calls(call: Callable[[], object], count: int, warmup: int = 20) -> list[float]:
    """Seconds taken by each of `count` calls of `call`, after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    times: list[float] = []
    for _ in range(count):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


# -- request bodies --------------------------------------------------------------------


def v2_body(inputs: dict[str, np.ndarray]) -> bytes:
    """A KServe v2 JSON request with every input inline."""
    tensors = []
    for name, array in inputs.items():
        datatype = "BYTES" if array.dtype.kind in "OSU" else _V2_TYPES[array.dtype.str[1:]]
        data = (
            [_text(x) for x in array.reshape(-1)] if datatype == "BYTES" else array.ravel().tolist()
        )
        tensors.append(
            {"name": name, "shape": list(array.shape), "datatype": datatype, "data": data}
        )
    return json.dumps({"inputs": tensors}).encode()


_V2_TYPES = {"f4": "FP32", "f8": "FP64", "i8": "INT64", "i4": "INT32", "u1": "UINT8", "b1": "BOOL"}


def _text(item: object) -> str:
    return item.decode() if isinstance(item, bytes) else str(item)
