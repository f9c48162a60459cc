"""refusal_cost: what a refusal costs the server, against a served request, in CPU.

`python -m benchmarks.run --suite refusal_cost [--quick]`

Under overload most requests are refused, and every refusal takes CPU from the requests being
served on the same core. One lockgate, pinned to the server core, serves two models:

- `digits_onnx` from the demo repository (one row per request): the served request.
- `held`: a python model with `latency_slo_ms: 100` whose every batch sleeps 10 s, kept busy
  by a background client that sends it one request at a time. Every other request to it is
  predicted to miss its SLO, so it is refused at the protocol layer, before its body is read:
  the cheapest refusal lockgate makes, and the one it makes under overload. The sleep costs no
  CPU, so what the server spends is the refusals'.

Each round sends the same small requests one at a time on one keep-alive connection (the
`RawClient`, a few microseconds per request), and reads the server's CPU time from /proc
before and after. Rounds alternate; the table gives medians.

Two more measures put the figure in context:

- **Saturated.** One request at a time, the server's core idles between requests, and each
  request pays for waking the loop (an epoll wait, a read, a write, each a system call, with
  cold caches). Under overload the loop never idles: the same requests from 16 connections
  at once (closed loop, raw connections) give the cost per request when the core is busy.
- **Floor.** A bare uvloop protocol that answers every request head with a canned 503, on
  the same core, measured both ways: the least a refusal can cost a Python server on this
  machine, the system calls and the loopback TCP stack included.

Target: a refusal costs <= 10% of the CPU of a served digits_onnx request, one request at a
time (the issue's measure).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.common import (
    SERVER_CORE,
    Context,
    RawClient,
    Server,
    SuiteResult,
    environment,
    free_port,
    pin_command,
    process_cpu_seconds,
    run_async,
    running,
    start_server,
)
from benchmarks.plan_check import SLEEPER
from benchmarks.raw_load import closed_loop, post_request

SUITE = "refusal_cost"
TARGET = 0.10  # refusal CPU / served CPU
# each batch of `held` sleeps this long: longer than a round of refusals on a busy machine, or
# the round's own client, sending the moment it is answered, takes the idle model first when a
# hold ends, and each of its requests waits out a whole hold
HOLD_S = 10.0
HELD_SLO_MS = 100
MAX_NOT_SERVED = 0.01  # of the served rounds' requests: past it, the round measured noise
SATURATING_CONNECTIONS = 16  # closed-loop connections that keep the server's loop busy
SATURATED_S = 3.0  # seconds of each saturated round
FLOOR_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b'content-length: 20\r\nretry-after: 1\r\n\r\n{"error": "refused"}'
)

HELD_CONFIG = f"""\
name: held
backend: python
max_batch_size: 1
inputs:
  - {{name: x, datatype: FP32, dims: [4]}}
outputs:
  - {{name: y, datatype: FP32, dims: [4]}}
