"""router: what `lockgate route` costs and what it buys, three measurements in one run.

1. Overhead. digits_onnx (the demo's ONNX classifier, one row per request, KServe v2 over
   HTTP) served by one lockgate process on the server core, asked directly and through
   `lockgate route` with that one replica. The router runs on the client core (it would have
   cores of its own in a deployment; here it shares the client's). Closed loop at a fixed
   concurrency (`OVERHEAD_CONCURRENCY`); the added p50 and the share of throughput kept are
   the targets, c=1 p50 is shown too (the hop's own cost, no queueing), and the router's CPU
   per proxied request at that concurrency (its process, from /proc, over all the requests
   it answered in the run): what the client core pays for the hop beside the client.
2. Hedging. Three replicas of a Python model that answers in about a millisecond; one of them
   stalls 50 ms on 5% of its calls (`stall_rate`, a seeded draw per call). Two routers over
   the same replicas, one with `--no-hedge`, one with hedging at its defaults (after the
   model's recent p95, within a 10% budget); closed loop at concurrency 3, p99 of each and the
   extra copies the hedging router sent (`lockgate_router_hedges_total` over
   `lockgate_router_requests_total`). perf_analyzer is the client when installed: it reads the
   router's statistics, every replica's summed, so each router is measured once all three
   replicas are usable in it.
3. Replicas. `lockgate serve --replicas 2` (two processes pinned to cores 0 and 1, as
   `--pin-replicas auto` places two replicas on two cores) against `--replicas 1` (one
   process) on digits_onnx, both ways of balancing: `--balance kernel`
   (the replicas share the port through SO_REUSEPORT, nothing in front: the target) and
   `--balance router` (the router in front of them, shown beside it). Each figure is the
   highest closed-loop throughput over a sweep of concurrencies whose p99 stays under 50 ms;
   each connection of the closed loop is one the kernel places, so the sweep goes to many
   connections. On a machine with two cores the client (and the router) share the replicas'
   cores, so this is the ratio the same two cores give, not what a machine with spare cores
   would; beside it, the CPU all of a set-up's processes spend per request over the timed
   requests (from /proc), which shows what each way of balancing costs even when other work
   takes cores, the client's own CPU per request, the ceiling those two leave two replicas
   on two cores (2 / (server + client CPU per request)), and how evenly the kernel split the
   requests between the replicas (their own counts, on their private ports).

The client is Triton's perf_analyzer (C++, synchronous HTTP, `count_windows` of `WINDOW`
requests, three windows) when `.venv-perf` has it, else `RawLoop`: kept-alive sockets with
prepared requests, one connection per concurrent request, in this process on the client core.
perf_analyzer reads the server's statistics before and after each window; through the router
(the overhead and the hedging measurements) those are every replica's, summed
(`lockgate/router/statistics.py`). Before the router summed them, they came from whichever
replica the balancer picked, and the hedging measurement, the router in front of three
replicas, failed its run at random ("failed to find the requested model version").
The replicas comparison never uses perf_analyzer: with `--balance kernel` the replicas share
a port with nothing in front to sum their statistics, so each read comes from whichever
replica the kernel gave the connection, and the three set-ups are measured by one client.
It uses `CLoop` (`closedloop.c`, compiled with `cc`, on the client
core: RawLoop's loop in C, about 11 µs of CPU per request here against RawLoop's 17 to 20),
else `RawLoop`. The client shares the two cores with the two
replicas, so its CPU per request bounds the ratio (2 / (server + client CPU per request)
against one replica's 1 / server CPU per request). Both closed loops count a round's requests
over all their connections, as a window of time would (perf_analyzer's `count_windows` does
too): a connection to the replica on the less busy core sends more of them. A quota per
connection (the round ending when every connection had sent its share) held the faster
replica idle at the end of each round, waiting for the slower one (the one sharing the
client's core) to finish its share: the kernel split the requests 51/49 because the quotas
did, and about a quarter of a core went idle. The servers run with the
connection gate's saturation refusals off (`--max-loop-lag-ms 0 --queue-target-ms 0`) and
digits without its 50 ms latency SLO, so a closed loop measures capacity and not refusals
(perf_analyzer stops at the first error).
Repetitions alternate the systems compared; tables quote medians.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np
import uvloop
import yaml

from benchmarks.common import (
    CLIENT_CORE,
    SERVER_CORE,
    Context,
    Server,
    SuiteResult,
    environment,
    free_port,
    median,
    percentile,
    pin_command,
    pinning_available,
    running,
    scrape_metrics,
    start_lockgate,
    start_server,
    v2_body,
)
from benchmarks.serving_maxrate import write_requests
from benchmarks.serving_overhead import PERF_ANALYZER, demo_model, digits_rows

SUITE = "router"
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
T = TypeVar("T")
DIGITS = "digits_onnx"
STALLER = "staller"
OVERHEAD_CONCURRENCY = 8
HEDGE_CONCURRENCY = 3
SWEEP, QUICK_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128), (2, 8, 32)
P99_BOUND_S = 0.050  # the replicas comparison: highest throughput with p99 under this
WINDOW, QUICK_WINDOW = 2000, 500  # requests per perf_analyzer window
TARGET_ADDED_P50_MS = 0.3
TARGET_KEPT = 0.90
TARGET_HEDGE_CUT = 3.0
TARGET_HEDGE_EXTRA = 0.10
TARGET_REPLICAS_RATIO = 1.6
WARMUP_ROUNDS = 10  # RawLoop, CLoop: requests per connection before they measure
CLOOP_SOURCE = Path(__file__).resolve().parent / "closedloop.c"
GATE_OFF = ("--max-loop-lag-ms", "0", "--queue-target-ms", "0")
ROUTER_ANSWERS = "lockgate_router_requests_total"
NO_GRPC = ("--grpc-port", "off")

STALLER_MODEL = '''
import random
import time


class Model:
    """y = x after `work` seconds; `stall` seconds more on a `stall_rate` share of calls."""

    def load(self, config, version_dir):
        p = config.parameters
        self.work = float(p.get("work", "0"))
        self.stall = float(p.get("stall", "0"))
        self.stall_rate = float(p.get("stall_rate", "0"))
        self.random = random.Random(int(p.get("seed", "0")))

    def infer(self, inputs):
        time.sleep(self.work)
        if self.random.random() < self.stall_rate:
            time.sleep(self.stall)
        return {"y": inputs["x"]}
'''


# -- the client ------------------------------------------------------------------------


@dataclass(slots=True)
class Closed:
    """One closed-loop measurement: seconds and requests per second; with `RawLoop` or
    `CLoop`, the CPU seconds the client and the server spent over the timed requests (nan:
    not measured)."""

    p50: float
    p99: float
    rate: float
    requests: int
    client_cpu: float = float("nan")
    server_cpu: float = float("nan")


class Client:
    """perf_analyzer when installed (pinned to `cores`), else `RawLoop` in this process."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.perf = PERF_ANALYZER.exists()
        self.window = QUICK_WINDOW if ctx.quick else WINDOW
        self.bodies: dict[str, tuple[bytes, ...]] = {
            DIGITS: tuple(v2_body({"input": row[None]}) for row in digits_rows(16)),
            STALLER: (v2_body({"x": np.ones((1, 2), dtype=np.float32)}),),
        }
        self.c_loop = CLoop.build(ctx.work)

    @property
    def name(self) -> str:
        return "perf_analyzer" if self.perf else RAW_LOOP

    @property
    def replicas_name(self) -> str:
        """The client of the replicas comparison."""
        return C_LOOP if self.c_loop else RAW_LOOP

    def run(
        self, port: int, model: str, concurrency: int, cores: str, protocol: str = "http"
    ) -> Closed:
        if not self.perf:
            return self.raw(port, model, concurrency)
        command = [str(PERF_ANALYZER), "-m", model, "-u", f"127.0.0.1:{port}", "-i", protocol]
        command += ["--concurrency-range", str(concurrency), "--percentile", "99"]
        command += ["--measurement-mode", "count_windows", "--stability-percentage", "100"]
        command += ["--measurement-request-count", str(self.window)]
        done = subprocess.run(_on(command, cores), capture_output=True, text=True, timeout=600)
        found = parse(done.stdout)
        if found is None:
            said = (done.stdout[-400:] + done.stderr[-400:]).strip()
            raise RuntimeError(f"perf_analyzer failed ({done.returncode}): {said}")
        return found

    def raw(
        self, port: int, model: str, concurrency: int, server_cpu: Callable[[], float] | None = None
    ) -> Closed:
        """`RawLoop` in this process (on the client core). `server_cpu` reads the server's CPU
        seconds so far."""
        return uvloop.run(self._loop(port, model, concurrency, server_cpu).run())

    def replicas(
        self, port: int, model: str, concurrency: int, server_cpu: Callable[[], float]
    ) -> Closed:
        """The replicas comparison's closed loop: `CLoop` when a C compiler built it, else
        `RawLoop`; not perf_analyzer, whose statistics cannot follow replicas that share a
        port (nothing in front of them sums theirs: each request for them may reach another
        one)."""
        loop = self._loop(port, model, concurrency, server_cpu)
        if self.c_loop is not None:
            return self.c_loop.run(loop, self.ctx.work)
        return uvloop.run(loop.run())

    def _loop(
        self, port: int, model: str, concurrency: int, server_cpu: Callable[[], float] | None
    ) -> RawLoop:
        path = f"/v2/models/{model}/infer"
        return RawLoop(port, path, self.bodies[model], concurrency, 3 * self.window, server_cpu)