latency_slo_ms: {HELD_SLO_MS}
parameters: {{sleep_s: "{HOLD_S}"}}
"""


def write_repository(work: Path) -> Path:
    from lockgate.demo.build import DEMO_MODELS, build_demo_repository

    digits = [m for m in DEMO_MODELS if m.name == "digits_onnx"]
    repo = build_demo_repository(work / "repo", models=digits)
    folder = repo / "held"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(SLEEPER)  # sleeps sleep_s per batch
    (folder / "config.yaml").write_text(HELD_CONFIG)
    return repo


def digits_body() -> bytes:
    from sklearn.datasets import load_digits

    row = (load_digits().data[0] / 16.0).astype(np.float32)
    payload = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": []}]}
    payload["inputs"][0]["data"] = row.tolist()
    return json.dumps(payload).encode()


HELD_BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}
).encode()


class Holder:
    """Keeps `held` busy: one request at a time, each answered after HOLD_S."""

    def __init__(self, server: Server) -> None:
        self.url = f"{server.url}/v2/models/held/infer"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            request = urllib.request.Request(
                self.url, HELD_BODY, {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=HOLD_S + 5) as response:
                    response.read()
            except OSError:
                time.sleep(0.01)  # refused: the model was still busy; ask again

    def __enter__(self) -> Holder:
        self.thread.start()
        time.sleep(0.3)  # the first held batch is running
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=HOLD_S * 2)


def cpu_per_request(server: Server, path: str, body: bytes, count: int) -> tuple[float, int]:
    """Server CPU seconds per request over `count` sequential requests, and how many were
    answered 200."""
    client = RawClient(server.url + path)
    request = client.request(body)
    try:
        for _ in range(50):  # warm the connection and the path
            client.send(request)
        before = process_cpu_seconds(server.process.pid)
        ok = sum(client.send(request) == 200 for _ in range(count))
        used = process_cpu_seconds(server.process.pid) - before
    finally:
        client.close()
    return used / count, ok


class FloorProtocol(asyncio.Protocol):
    """The least a refusal can cost: a canned 503 for every request head, nothing parsed."""

    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        heads = data.count(b"\r\n\r\n")
        if heads:
            self.transport.write(FLOOR_REFUSAL * heads)


async def serve_floor(port: int) -> None:
    loop = asyncio.get_running_loop()
    await loop.create_server(FloorProtocol, "127.0.0.1", port)
    await asyncio.Event().wait()


def start_floor() -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    code = (
        "import sys, uvloop; from benchmarks.refusal_cost import serve_floor; "
        "uvloop.run(serve_floor(int(sys.argv[1])))"
    )
    command = pin_command([sys.executable, "-c", code, str(port)], SERVER_CORE)
    process = subprocess.Popen(command, cwd=Path(__file__).resolve().parent.parent)
    client = None
    deadline = time.monotonic() + 30
    while client is None:
        try:
            client = RawClient(f"http://127.0.0.1:{port}/")
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError("the floor server did not start") from None
            time.sleep(0.1)
    client.close()
    return process, port


def cpu_saturated(pid: int, port: int, path: str, body: bytes) -> tuple[float, int, int]:
    """Server CPU seconds per answer with SATURATING_CONNECTIONS closed-loop connections
    sending at once, the answers, and how many were 200."""
    request = post_request("127.0.0.1", port, path, body)
    load = closed_loop("127.0.0.1", port, [request], SATURATING_CONNECTIONS, SATURATED_S, 5.0)
    before = process_cpu_seconds(pid)
    outcomes = run_async(load)
    used = process_cpu_seconds(pid) - before
    answers = len(outcomes.statuses)
    return used / max(1, answers), answers, outcomes.statuses.count(200)


def floor_costs(rounds: int, count: int) -> tuple[list[float], list[float]]:
    """CPU seconds per canned refusal of the floor server: one at a time, and saturated."""
    process, port = start_floor()
    sequential: list[float] = []
    saturated: list[float] = []
    try:
        client = RawClient(f"http://127.0.0.1:{port}/v2/models/held/infer")
        request = client.request(HELD_BODY)
        for _ in range(50):
            client.send(request)
        for _ in range(rounds):
            before = process_cpu_seconds(process.pid)
            refused = sum(client.send(request) == 503 for _ in range(count))
            sequential.append((process_cpu_seconds(process.pid) - before) / count)
            if refused != count:
                raise RuntimeError(f"the floor refused {refused} of {count}")
            cost, _, _ = cpu_saturated(process.pid, port, "/v2/models/held/infer", HELD_BODY)
            saturated.append(cost)
        client.close()
    finally:
        process.kill()
        process.wait()
    return sequential, saturated


def run(ctx: Context) -> SuiteResult:
    started = time.perf_counter()
    repo = write_repository(ctx.work)
    port = free_port()
    command = [sys.executable, "-m", "lockgate.cli", "serve", str(repo), "--port", str(port)]
    # no refusal pause: one client resending at once would be paused 100 ms per refusal, and
    # this suite measures what each refusal costs, not how many there are
    command += ["--no-llm", "--grpc-port", "off", "--refusal-pause-ms", "0"]
    server = start_server("lockgate", command, port, ctx.work)
    count = 2000 if ctx.quick else 10000
    rounds = 2 if ctx.quick else 5
    served: list[float] = []
    refused: list[float] = []
    served_busy: list[float] = []
    refused_busy: list[float] = []
    not_served = 0
    with running(server):
        body = digits_body()
        pid, port = server.process.pid, server.port
        for r in range(rounds):
            cost, ok = cpu_per_request(server, "/v2/models/digits_onnx/infer", body, count)
            if ok < count * (1 - MAX_NOT_SERVED):  # a busy machine can delay a few past 50 ms
                raise RuntimeError(f"digits_onnx answered {ok} of {count} with 200")
            served.append(cost)
            not_served += count - ok
            cost, answers, ok = cpu_saturated(pid, port, "/v2/models/digits_onnx/infer", body)
            if ok < answers * (1 - MAX_NOT_SERVED):
                raise RuntimeError(f"digits_onnx answered {ok} of {answers} with 200, saturated")
            served_busy.append(cost)
            with Holder(server):
                cost, ok = cpu_per_request(server, "/v2/models/held/infer", HELD_BODY, count)
                if ok > count // 100:
                    raise RuntimeError(f"held admitted {ok} of {count}: it was not kept busy")
                refused.append(cost)
                cost, answers, ok = cpu_saturated(pid, port, "/v2/models/held/infer", HELD_BODY)
                if ok > answers // 100:
                    raise RuntimeError(f"held admitted {ok} of {answers}: it was not kept busy")
                refused_busy.append(cost)
            ctx.say(
                SUITE,
                f"round {r + 1}/{rounds}: served {served[-1] * 1e6:.1f} µs, "
                f"refused {refused[-1] * 1e6:.1f} µs of server CPU per request; saturated, "
                f"served {served_busy[-1] * 1e6:.1f} µs, refused {refused_busy[-1] * 1e6:.1f} µs",
            )
    floor, floor_busy = floor_costs(rounds, count)
    ctx.say(
        SUITE,
        f"floor (canned 503 on bare uvloop): {statistics.median(floor) * 1e6:.1f} µs one at a "
        f"time, {statistics.median(floor_busy) * 1e6:.1f} µs saturated",
    )
    served_us = statistics.median(served) * 1e6
    refused_us = statistics.median(refused) * 1e6
    result = SuiteResult(
        suite=SUITE,
        title="What a refusal costs: server CPU per request refused before its body, "
        "against a served digits_onnx request",
        target=f"refusal <= {TARGET:.0%} of a served request's CPU",
        met=refused_us <= TARGET * served_us,
        environment=environment(),
    )
    served_busy_us = statistics.median(served_busy) * 1e6
    busy = f"saturated ({SATURATING_CONNECTIONS} connections at once)"
    rows = [
        ("served digits_onnx request", served, None, 0.0),
        ("refused before the body", refused, "served request", served_us),
        ("floor: canned 503 on a bare uvloop protocol", floor, "served request", served_us),
        (f"{busy}: served digits_onnx request", served_busy, None, 0.0),
        (f"{busy}: refused before the body", refused_busy, "served, saturated", served_busy_us),
        (f"{busy}: floor", floor_busy, "served, saturated", served_busy_us),
    ]
    for label, seconds, baseline_label, baseline in rows:
        value = statistics.median(seconds) * 1e6
        if baseline_label is None:
            result.add(label, value, "µs CPU")
        else:
            result.add(label, value, "µs CPU", baseline_label=baseline_label, baseline=baseline)
    result.notes.append(
        f"Medians of {rounds} rounds of {count} sequential requests on one keep-alive "
        "connection, server pinned to its core; CPU is the server process's user + system "
        "time from /proc, client excluded."
    )
    result.notes.append(
        f"Saturated: {SATURATING_CONNECTIONS} raw keep-alive connections in a closed loop for "
        f"{SATURATED_S:g} s a round, so the server's loop never waits for the next request. "
        "Floor: a uvloop protocol on the server core that answers each request head with a "
        "canned 503, parsing nothing; one request at a time, the system calls and the wake-up "
        "of an idle core make most of any refusal's cost."
    )
    if not_served:
        result.notes.append(
            f"{not_served} of the served rounds' {rounds * count} digits_onnx requests were "
            "not answered 200 (refused or past the 50 ms SLO on a busy machine); their CPU "
            "is in the served figure."
        )
    result.raw = {
        "served_s": served,
        "refused_s": refused,
        "served_saturated_s": served_busy,
        "refused_saturated_s": refused_busy,
        "floor_s": floor,
        "floor_saturated_s": floor_busy,
        "count": count,
    }
    result.seconds = time.perf_counter() - started
    return result