RAW_LOOP = "RawLoop, a raw-socket closed loop in Python"
C_LOOP = "closedloop.c, a closed loop in C"


@dataclass(frozen=True, slots=True)
class CLoop:
    """`closedloop.c`, compiled: `RawLoop`'s closed loop at about 60% of its CPU per request
    (11 µs against 17 to 20 here, the kernel's loopback included), run on the client core."""

    binary: Path

    @classmethod
    def build(cls, work: Path) -> CLoop | None:
        """Compiled into `work`; None without a C compiler."""
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            return None
        binary = work / "closedloop"
        subprocess.run([compiler, "-O2", "-o", str(binary), str(CLOOP_SOURCE)], check=True)
        return cls(binary)

    def run(self, loop: RawLoop, work: Path) -> Closed:
        """What `loop` asks for (its port, requests, concurrency and count), measured the same
        way: latencies of the answers 200, the client's CPU and the server's over the timed
        requests alone."""
        requests, out = work / "closedloop-requests", work / "closedloop-latencies"
        write_requests(requests, loop.prepared())
        total = max(loop.requests, loop.concurrency)
        command = [str(self.binary), "127.0.0.1", str(loop.port), str(loop.concurrency)]
        command += [str(WARMUP_ROUNDS), str(total), str(requests), str(out)]
        with subprocess.Popen(
            _on(command, str(CLIENT_CORE)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as process:
            assert process.stdin is not None and process.stdout is not None
            warm = process.stdout.readline()
            server_before = loop.server_cpu() if loop.server_cpu else float("nan")
            if warm.strip() == "warm":
                process.stdin.write("go\n")
                process.stdin.flush()
            counted = process.stdout.readline()
            server = loop.server_cpu() - server_before if loop.server_cpu else float("nan")
            summary = process.stdout.readline() if counted.strip() == "counted" else ""
            said = process.stderr.read() if process.stderr else ""
        if process.returncode != 0 or not summary:
            raise RuntimeError(f"closedloop failed ({process.returncode}): {said[-400:]}")
        found = json.loads(summary)
        if found["failed"]:
            raise RuntimeError(
                f"{found['failed']} requests to port {loop.port} were not answered 200"
            )
        latencies = (np.fromfile(out, dtype="<i8") / 1e9).tolist()
        p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
        rate = found["answered"] / found["seconds"]
        return Closed(p50, p99, rate, found["answered"], found["cpu_seconds"], server)


@dataclass(slots=True)
class Round:
    """One round of a closed loop, shared by its connections: `to_send` requests still to go
    out; the first `counted` answers are timed (into `latencies`, those answered 200) and the
    round's clock stops at the last of them (`ended`, perf_counter). A faster connection
    (to a replica on a less busy core) takes more of the round, as in a window of time:
    none waits idle for the slowest to finish a quota of its own."""

    to_send: int
    counted: int
    latencies: list[float] | None  # None: untimed
    failed: int = 0
    ended: float = 0.0
    cpu_ended: float = 0.0  # process_time then


class _Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection of the closed loop: it sends its next prepared
    request from the callback that reads the last one's answer (by its Content-Length), so a
    request costs the client no future and no task switch."""

    def __init__(self, requests: list[bytes]) -> None:
        self.requests = requests
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.sent = 0  # requests sent on this connection so far
        self.sent_at = 0.0
        self.round_: Round | None = None
        self.done: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self, round_: Round) -> asyncio.Future[None]:
        """Send this connection's first request of `round_`, and the next one after each
        answer while the round has requests to send; the future is done after the last
        answer owed on this connection."""
        self.round_ = round_
        self.done = asyncio.get_running_loop().create_future()
        self._send()
        return self.done

    def _send(self) -> None:
        assert self.transport is not None
        self.sent_at = time.perf_counter()
        self.transport.write(self.requests[self.sent % len(self.requests)])
        self.sent += 1

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", self.buffer[:end]) if end >= 0 else None
        if length is None or len(self.buffer) < end + 4 + int(length[1]):
            return
        answered = time.perf_counter()
        status = int(self.buffer[9:12])
        del self.buffer[: end + 4 + int(length[1])]
        round_ = self.round_
        assert round_ is not None
        if round_.latencies is not None and round_.counted > 0:
            if status == 200:
                round_.latencies.append(answered - self.sent_at)
            else:
                round_.failed += 1
            round_.counted -= 1
            if round_.counted == 0:
                round_.ended, round_.cpu_ended = answered, time.process_time()
        if round_.to_send > 0:
            round_.to_send -= 1
            self._send()
        elif self.done is not None and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("the server closed the connection"))


@dataclass(slots=True)
class RawLoop:
    """`concurrency` connections, each sending its next prepared request when the last is
    answered, until `requests` in all are answered (a `Round`), after a warm-up
    (`WARMUP_ROUNDS` requests for each connection); about 20 µs of client CPU per request
    (half of it the kernel's), where aiohttp costs most of a millisecond. The client's CPU
    (this process's) and the server's (`server_cpu`, when given) are read just before and
    after the timed requests, warm-up and connections left out."""

    port: int
    path: str
    bodies: tuple[bytes, ...]
    concurrency: int
    requests: int
    server_cpu: Callable[[], float] | None = None

    def prepared(self) -> list[bytes]:
        head = f"POST {self.path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
        head += "Content-Type: application/json\r\n"
        return [(head + f"Content-Length: {len(b)}\r\n\r\n").encode() + b for b in self.bodies]

    async def run(self) -> Closed:
        loop = asyncio.get_running_loop()
        requests = self.prepared()
        connections: list[_Connection] = []
        for _ in range(self.concurrency):
            _, connection = await loop.create_connection(
                partial(_Connection, requests), "127.0.0.1", self.port
            )
            connections.append(connection)
        await self._round(connections, WARMUP_ROUNDS * self.concurrency, None)
        latencies: list[float] = []
        total = max(self.requests, self.concurrency)
        server_before = self.server_cpu() if self.server_cpu else float("nan")
        client_before = time.process_time()
        start = time.perf_counter()
        timed = await self._round(connections, total, latencies)
        elapsed = timed.ended - start
        client = timed.cpu_ended - client_before
        server = self.server_cpu() - server_before if self.server_cpu else float("nan")
        for connection in connections:
            assert connection.transport is not None
            connection.transport.close()
        if timed.failed:
            raise RuntimeError(f"{timed.failed} requests to port {self.port} were not answered 200")
        p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
        return Closed(p50, p99, len(latencies) / elapsed, len(latencies), client, server)

    async def _round(
        self, connections: list[_Connection], total: int, latencies: list[float] | None
    ) -> Round:
        round_ = Round(total - len(connections), total, latencies)
        await asyncio.gather(*(c.start(round_) for c in connections))
        return round_


def parse(text: str) -> Closed | None:
    p50 = re.search(r"p50 latency: (\d+) usec", text)
    p99 = re.search(r"p99 latency: (\d+) usec", text)
    rate = re.search(r"Throughput: ([\d.]+) infer/sec", text)
    count = re.search(r"Request count: (\d+)", text)
    if not (p50 and p99 and rate and count):
        return None
    return Closed(int(p50[1]) / 1e6, int(p99[1]) / 1e6, float(rate[1]), int(count[1]))


def _on(command: list[str], cores: str) -> list[str]:
    """`command` on `cores` ("0", "1" or "0,1") when pinning is available."""
    if not pinning_available():
        return command
    if "," in cores:
        return ["taskset", "-c", cores, *command]
    return pin_command(command, int(cores))


# -- servers ---------------------------------------------------------------------------


def start_router(work: Path, replicas: list[Server], *flags: str) -> Server:
    """`lockgate route` over `replicas`, on the client core."""
    port = free_port()
    command = [sys.executable, "-m", "lockgate.cli", "route", "--port", str(port), *flags]
    command += [a for r in replicas for a in ("--replica", r.url)]
    return start_server("router", _on(command, str(CLIENT_CORE)), port, work, pinned=False)


@dataclass(frozen=True, slots=True)
class ServeSetup:
    """One `lockgate serve` set-up of the replicas comparison."""

    count: int
    balance: str = ""  # --balance kernel or router; "" for one process

    @property
    def name(self) -> str:
        return f"--replicas {self.count}" + (f" --balance {self.balance}" if self.balance else "")


def start_serve(repository: Path, work: Path, setup: ServeSetup, base: int) -> Server:
    """`lockgate serve --replicas N` free to use both cores (it places its replicas itself:
    one on each core, as `--pin-replicas auto` does with as many replicas as cores), replica
    i on port `base` + i, once every replica is ready."""
    port = free_port()
    command = [sys.executable, "-m", "lockgate.cli", "serve", str(repository), "--no-llm"]
    command += ["--port", str(port), "--replicas", str(setup.count), *GATE_OFF, *NO_GRPC]
    command += ["--replica-base-port", str(base)]
    if setup.balance:
        command += ["--balance", setup.balance]
    both = f"{SERVER_CORE},{CLIENT_CORE}"
    name = f"serve-{setup.count}{setup.balance}"
    server = start_server(name, _on(command, both), port, work, pinned=False)
    try:
        if setup.balance == "router":
            _wait_usable(server, setup.count)
        elif setup.balance == "kernel":  # each on its private port
            for i in range(setup.count):
                _wait_ready(server, f"http://127.0.0.1:{base + i}")
    except BaseException:
        server.stop()
        raise
    return server


def _free_run(count: int) -> int:
    """A free port whose next `count - 1` ports are free too."""
    while True:
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base


def digits_repository(ctx: Context) -> Path:
    """digits_onnx without its latency SLO: a closed loop measures capacity, not refusals."""
    repository = ctx.work / "digits-repo"
    shutil.copytree(demo_model(ctx, DIGITS), repository / DIGITS)
    path = repository / DIGITS / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config.pop("latency_slo_ms", None)
    path.write_text(yaml.safe_dump(config))
    return repository


def staller_repository(root: Path, index: int, stall_rate: float) -> Path:
    repository = root / f"staller-{index}"
    (repository / STALLER / "1").mkdir(parents=True)
    (repository / STALLER / "1" / "model.py").write_text(STALLER_MODEL)
    parameters = {"work": "0.001", "stall": "0.05", "stall_rate": stall_rate, "seed": index}
    config = {
        "backend": "python",
        "max_batch_size": 0,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [1, 2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [1, 2]}],
        "parameters": {k: str(v) for k, v in parameters.items()},
    }
    (repository / STALLER / "config.yaml").write_text(yaml.safe_dump(config))
    return repository


@contextmanager
def started(*starts: Callable[[], Server]) -> Iterator[list[Server]]:
    """Start servers one after the other; all are stopped on the way out."""
    servers: list[Server] = []
    try:
        for start in starts:
            servers.append(start())
        with running(*servers):
            yield servers
    finally:
        for server in servers:
            server.stop()


# -- measurements ----------------------------------------------------------------------


@dataclass(slots=True)
class Series:
    """Per-repetition figures of one system."""

    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    extra: list[float] = field(default_factory=list)  # hedging: extra copies per request
    cpu: list[float] = field(default_factory=list)  # server (or router) CPU s per request
    client: list[float] = field(default_factory=list)  # replicas: client CPU s per request
    busier: list[float] = field(default_factory=list)  # replicas: the busier one's share
    idle: list[float] = field(default_factory=list)  # replicas: the idlest one's idle share

    def add(self, closed: Closed) -> None:
        self.p50.append(closed.p50)
        self.p99.append(closed.p99)
        self.rate.append(closed.rate)


def measure_overhead(ctx: Context, client: Client, repository: Path) -> dict[str, Series]:
    names = ("direct c=1", "router c=1", "direct", "router", "direct grpc", "router grpc")
    series = {name: Series() for name in names}
    grpc, router_grpc = free_port(), free_port()
    with (
        started(
            partial(start_lockgate, repository, ctx.work, *GATE_OFF, "--grpc-port", str(grpc)),
        ) as (replica,),
        started(
            partial(
                start_router,
                ctx.work,
                [replica],
                "--no-hedge",
                *("--grpc-port", str(router_grpc), "--replica-grpc-port", str(grpc)),
            )
        ) as (router,),
    ):
        systems = [("direct", replica.port, grpc), ("router", router.port, router_grpc)]
        meter = ServerMeter(router.process.pid)
        for rep in range(1, ctx.repetitions + 1):
            for name, port, grpc_port in alternate(systems, rep):
                one = client.run(port, DIGITS, 1, str(CLIENT_CORE))
                before = (meter(), _sum(scrape_metrics(router.url), ROUTER_ANSWERS))
                loaded = client.run(port, DIGITS, OVERHEAD_CONCURRENCY, str(CLIENT_CORE))
                series[f"{name} c=1"].add(one)
                series[name].add(loaded)
                line = (
                    f"overhead rep {rep}: {name:6} c=1 p50 {one.p50 * 1e3:.3f} ms, "
                    f"c={OVERHEAD_CONCURRENCY} p50 {loaded.p50 * 1e3:.3f} ms "
                    f"{loaded.rate:,.0f} req/s"
                )
                if name == "router":  # its CPU over every request it answered in the run
                    answered = _sum(scrape_metrics(router.url), ROUTER_ANSWERS) - before[1]
                    cpu = (meter() - before[0]) / answered if answered > 0 else float("nan")
                    series[name].cpu.append(cpu)
                    line += f", router CPU {cpu * 1e6:.0f} µs per request"
                if client.perf:  # gRPC needs perf_analyzer
                    over_grpc = client.run(
                        grpc_port, DIGITS, OVERHEAD_CONCURRENCY, str(CLIENT_CORE), "grpc"
                    )
                    series[f"{name} grpc"].add(over_grpc)
                    line += f"; gRPC p50 {over_grpc.p50 * 1e3:.3f} ms {over_grpc.rate:,.0f} req/s"
                ctx.say(SUITE, line)
    return series


def alternate(systems: list[T], rep: int) -> list[T]:
    """The systems in turn, in reverse order on even repetitions: drift hits both sides."""
    return systems if rep % 2 else systems[::-1]


def measure_hedging(ctx: Context, client: Client) -> dict[str, Series]:
    series = {"no hedge": Series(), "hedge": Series()}
    root = ctx.work / "hedging"
    rates = (0.0, 0.0, 0.05)  # replica 2 stalls on 5% of its calls
    repositories = [staller_repository(root, i, rate) for i, rate in enumerate(rates)]
    starts = [partial(start_lockgate, r, ctx.work, *GATE_OFF, *NO_GRPC) for r in repositories]
    with (
        started(*starts) as replicas,
        started(
            lambda: start_router(ctx.work, replicas, "--no-hedge"),
            lambda: start_router(ctx.work, replicas),
        ) as (plain, hedged),
    ):
        # perf_analyzer's statistics are the sum over the replicas each router finds usable:
        # one found usable between its two reads would add all it counted before
        for router in (plain, hedged):
            _wait_usable(router, len(replicas))
        for rep in range(1, ctx.repetitions + 1):
            for name, router in (("no hedge", plain), ("hedge", hedged)):
                before = scrape_metrics(router.url)
                closed = client.run(router.port, STALLER, HEDGE_CONCURRENCY, "1")
                after = scrape_metrics(router.url)
                sent = _sum(after, "lockgate_router_hedges_total") - _sum(
                    before, "lockgate_router_hedges_total"
                )
                asked = _sum(after, "lockgate_router_requests_total") - _sum(
                    before, "lockgate_router_requests_total"
                )
                series[name].add(closed)
                series[name].extra.append(sent / asked if asked else float("nan"))
                ctx.say(
                    SUITE,
                    f"hedging rep {rep}: {name:8} p50 {closed.p50 * 1e3:.2f} ms "
                    f"p99 {closed.p99 * 1e3:.2f} ms, extra copies {sent:.0f} of {asked:.0f}",
                )
    return series


def measure_replicas(ctx: Context, client: Client, repository: Path) -> dict[str, Series]:
    systems = [ServeSetup(1), ServeSetup(2, "kernel"), ServeSetup(2, "router")]
    series = {system.name: Series() for system in systems}
    sweep = QUICK_SWEEP if ctx.quick else SWEEP
    for rep in range(1, ctx.repetitions + 1):
        for system in alternate(systems, rep):
            name = system.name
            base = _free_run(system.count)
            private = [f"http://127.0.0.1:{base + i}" for i in range(system.count)]
            with started(partial(start_serve, repository, ctx.work, system, base)) as (s,):
                best = Closed(float("nan"), float("nan"), 0.0, 0)
                best_share, best_idle = float("nan"), float("nan")
                for concurrency in sweep:
                    before = _answered(private) if system.balance == "kernel" else []
                    meter = ServerMeter(s.process.pid)
                    try:
                        closed = client.replicas(s.port, DIGITS, concurrency, meter)
                    except RuntimeError as exc:  # errors at this level: it does not count
                        ctx.say(SUITE, f"replicas rep {rep}: {name} c={concurrency}: {exc}")
                        continue
                    share = _busier(before, _answered(private)) if before else float("nan")
                    idle = max(meter.idle(), default=float("nan"))  # the idlest replica's
                    ctx.say(
                        SUITE,
                        f"replicas rep {rep}: {name} c={concurrency} {closed.rate:,.0f} req/s "
                        f"p99 {closed.p99 * 1e3:.2f} ms, CPU per request: server "
                        f"{closed.server_cpu / closed.requests * 1e6:.0f} µs, client "
                        f"{closed.client_cpu / closed.requests * 1e6:.0f} µs"
                        + (f", busier replica {share:.0%}" if before else "")
                        + (
                            f", idlest event loop idle {idle:.0%}"
                            if system.balance != "router"
                            else ""
                        ),
                    )
                    if closed.p99 < P99_BOUND_S and closed.rate > best.rate:
                        best, best_share, best_idle = closed, share, idle
                series[name].add(best)
                series[name].cpu.append(best.server_cpu / max(1, best.requests))
                series[name].client.append(best.client_cpu / max(1, best.requests))
                series[name].busier.append(best_share)
                series[name].idle.append(best_idle)
    return series


def _answered(urls: list[str]) -> list[float]:
    """Successful requests each replica counted so far, on its private port."""
    return [
        sum(v for k, v in scrape_metrics(url).items() if k.startswith("lockgate_requests_total{"))
        for url in urls
    ]


def _busier(before: list[float], after: list[float]) -> float:
    """The share of the requests between two counts that the busier replica answered."""
    grown = [b - a for a, b in zip(before, after, strict=True)]
    return max(grown) / sum(grown) if sum(grown) > 0 else float("nan")


@dataclass(slots=True)
class ServerMeter:
    """The server's CPU seconds so far (user and system, of process `pid` and its descendants;
    those that exited are not counted), read just before and after the timed requests, from
    /proc (Linux; nan elsewhere). Each read also notes how long the event loop (the main
    thread) of each process that serves (a leaf of the server's process tree: each replica,
    or the one process) has run and waited for a core so far (/proc/PID/schedstat), so that
    `idle` can tell how long each sat with nothing to do."""

    pid: int
    reads: list[tuple[float, dict[int, float]]] = field(default_factory=list)

    def __call__(self) -> float:
        if not Path("/proc").is_dir():
            return float("nan")
        parents, times = _processes()
        tree = _tree(self.pid, parents)
        leaves = tree - {parents[member] for member in tree if member in parents}
        self.reads.append((time.perf_counter(), {pid: _loop_busy(pid) for pid in leaves}))
        return sum(times.get(member, 0.0) for member in tree)

    def idle(self) -> list[float]:
        """Each serving process's share of the time between the last two reads in which its
        event loop neither ran nor waited for a core (none: not measured)."""
        if len(self.reads) < 2:
            return []
        (start, before), (end, after) = self.reads[-2:]
        wall = end - start
        return [1 - (after[pid] - before[pid]) / wall for pid in after if pid in before]


def _loop_busy(pid: int) -> float:
    """Seconds process `pid`'s main thread has run or waited for a core (nan: unknown)."""
    try:
        run, wait = Path(f"/proc/{pid}/schedstat").read_text().split()[:2]
    except (OSError, ValueError):
        return float("nan")
    return (int(run) + int(wait)) / 1e9


def _processes() -> tuple[dict[int, int], dict[int, float]]:
    """Every process's parent and CPU seconds so far, from /proc (empty elsewhere)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                parents[int(entry.name)] = int(fields[1])
                times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / _TICKS
    return parents, times


def _tree(pid: int, parents: dict[int, int]) -> set[int]:
    """`pid` and its descendants."""
    tree, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _wait_ready(server: Server, url: str, timeout: float = 120.0) -> None:
    """Until `url` (a replica's private port) says it is ready."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url + "/v2/health/ready", timeout=1.0) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{server.name}: {url} not ready:\n{server.log_tail()}")


def _wait_usable(server: Server, count: int, timeout: float = 120.0) -> None:
    """Until the router behind `server` has `count` usable replicas."""
    import json
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(server.url + "/router/replicas", timeout=5) as response:
            listed = json.loads(response.read())["replicas"]
        if sum(1 for r in listed if r["usable"]) >= count:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{server.name}: fewer than {count} replicas usable:\n{server.log_tail()}")


def _sum(values: dict[str, float], name: str) -> float:
    return sum(v for k, v in values.items() if k.split("{")[0] == name)


# -- the suite -------------------------------------------------------------------------


def run(ctx: Context) -> SuiteResult:
    started_at = time.perf_counter()
    client = Client(ctx)
    ctx.say(SUITE, f"client: {client.name}; for the replicas: {client.replicas_name}")
    digits = digits_repository(ctx)
    overhead = measure_overhead(ctx, client, digits)
    hedging = measure_hedging(ctx, client)
    replicas = measure_replicas(ctx, client, digits)
    result = report(overhead, hedging, replicas, client)
    result.seconds = time.perf_counter() - started_at
    return result


def report(
    overhead: dict[str, Series],
    hedging: dict[str, Series],
    replicas: dict[str, Series],
    client: Client,
) -> SuiteResult:
    ms = 1e3
    c = OVERHEAD_CONCURRENCY
    added = (median(overhead["router"].p50) - median(overhead["direct"].p50)) * ms
    kept = median(overhead["router"].rate) / median(overhead["direct"].rate)
    cut = median(hedging["no hedge"].p99) / median(hedging["hedge"].p99)
    extra = median(hedging["hedge"].extra)
    one = median(replicas[ServeSetup(1).name].rate)
    kernel = median(replicas[ServeSetup(2, "kernel").name].rate)
    router = median(replicas[ServeSetup(2, "router").name].rate)
    scaled = kernel / one if one > 0 else float("nan")
    checks = [
        added <= TARGET_ADDED_P50_MS,
        kept >= TARGET_KEPT,
        cut >= TARGET_HEDGE_CUT and extra <= TARGET_HEDGE_EXTRA,
        scaled >= TARGET_REPLICAS_RATIO,
    ]
    result = SuiteResult(
        suite=SUITE,
        title="Router: overhead, hedging, replicas",
        target=(
            f"through the router with one replica, c={c}: added p50 ≤ {TARGET_ADDED_P50_MS:g} ms "
            f"and throughput ≥ {TARGET_KEPT:.0%} of direct; hedging cuts p99 ≥ "
            f"{TARGET_HEDGE_CUT:g}x for ≤ {TARGET_HEDGE_EXTRA:.0%} extra requests; "
            f"--replicas 2 --balance kernel ≥ {TARGET_REPLICAS_RATIO:g}x the throughput of 1 "
            f"at p99 < {P99_BOUND_S * ms:g} ms"
        ),
        met=all(checks),
        environment=environment(),
    )
    for q, values in (("p50", "p50"), ("p99", "p99")):
        result.add(
            f"router c={c} {q}",
            median(getattr(overhead["router"], values)) * ms,
            "ms",
            baseline_label=f"direct c={c} {q}",
            baseline=median(getattr(overhead["direct"], values)) * ms,
        )
    result.add(
        f"added p50, c={c} (router - direct)",
        added,
        "ms",
        note=f"target ≤ {TARGET_ADDED_P50_MS:g} ms",
    )
    result.add(
        "added p50, c=1 (router - direct)",
        (median(overhead["router c=1"].p50) - median(overhead["direct c=1"].p50)) * ms,
        "ms",
        note="the hop's own cost, no queueing",
    )
    result.add(
        f"router c={c} throughput",
        median(overhead["router"].rate),
        "req/s",
        baseline_label=f"direct c={c}",
        baseline=median(overhead["direct"].rate),
        note=f"kept {kept:.0%}; target ≥ {TARGET_KEPT:.0%}",
    )
    if overhead["router"].cpu:
        result.add(
            f"router CPU per proxied request, c={c}",
            median(overhead["router"].cpu) * 1e6,
            "µs",
            note="not a target: the router's process over the requests it answered, on the "
            "client's core",
        )
    if overhead["router grpc"].rate:  # perf_analyzer was there to speak gRPC
        for label, values, unit, scale in (
            ("p50", "p50", "ms", ms),
            ("throughput", "rate", "req/s", 1.0),
        ):
            result.add(
                f"gRPC through the router, c={c} {label}",
                median(getattr(overhead["router grpc"], values)) * scale,
                unit,
                baseline_label=f"gRPC direct c={c} {label}",
                baseline=median(getattr(overhead["direct grpc"], values)) * scale,
                note="not a target: the gRPC front, passed through as bytes",
            )
    result.add(
        "hedged p99",
        median(hedging["hedge"].p99) * ms,
        "ms",
        baseline_label="--no-hedge p99",
        baseline=median(hedging["no hedge"].p99) * ms,
        note=f"cut {cut:.1f}x; target ≥ {TARGET_HEDGE_CUT:g}x",
    )
    result.add(
        "hedged p50",
        median(hedging["hedge"].p50) * ms,
        "ms",
        baseline_label="--no-hedge p50",
        baseline=median(hedging["no hedge"].p50) * ms,
    )
    result.add(
        "extra copies sent by hedging",
        extra * 100,
        "% of requests",
        note=f"target ≤ {TARGET_HEDGE_EXTRA:.0%}",
    )
    result.add(
        f"--replicas 2 --balance kernel, best throughput with p99 < {P99_BOUND_S * ms:g} ms",
        kernel,
        "req/s",
        baseline_label="--replicas 1",
        baseline=one,
        note=f"target ≥ {TARGET_REPLICAS_RATIO:g}x",
    )
    result.add(
        f"--replicas 2 --balance router, best throughput with p99 < {P99_BOUND_S * ms:g} ms",
        router,
        "req/s",
        baseline_label="--replicas 1",
        baseline=one,
        note="not a target: the router shares the two cores with the replicas",
    )
    for system in (ServeSetup(1), ServeSetup(2, "kernel"), ServeSetup(2, "router")):
        result.add(
            f"{system.name}: server CPU per request (all its processes)",
            median(replicas[system.name].cpu) * 1e6,
            "µs",
            note="at the best throughput above, over the timed requests; not a target: what "
            "each way of balancing costs, whatever the machine's other load leaves it",
        )
    for system in (ServeSetup(1), ServeSetup(2, "kernel")):
        rate, cpu = median(replicas[system.name].rate), median(replicas[system.name].cpu)
        result.add(
            f"{system.name}: cores its processes kept busy at that throughput",
            rate * cpu,
            "cores",
            note="throughput x CPU per request (one process runs digits on its event loop: "
            "at most one core)",
        )
    two = replicas[ServeSetup(2, "kernel").name]
    client_cpu = median(two.client)
    result.add(
        "the client's CPU per request (--replicas 2 --balance kernel, at its best)",
        client_cpu * 1e6,
        "µs",
        note=f"{kernel * client_cpu:.2f} cores of the 2 at that throughput; "
        f"{client.replicas_name}, on the client core, which the second replica shares",
    )
    ceiling = 2 / (median(two.cpu) + client_cpu)
    alone = 1 / median(replicas[ServeSetup(1).name].cpu)
    result.add(
        "ceiling for --replicas 2 on these 2 cores: 2 / (server + client CPU per request)",
        ceiling,
        "req/s",
        baseline_label="one replica on a core of its own: 1 / its CPU per request",
        baseline=alone,
        note=f"{ceiling / alone:.2f}x: the most two replicas could serve with the client's "
        "CPU taken from the same two cores and no core ever idle, against what one replica "
        "serves when the client's CPU is not its core's",
    )
    result.add(
        "--replicas 2 --balance kernel: the busier replica's share of the requests",
        median(two.busier) * 100,
        "%",
        note="at the best throughput; the kernel places each connection by a hash of its "
        "addresses, and a replica's connections send as fast as it answers them: the one "
        "sharing its core with the client, or with other work, takes fewer",
    )
    for system in (ServeSetup(1), ServeSetup(2, "kernel")):
        result.add(
            f"{system.name}: the idlest replica's event loop, idle",
            median(replicas[system.name].idle) * 100,
            "% of the time",
            note="at the best throughput: the share of the timed requests' time in which it "
            "neither ran nor waited for a core (/proc/PID/schedstat); what it could have "
            "served more had its connections sent more",
        )
    result.notes += [
        f"client: {client.name}; for the replicas: {client.replicas_name}; the router runs "
        "on the client core in the overhead runs",
        "hedging: one of three replicas stalls 50 ms on 5% of its calls (about 1.7% of all "
        "requests before balancing steers around it)",
        "replicas: two cores in all, shared by the replicas, the client and (with "
        "--balance router) the router; a replica on each core (--pin-replicas auto), the "
        "second sharing the client's",
        f"replicas' ceiling: the client ({client.replicas_name}) took {client_cpu * 1e6:.0f} µs of "
        f"CPU per request, {kernel * client_cpu:.2f} of the 2 cores at the two replicas' best; "
        f"with their {median(two.cpu) * 1e6:.0f} µs, two replicas here can serve at most "
        f"{ceiling:,.0f} req/s, {ceiling / alone:.2f}x one replica on a core of its own "
        f"({'below' if ceiling / alone < TARGET_REPLICAS_RATIO else 'above'} the "
        f"{TARGET_REPLICAS_RATIO:g}x target)",
        "the machine was shared with other work while this ran: figures are noisy",
    ]
    result.raw = {
        "overhead": {k: _raw(v) for k, v in overhead.items()},
        "hedging": {k: _raw(v) for k, v in hedging.items()},
        "replicas": {k: _raw(v) for k, v in replicas.items()},
    }
    return result


def _raw(series: Series) -> dict[str, list[float]]:
    raw = {"p50_s": series.p50, "p99_s": series.p99, "req_per_s": series.rate}
    if series.cpu:
        raw["server_cpu_s_per_request"] = series.cpu
        raw["client_cpu_s_per_request"] = series.client
        raw["busier_replica_share"] = series.busier
        raw["idlest_event_loop_idle_share"] = series.idle
    return {**raw, "extra_copies": series.extra} if series.extra else raw
